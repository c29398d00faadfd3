"""The two yardsticks of an offline job's makespan (BlendServe section 6): the ideal bound and the practical
optimum.

* Ideal bound: max((1 - s_opt) T_comp, T_mem) from the density formulas (``density.py``) at the GPU's
  saturated rates, with s_opt the DFS sharing ratio. The paper calls it impractical: it charges no weight
  reads per step, no kernel below its best efficiency, no host time.
* Practical optimum: the paper profiles its own engine's kernels and takes the time of a perfectly overlapped
  run. Here, in the cost model's own terms: the job run as N identical steps, each carrying 1/N of every kind
  of the job's work (perfect blending of compute- and memory-heavy requests, every shared prefix computed
  once), with as many requests decoding per step as the KV memory holds, each step timed by the same step
  model the planners' engine runs (overlap mode, its interference factor, the engine profile's host time
  when it is counted). The KV memory M holds n = min(max_num_seqs, M / c) decoding requests, with
  c = sum d (p + d / 2) / sum d the KV a decoding request holds on average over the steps it decodes; the
  job's decode steps are N = max(sum d / n, prefill tokens / chunk budget), and each step computes n decode
  tokens at context c and (1 - s_opt) sum p / N prefill tokens at the token-weighted mean prompt length.
  T_practical = N x step time. It is not a bound in the strict sense (a schedule with different batch
  sizes over time may beat it by a little), it is the figure a planner that blends perfectly would reach
  on this engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbalance.perf.cost import CostModel, breakdown_total_s
from kvbalance.perf.overlap import step_model


@dataclass(frozen=True)
class PracticalOptimum:
    makespan_s: float
    num_steps: float
    decode_batch: float  # n: requests decoding per step
    decode_context_tokens: float  # c
    prefill_tokens_per_step: float
    step_s: float


def practical_optimum(
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    dfs_sharing: float,
    cost_model: CostModel,
    kv_tokens: int,
    max_num_seqs: int,
    chunk_tokens: int,
    mode: str = "overlap",
    interference_factor: float = 1.10,
) -> PracticalOptimum:
    """The practical optimum of a job (module docstring) on ``cost_model`` in step ``mode``."""
    if not 0 <= dfs_sharing <= 1:
        raise ValueError(f"dfs_sharing: must be in [0, 1], got {dfs_sharing}")
    if kv_tokens < 1 or max_num_seqs < 1 or chunk_tokens < 1:
        raise ValueError("kv_tokens, max_num_seqs, chunk_tokens: must be >= 1")
    p = np.asarray(prompt_lens, dtype=np.float64)
    d = np.asarray(output_lens, dtype=np.float64)
    if len(p) == 0 or len(p) != len(d):
        raise ValueError(f"output_lens: need one per prompt ({len(p)}), got {len(d)}")
    decode_tokens = float(d.sum())
    context = float((d * (p + d / 2)).sum() / decode_tokens)
    n_cap = max(1.0, min(float(max_num_seqs), kv_tokens / context))
    prefill = (1.0 - dfs_sharing) * float(p.sum())
    # the step's token budget holds its decodes and its prefill chunk
    steps = max(decode_tokens / n_cap, prefill / max(chunk_tokens - n_cap, 1.0), 1.0)
    n = max(1, int(round(decode_tokens / steps)))
    steps = max(decode_tokens / n, 1.0)
    per_step = prefill / steps
    prefill_context = float((p * p).sum() / p.sum())  # a prompt token's prompt length, token-weighted
    seqs = [(1, int(round(context)), True)] * n
    if per_step >= 1:
        seqs.append((int(round(per_step)), int(round(max(prefill_context, per_step))), False))
    step_s = breakdown_total_s(step_model(cost_model, mode, interference_factor).step(seqs))
    return PracticalOptimum(steps * step_s, steps, float(n), context, per_step, step_s)
