"""Cost models of moving work between GPUs without stopping service: BanaServe's layer-level and
attention-level module migration, and Llumnix's request-level live migration.

Pure functions over :class:`~kvbalance.perf.cost.CostModel` (its public API only: ``op_counts``,
``op_times``, ``kv_bytes_per_token``, ``overhead_s``, ``comm_s``) and the link presets. Every move costs
``bytes / link bandwidth + latency`` (``transfer_time``) plus a synchronisation (one handshake round
trip by default) and takes effect when its last byte lands; the step-time functions say what a step
costs afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvbalance.perf.cost import CostModel, OpTime, SeqWork, transfer_time
from kvbalance.specs import LinkSpec, get_link

LSE_BYTES = 4  # one float32 log-sum-exp per head per token (FlashAttention keeps its LSE in fp32)


def default_sync_s(link: LinkSpec) -> float:
    """Synchronisation of a move: one handshake round trip (request + acknowledgement) on the link."""
    return 2.0 * link.latency_s


def _check_range(cm: CostModel, layers: tuple[int, int]) -> tuple[int, int]:
    a, b = layers
    L = cm.model.num_layers
    if not (isinstance(a, int) and isinstance(b, int) and 0 <= a < b <= L):
        raise ValueError(f"layers: need 0 <= a < b <= {L} (num_layers of {cm.model.name}), got {layers!r}")
    return a, b


def _check_nonneg(**values: float) -> None:
    for name, v in values.items():
        if not v >= 0:
            raise ValueError(f"{name}: must be >= 0, got {v!r}")


# -- request-level live migration (Llumnix) and the pre-copy rounds every KV move shares --------------


@dataclass(frozen=True, slots=True)
class LiveMigrationCost:
    """Multi-stage copy while the request keeps decoding, then a stop-and-copy of the last blocks.

    ``round_blocks[i]`` blocks move in pre-copy round i (round 0: everything written so far; round i:
    the blocks written, or re-dirtied, during round i - 1), ``final_blocks`` during the stop-and-copy.
    """

    round_blocks: tuple[int, ...]
    final_blocks: int
    precopy_s: float  # the request keeps decoding during these seconds
    downtime_s: float  # the request alone pauses: last copy + synchronisation
    total_bytes: int
    converged: bool  # False: decodes dirty blocks faster than the link drains them (max_rounds hit)

    @property
    def rounds(self) -> int:
        return len(self.round_blocks)

    @property
    def total_s(self) -> float:
        return self.precopy_s + self.downtime_s


def live_migration_cost(
    context_tokens: int,
    decode_tokens_per_s: float,
    block_size: int,
    block_bytes: float,
    link: LinkSpec | str,
    stop_copy_blocks: int = 1,
    max_rounds: int = 8,
    sync_s: float | None = None,
    fixed_bytes: float = 0.0,
    num_requests: int = 1,
) -> LiveMigrationCost:
    """Llumnix's (OSDI '24) live migration of a request's KV: copy the blocks, then the blocks
    written meanwhile, ... until at most ``stop_copy_blocks`` remain (or ``max_rounds``), then pause the
    request for one last copy.

    The request decodes ``decode_tokens_per_s`` tokens per second; tokens at positions
    ``[0, context_tokens)`` exist at the start. A round copying ``n`` blocks takes
    ``latency + n * block_bytes / bandwidth``. A partial last block is copied and, being written again,
    copied again next round. ``fixed_bytes`` (weights, for a layer move) ride in round 0.
    ``num_requests`` alike requests (each with ``context_tokens`` and the per-request rate) move
    together: each round carries every request's dirty blocks.
    """
    link = get_link(link)
    sync = default_sync_s(link) if sync_s is None else sync_s
    _check_nonneg(context_tokens=context_tokens, decode_tokens_per_s=decode_tokens_per_s, sync_s=sync)
    _check_nonneg(block_bytes=block_bytes, fixed_bytes=fixed_bytes, stop_copy_blocks=stop_copy_blocks)
    for name, v in (("block_size", block_size), ("num_requests", num_requests), ("max_rounds", max_rounds)):
        if not (isinstance(v, int) and v >= 1):
            raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
    clean_block, pos, t = 0, context_tokens, 0.0  # blocks [0, clean_block) copied and full; tokens so far
    rounds: list[int] = []
    total_bytes = extra = fixed_bytes
    while True:
        dirty = num_requests * (math.ceil(pos / block_size) - clean_block)
        if rounds and (dirty <= stop_copy_blocks or len(rounds) >= max_rounds):
            break
        nbytes = dirty * block_bytes + extra
        dt = transfer_time(nbytes, link)
        rounds.append(dirty)
        total_bytes += dirty * block_bytes
        extra = 0.0
        clean_block = pos // block_size
        t += dt
        pos = context_tokens + math.floor(decode_tokens_per_s * t)
    converged = dirty <= stop_copy_blocks
    downtime = transfer_time(dirty * block_bytes, link) + sync
    total_bytes += dirty * block_bytes
    return LiveMigrationCost(tuple(rounds), dirty, t, downtime, int(round(total_bytes)), converged)


# -- layer-level migration (BanaServe) ----------------------------------------------------------------


def layer_weight_bytes(cm: CostModel, layers: tuple[int, int]) -> int:
    """Weights of layers ``[a, b)`` on one GPU: ``(b - a) * layer_params * dtype / tp``."""
    a, b = _check_range(cm, layers)
    m = cm.model
    return (b - a) * m.layer_params * m.dtype_bytes // cm.tp


def layer_kv_bytes_per_token(cm: CostModel, layers: tuple[int, int]) -> float:
    """KV bytes per token of layers ``[a, b)`` on one GPU: ``kv_bytes_per_token * (b - a) / L``."""
    a, b = _check_range(cm, layers)
    return cm.kv_bytes_per_token * (b - a) / cm.model.num_layers


@dataclass(frozen=True, slots=True)
class LayerMigrationCost:
    layers: tuple[int, int]
    weight_bytes: int
    kv_bytes: int  # KV of the running requests in those layers at the start
    live: LiveMigrationCost  # the copy: weights + KV in round 0, then the KV written meanwhile

    @property
    def total_bytes(self) -> int:
        return self.live.total_bytes

    @property
    def transfer_s(self) -> float:
        """From start until the move takes effect (service never stops; the final switch waits for the
        last blocks and the synchronisation between two steps)."""
        return self.live.total_s


def layer_migration_cost(
    cm: CostModel,
    layers: tuple[int, int],
    kv_tokens: int,
    link: LinkSpec | str,
    decode_tokens_per_s: float = 0.0,
    block_size: int = 16,
    sync_s: float | None = None,
    num_requests: int = 1,
) -> LayerMigrationCost:
    """Move layers ``[a, b)``: their weights plus the KV of ``kv_tokens`` running tokens in those layers.

    Decodes keep writing KV into the moving layers (``decode_tokens_per_s`` over all ``num_requests``
    running requests), so the KV goes in pre-copy rounds as in :func:`live_migration_cost` (requests
    taken alike: ``kv_tokens // num_requests`` context each), weights in the first round; the copy stops
    when at most one block per request is left, copied between two steps.
    """
    _check_nonneg(kv_tokens=kv_tokens)
    if not (isinstance(num_requests, int) and num_requests >= 1):
        raise ValueError(f"num_requests: must be an integer >= 1, got {num_requests!r}")
    w, per_tok, n = layer_weight_bytes(cm, layers), layer_kv_bytes_per_token(cm, layers), num_requests
    live = live_migration_cost(
        kv_tokens // n, decode_tokens_per_s / n, block_size, per_tok * block_size, link, n, 8, sync_s, w, n
    )
    return LayerMigrationCost((layers[0], layers[1]), w, int(round(kv_tokens * per_tok)), live)


@dataclass(frozen=True, slots=True)
class StageTimes:
    """One layer range's share of a step on its GPU."""

    compute_s: float
    memory_s: float
    overhead_s: float
    comm_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.memory_s + self.overhead_s + self.comm_s


def stage_times(cm: CostModel, seqs: Sequence[SeqWork], layers: tuple[int, int]) -> StageTimes:
    """The step's time restricted to layers ``[a, b)`` on ``cm``'s GPU.

    Per-layer operators (``OpCount.repeat`` a multiple of L) count ``(b - a) / L`` of their total;
    per-step operators before the first layer (embedding) go to the stage holding layer 0, those after
    the last (final norm, LM head) to the stage holding layer L - 1. The overhead is the engine's fixed host
    time once per stage (a serial engine's fixed host work and sync; an overlapped engine's sync), the rest of
    the host time it exposes (per sequence, per token) and the per-layer launch gaps in proportion to its
    layers, plus its operators' kernel latencies; the TP all-reduce scales with the layers.
    """
    a, b = _check_range(cm, layers)
    L = cm.model.num_layers
    counts = cm.op_counts(seqs)
    if not counts:
        return StageTimes(0.0, 0.0, 0.0, 0.0)
    times = cm.op_times(seqs)
    share = (b - a) / L
    compute = memory = latency = 0.0
    seen_layer_op = False
    for op in counts:
        t: OpTime = times[op.name]
        per_layer = op.repeat >= L and op.repeat % L == 0
        if per_layer:
            seen_layer_op = True
            f = share
        elif not seen_layer_op:
            f = 1.0 if a == 0 else 0.0
        else:
            f = 1.0 if b == L else 0.0
        if t.compute_s > t.memory_s:
            compute += f * t.compute_s
        else:
            memory += f * t.memory_s
        latency += f * t.latency_s
    tokens = sum(n for n, _, _ in seqs)
    fixed = cm.step_fixed_host_s
    if cm.engine.overlap:  # the host work hides under the step; each stage still waits on the engine's sync
        exposed = cm.host_time(seqs).exposed_s + cm.gpu.per_layer_overhead_s * L
    else:
        exposed = cm.host_overhead_s(len(seqs), tokens) + cm.engine.sync_s
    overhead = fixed + (exposed - fixed) * share + latency
    return StageTimes(compute, memory, overhead, cm.comm_s(tokens) * share)


@dataclass(frozen=True, slots=True)
class PipelineStep:
    """A migrated instance's step as a two-stage pipeline across two GPUs."""

    stage1: StageTimes  # layers [0, k) on the home GPU
    handoff_s: float  # activations [tokens, hidden] over the link
    stage2: StageTimes  # layers [k, L) on the helper GPU

    @property
    def latency_s(self) -> float:
        """One step end to end: stage 1, hand-off, stage 2 (a decode's next token needs all three)."""
        return self.stage1.total_s + self.handoff_s + self.stage2.total_s

    @property
    def interval_s(self) -> float:
        """Steady-state time between independent steps (e.g. prefill batches) when the stages overlap."""
        return max(self.stage1.total_s, self.handoff_s, self.stage2.total_s)


def activation_bytes(cm: CostModel, num_tokens: int) -> int:
    """The hidden state handed between stages: ``tokens * hidden_size * dtype`` (replicated per TP rank)."""
    return num_tokens * cm.model.hidden_size * cm.model.dtype_bytes


def pipeline_step(
    home: CostModel, helper: CostModel, seqs: Sequence[SeqWork], split_layer: int, link: LinkSpec | str
) -> PipelineStep:
    """Step time after layers ``[split_layer, L)`` moved to ``helper``'s GPU (same model on both)."""
    if home.model != helper.model:
        raise ValueError(f"helper: runs {helper.model.name}, home runs {home.model.name}")
    L = home.model.num_layers
    if not 0 < split_layer < L:
        raise ValueError(f"split_layer: need 0 < k < {L}, got {split_layer}")
    tokens = sum(n for n, _, _ in seqs)
    handoff = transfer_time(activation_bytes(home, tokens), get_link(link))
    return PipelineStep(
        stage_times(home, seqs, (0, split_layer)), handoff, stage_times(helper, seqs, (split_layer, L))
    )


# -- attention-level migration (BanaServe) --------------------------------------------------------


def attention_migration_cost(
    cm: CostModel, kv_heads: int, context_tokens: int, link: LinkSpec | str, sync_s: float | None = None
) -> tuple[int, float]:
    """``(bytes, seconds)`` to move the K/V of ``kv_heads`` of this GPU's KV heads, over
    ``context_tokens`` tokens of running decodes, to a helper: ``bytes = tokens * kv_bytes_per_token *
    kv_heads / kv_heads_on_gpu``; seconds = ``transfer_time + sync``.

    Only the blocks that exist at the start move; the home keeps writing the new tokens' K/V of every
    head (it computes the projections), so nothing is re-copied and nothing pauses: the home attends its
    own copy until the transfer lands, then frees it and merges the helper's partial outputs.
    """
    kv_on_gpu = cm.model.num_kv_heads // cm.tp if cm.model.num_kv_heads >= cm.tp else 1
    if not 0 < kv_heads < kv_on_gpu:
        raise ValueError(
            f"kv_heads: need 0 < n < {kv_on_gpu} (KV heads on this GPU; all of them is a request move), got {kv_heads}"
        )
    _check_nonneg(context_tokens=context_tokens)
    lk = get_link(link)
    nbytes = int(round(context_tokens * cm.kv_bytes_per_token * kv_heads / kv_on_gpu))
    return nbytes, transfer_time(nbytes, lk) + (default_sync_s(lk) if sync_s is None else sync_s)


@dataclass(frozen=True, slots=True)
class AttentionSplitStep:
    """A decode step whose attention for some heads' migrated context runs on a helper GPU."""

    step_s: float  # the step's latency on the home instance
    home_busy_s: float  # home GPU work (everything but the helper's partial attention)
    helper_busy_s: float  # helper GPU work: its partial attention plus its launches
    exchange_bytes: int  # per step: queries out, partial outputs + LSE back, every layer
    exchange_s: float
    helper_flops: float = 0.0  # the decode attention's FLOPs and bytes the helper runs
    helper_bytes: float = 0.0


def merge_exchange_bytes(
    cm: CostModel, num_decodes: int, kv_head_share: float, lse_bytes: int = LSE_BYTES
) -> float:
    """Per layer: the moved query heads' queries to the helper, their partial outputs and one LSE each
    back: ``decodes * heads_moved * (2 * head_dim * dtype + lse_bytes)``."""
    heads = cm.model.num_heads // cm.tp * kv_head_share
    hd, dt = cm.model.head_dim, cm.model.dtype_bytes
    return num_decodes * heads * (2 * hd * dt + lse_bytes)


def attention_split_step(
    home: CostModel,
    helper: CostModel,
    seqs: Sequence[SeqWork],
    kv_head_share: float,
    helper_context_share: float,
    link: LinkSpec | str,
) -> AttentionSplitStep:
    """Step time after ``kv_head_share`` of the KV heads moved, their ``helper_context_share`` of the
    decode context living on the helper (1 right after the move, shrinking as decodes add tokens home).

    Decode attention's FLOPs and bytes split by ``moved = head share * context share``: the home runs
    ``1 - moved`` of them, the helper ``moved`` (at its GPU's roofline). Per layer the two partial
    attentions run side by side: ``max(home part, query out + helper part + output back)``; the
    log-sum-exp merge is an elementwise pass over [decodes, heads, head_dim], left in the home's noise.
    """
    for name, v in (("kv_head_share", kv_head_share), ("helper_context_share", helper_context_share)):
        if not 0 <= v <= 1:
            raise ValueError(f"{name}: must be in [0, 1], got {v!r}")
    if home.model != helper.model:
        raise ValueError(f"helper: runs {helper.model.name}, home runs {home.model.name}")
    L = home.model.num_layers
    full = stage_times(home, seqs, (0, L))
    attn = home.op_times(seqs).get("attn_decode")
    moved = kv_head_share * helper_context_share
    if attn is None or moved == 0:
        return AttentionSplitStep(full.total_s, full.total_s, 0.0, 0, 0.0)
    lk = get_link(link)
    decodes = sum(1 for n, _, _ in seqs if n == 1)
    q_out = merge_exchange_bytes(home, decodes, kv_head_share, lse_bytes=0) / 2  # queries to the helper
    back = merge_exchange_bytes(home, decodes, kv_head_share) - q_out  # partial outputs + LSE back
    per_layer_x = transfer_time(q_out, lk) + transfer_time(back, lk)
    home_attn_l = (1 - moved) * attn.time_s / L
    helper_attn_l = moved * helper.op_times(seqs)["attn_decode"].time_s / L + helper.gpu.per_layer_overhead_s
    rest = full.total_s - attn.time_s
    step = rest + L * max(home_attn_l, per_layer_x + helper_attn_l)
    return AttentionSplitStep(
        step_s=step,
        home_busy_s=rest + L * home_attn_l,
        helper_busy_s=L * helper_attn_l,
        exchange_bytes=int(round((q_out + back) * L)),
        exchange_s=L * per_layer_x,
        helper_flops=moved * attn.flops,
        helper_bytes=moved * attn.bytes,
    )
