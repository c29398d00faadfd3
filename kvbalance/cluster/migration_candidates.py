"""Candidate moves for the adaptive migration, priced with the cost models of ``kvbalance.perf.migration``.

For a hot GPU and a helper GPU, each candidate says what the move costs (bytes, seconds until it
lands) and the utilisations it predicts once landed: at the same step rate, a GPU's utilisation scales
with its busy seconds per step, so ``U_src' = U_src * busy_after / step_before`` and the helper gains
``U_src * helper_busy / step_before``. The representative step is the hot instance's current batch.

A move's price and predicted stage times depend on the helper only through its cost model (model, GPU,
TP) and the link, not on its load: ``candidates_from`` prices each distinct (helper hardware, link) once
(``memo``) and reuses it for every helper like it, which keeps a control tick on 8 GPUs cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvbalance.cluster.migration import ATTENTION, LAYER, MigrationCandidate
from kvbalance.cluster.migration_memory import GPUMemory
from kvbalance.perf.cost import CostModel, SeqWork
from kvbalance.perf.migration import (
    attention_migration_cost,
    attention_split_step,
    layer_migration_cost,
    pipeline_step,
)
from kvbalance.specs import LinkSpec


@dataclass(frozen=True)
class GPUState:
    """What the candidate builder needs to know about one GPU."""

    gpu: str
    cost_model: CostModel  # the model it serves on this GPU's hardware
    utilization: float  # the monitor's combined U_g
    memory: GPUMemory
    batch: tuple[SeqWork, ...] = ()  # its instance's representative step
    kv_tokens: int = 0  # context tokens of its running requests
    decode_tokens_per_s: float = 0.0  # tokens its running decodes add per second (all requests)


def _priced(memo: dict | None, key: tuple, price: Callable[[], Any]) -> Any:
    if memo is None:
        return price()
    if key not in memo:
        memo[key] = price()
    return memo[key]


def _hw_key(cm: CostModel, link: LinkSpec | str) -> tuple:
    return (cm.model.name, cm.gpu.name, cm.tp, cm.link.name, link if isinstance(link, str) else link.name)


def layer_candidates(
    src: GPUState,
    dst: GPUState,
    link: LinkSpec | str,
    splits: Sequence[float] = (0.125, 0.25, 0.375, 0.5),
    memo: dict | None = None,
) -> list[MigrationCandidate]:
    """Move the last ``fraction`` of the layers ``[k, L)`` from ``src`` to ``dst`` (src keeps ``[0, k)``)."""
    cm = src.cost_model
    L = cm.model.num_layers
    if not src.batch:
        return []
    before = cm.step_seconds(list(src.batch))
    out = []
    for f in splits:
        k = L - max(1, round(f * L))
        if not 0 < k < L or any(c.layers == (k, L) for c in out):
            continue
        key = ("layer", k, _hw_key(dst.cost_model, link))
        cost, p = _priced(
            memo,
            key,
            lambda k=k: (
                layer_migration_cost(cm, (k, L), src.kv_tokens, link, src.decode_tokens_per_s),
                pipeline_step(cm, dst.cost_model, list(src.batch), k, link),
            ),
        )
        if cost.weight_bytes + cost.kv_bytes > dst.memory.free_bytes:
            continue
        out.append(
            MigrationCandidate(
                kind=LAYER,
                src=src.gpu,
                dst=dst.gpu,
                transfer_s=cost.transfer_s,
                src_util_after=src.utilization * p.stage1.total_s / before,
                dst_util_after=dst.utilization + src.utilization * p.stage2.total_s / before,
                weight_bytes=cost.weight_bytes,
                kv_bytes=cost.kv_bytes,
                layers=(k, L),
            )
        )
    return out


def attention_candidates(
    src: GPUState,
    dst: GPUState,
    link: LinkSpec | str,
    head_shares: Sequence[float] = (0.125, 0.25, 0.5),
    memo: dict | None = None,
) -> list[MigrationCandidate]:
    """Move the K/V of ``share`` of ``src``'s KV heads (all running decodes' context) to ``dst``."""
    cm = src.cost_model
    if not src.batch or not src.kv_tokens or not any(n == 1 for n, _, _ in src.batch):
        return []
    kv_on_gpu = max(cm.model.num_kv_heads // cm.tp, 1)
    before = cm.step_seconds(list(src.batch))
    out = []
    for share in head_shares:
        n = max(1, round(share * kv_on_gpu))
        if n >= kv_on_gpu or any(c.kv_heads == n for c in out):
            continue  # moving every head is a request migration, not a split
        key = ("attention", n, _hw_key(dst.cost_model, link))
        (nbytes, seconds), s = _priced(
            memo,
            key,
            lambda n=n: (
                attention_migration_cost(cm, n, src.kv_tokens, link),
                attention_split_step(cm, dst.cost_model, list(src.batch), n / kv_on_gpu, 1.0, link),
            ),
        )
        if nbytes > dst.memory.free_bytes:
            continue
        out.append(
            MigrationCandidate(
                kind=ATTENTION,
                src=src.gpu,
                dst=dst.gpu,
                transfer_s=seconds,
                src_util_after=src.utilization * s.home_busy_s / before,
                dst_util_after=dst.utilization + src.utilization * s.helper_busy_s / before,
                kv_bytes=nbytes,
                kv_heads=n,
            )
        )
    return out


def candidates_from(
    hot: GPUState, helpers: Sequence[GPUState], link: LinkSpec | str, memo: dict | None = None
) -> list[MigrationCandidate]:
    """Every layer- and attention-level move from ``hot`` to each helper (helpers in the order given).

    ``memo``: prices already computed for ``hot``'s batch (pass one dict per hot GPU and tick)."""
    out: list[MigrationCandidate] = []
    memo = {} if memo is None else memo
    for h in helpers:
        if h.gpu != hot.gpu:
            out += attention_candidates(hot, h, link, memo=memo) + layer_candidates(hot, h, link, memo=memo)
    return out
