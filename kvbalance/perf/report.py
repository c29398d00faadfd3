"""One step's cost as a JSON-ready report (``kvbalance cost``): a prefill and/or a decode batch on the cost
model, with the per-operator rooflines.
"""

from __future__ import annotations

from kvbalance.perf.cost import CostModel, SeqWork, breakdown_total_s
from kvbalance.perf.engines import EngineProfile
from kvbalance.specs import HardwareSpec, LinkSpec, ModelSpec, gpu_provenance


def step_cost_report(
    model: ModelSpec | str,
    gpu: HardwareSpec | str,
    tp: int = 1,
    prefill_tokens: int = 0,
    decode_batch: int = 0,
    context: int = 0,
    link: LinkSpec | str | None = None,
    engine: EngineProfile | str | None = None,
) -> dict:
    """Cost of one step: a prefill of ``prefill_tokens`` (sampling its last token) plus ``decode_batch``
    decodes at ``context`` tokens each, under the engine profile ``engine`` (default: the GPU's default).
    JSON-ready (used by ``kvbalance cost --json``): the step time, its GPU time and the engine's host time
    (``host``: work, launch and sync, the part exposed and the part the overlap hid), and where the GPU
    preset's curves come from (``gpu_fit``)."""
    for name, v in (("prefill_tokens", prefill_tokens), ("decode_batch", decode_batch), ("context", context)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name}: must be a non-negative integer, got {v!r}")
    if decode_batch and context < 1:
        raise ValueError(f"context: must be >= 1 when decode_batch > 0, got {context}")
    if not prefill_tokens and not decode_batch:
        raise ValueError("prefill_tokens: give prefill_tokens > 0 or decode_batch > 0 (the step is empty)")
    cm = CostModel(model, gpu, tp, link, engine=engine)
    seqs: list[SeqWork] = [(1, context, True)] * decode_batch
    if prefill_tokens:
        seqs.append((prefill_tokens, prefill_tokens, True))
    b = cm.step(seqs)
    total = breakdown_total_s(b)
    host = cm.host_time(seqs)
    tokens = prefill_tokens + decode_batch
    return {
        "model": cm.model.name,
        "gpu": cm.gpu.name,
        "gpu_fit": gpu_provenance(cm.gpu),
        "engine": cm.engine.name,
        "gpu_time_s": host.gpu_s,
        "host": host.to_dict(),
        "tp": tp,
        "prefill_tokens": prefill_tokens,
        "decode_batch": decode_batch,
        "context": context,
        "step_time_s": total,
        "compute_time_s": b.compute_s,
        "memory_time_s": b.memory_s,
        "overhead_s": b.overhead_s,
        "comm_s": b.comm_s,
        "flops": b.flops,
        "bytes": b.bytes,
        "tokens_per_s": tokens / total if total > 0 else 0.0,
        "mfu": b.flops / (total * cm.gpu.peak_flops) if total > 0 else 0.0,
        "gemm_crossover_tokens": cm.gemm_crossover_tokens(),
        "ops": {name: t.to_dict() for name, t in cm.op_times(seqs).items()},
    }
