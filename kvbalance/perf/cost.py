"""Roofline cost model of one serving step: per-operator FLOPs and bytes on a HardwareSpec, plus tensor-parallel
all-reduce, launch overheads and the LM head for sampling tokens only (DESIGN.md, "The cost model").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvbalance.batch import BatchPlan, StepBreakdown
from kvbalance.perf.memory import kv_bytes_per_token, validate_tp
from kvbalance.specs import HardwareSpec, LinkSpec, ModelSpec, get_gpu, get_link, get_model

# (num_new_tokens, context_len_after_step, samples)
SeqWork = tuple[int, int, bool]

GEMM, ATTENTION, ELEMENTWISE = "gemm", "attention", "elementwise"

# Per-layer and per-step operator names, in execution order (calibration relies on a fixed order).
OP_NAMES = (
    "embedding",
    "norm",
    "qkv_proj",
    "elementwise",
    "attn_prefill",
    "attn_decode",
    "o_proj",
    "mlp_up",
    "mlp_down",
    "final_norm",
    "lm_head",
)


@dataclass(frozen=True, slots=True)
class OpCount:
    """One operator's work per kernel launch on one GPU, launched ``repeat`` times per step."""

    name: str
    kind: str  # GEMM, ATTENTION or ELEMENTWISE
    flops: float
    bytes: float
    size_tokens: float  # the M dimension (tokens) that sets the compute efficiency
    repeat: int = 1


@dataclass(frozen=True, slots=True)
class OpTime:
    """An operator's roofline: totals over its ``repeat`` launches (seconds, per GPU)."""

    name: str
    kind: str
    flops: float
    bytes: float
    compute_s: float
    memory_s: float

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"

    def to_dict(self) -> dict:
        return {
            "flops": self.flops,
            "bytes": self.bytes,
            "compute_s": self.compute_s,
            "memory_s": self.memory_s,
            "time_s": self.time_s,
            "bound": self.bound,
        }


def compute_time_s(flops: float, size_tokens: float, hw: HardwareSpec, kind: str = GEMM) -> float:
    """flops / (peak * eff_c(size)), eff_c(x) = eff_max * x / (x + x_half); attention scaled by its ratio."""
    if flops <= 0:
        return 0.0
    eff = hw.compute_eff_max * (hw.attention_eff_ratio if kind == ATTENTION else 1.0)
    x = max(size_tokens, 1.0)
    return flops * (x + hw.compute_half_tokens) / (x * hw.peak_flops * eff)


def memory_time_s(num_bytes: float, hw: HardwareSpec, kind: str = GEMM) -> float:
    """bytes / (bw * eff_m(bytes)), eff_m(b) = eff_max * b / (b + b_half); attention's KV reads scaled
    by ``kv_memory_eff_ratio``."""
    if num_bytes <= 0:
        return 0.0
    eff = hw.memory_eff_max * (hw.kv_memory_eff_ratio if kind == ATTENTION else 1.0)
    return (num_bytes + hw.memory_half_bytes) / (hw.mem_bandwidth_bytes_s * eff)


def op_time(op: OpCount, hw: HardwareSpec) -> OpTime:
    r = op.repeat
    return OpTime(
        name=op.name,
        kind=op.kind,
        flops=op.flops * r,
        bytes=op.bytes * r,
        compute_s=compute_time_s(op.flops, op.size_tokens, hw, op.kind) * r,
        memory_s=memory_time_s(op.bytes, hw, op.kind) * r,
    )


def transfer_time(num_bytes: float, link: LinkSpec) -> float:
    """Seconds to move ``num_bytes`` over ``link``: latency + bytes / bandwidth (0 for nothing to move)."""
    if num_bytes < 0:
        raise ValueError(f"num_bytes: must be >= 0, got {num_bytes}")
    if num_bytes == 0:
        return 0.0
    return link.latency_s + num_bytes / link.bandwidth_bytes_s


def allreduce_time(num_bytes: float, tp: int, link: LinkSpec) -> float:
    """Ring all-reduce among ``tp`` GPUs: 2 (tp - 1) / tp * bytes / bandwidth + latency."""
    if tp <= 1 or num_bytes <= 0:
        return 0.0
    return 2.0 * (tp - 1) / tp * num_bytes / link.bandwidth_bytes_s + link.latency_s


def breakdown_total_s(b: StepBreakdown) -> float:
    """Duration of a step from its breakdown (the parts are disjoint)."""
    return b.compute_s + b.memory_s + b.overhead_s + b.comm_s + b.transfer_s


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """KV heads each TP rank stores (replicated when there are fewer KV heads than ranks)."""
    return max(model.num_kv_heads // tp, 1)


class CostModel:
    """Predicts a step's duration for ``model`` on ``gpu`` with tensor parallelism ``tp``.

    ``link`` is the TP interconnect (defaults to the GPU's ``tp_link``). All FLOPs and bytes are per GPU.
    """

    def __init__(
        self,
        model: ModelSpec | str,
        gpu: HardwareSpec | str,
        tp: int = 1,
        link: LinkSpec | str | None = None,
    ) -> None:
        self.model = get_model(model)
        self.gpu = get_gpu(gpu)
        validate_tp(self.model, tp)
        self.tp = tp
        self.link = get_link(link) if link is not None else self.gpu.tp_link
        m = self.model
        dt = m.dtype_bytes
        self._h = m.hidden_size
        self._dt = dt
        self._q_r = m.q_dim // tp
        self._kv_r = kv_heads_per_rank(m, tp) * m.head_dim
        self._heads_r = m.num_heads // tp
        self._inter_r = m.intermediate_size // tp
        self._vocab_r = math.ceil(m.vocab_size / tp)
        self._kv_token_layer_bytes = 2 * self._kv_r * dt  # K and V of one token in one layer, this rank
        self.kv_bytes_per_token = kv_bytes_per_token(m, tp)
        # GEMM shapes (K, N) per rank, and bias elements added to their weights
        bias_qkv = self._q_r + 2 * self._kv_r if (m.qkv_bias or m.linear_bias) else 0
        bias_o = self._h if m.linear_bias else 0
        bias_up = m.mlp_in_matrices * self._inter_r if m.linear_bias else 0
        bias_down = self._h if m.linear_bias else 0
        self._gemms = {
            "qkv_proj": (self._h, self._q_r + 2 * self._kv_r, bias_qkv),
            "o_proj": (self._q_r, self._h, bias_o),
            "mlp_up": (self._h, m.mlp_in_matrices * self._inter_r, bias_up),
            "mlp_down": (self._inter_r, self._h, bias_down),
        }
        self.overhead_s = self.gpu.step_overhead_s + self.gpu.per_layer_overhead_s * m.num_layers

    # -- operator counts -------------------------------------------------------------------------
    def _gemm(self, name: str, tokens: float, k: int, n: int, bias: int = 0, repeat: int = 1) -> OpCount:
        dt = self._dt
        return OpCount(
            name=name,
            kind=GEMM,
            flops=2.0 * tokens * k * n,
            bytes=dt * (k * n + bias + tokens * (k + n)),
            size_tokens=tokens,
            repeat=repeat,
        )

    def op_counts(self, seqs: Sequence[SeqWork]) -> list[OpCount]:
        """Per-GPU work of every operator for a step over ``seqs`` (in ``OP_NAMES`` order, absent ones left out)."""
        m, dt, h, L = self.model, self._dt, self._h, self.model.num_layers
        tokens = 0
        sampled = 0
        pre_tokens = 0
        pre_pairs = 0.0  # (query, key) pairs attended by prefill-chunk tokens, causal
        pre_ctx = 0
        dec_seqs = 0
        dec_ctx = 0
        for n, ctx, sample in seqs:
            if n < 1:
                raise ValueError(f"num_new_tokens: must be >= 1, got {n}")
            if ctx < n:
                raise ValueError(f"context_len: {ctx} is smaller than num_new_tokens {n}")
            tokens += n
            if sample:
                sampled += 1
            if n == 1:
                dec_seqs += 1
                dec_ctx += ctx
            else:
                pre_tokens += n
                pre_ctx += ctx
                # token i of the chunk (0-based) sees ctx - n + i + 1 keys
                pre_pairs += n * (ctx - n) + n * (n + 1) / 2
        if tokens == 0:
            return []
        T = float(tokens)
        ops: list[OpCount] = []
        ops.append(OpCount("embedding", ELEMENTWISE, 0.0, 2.0 * T * h * dt, T))
        norm_params = h if m.arch == "llama" else 2 * h
        ops.append(OpCount("norm", ELEMENTWISE, 5.0 * T * h, dt * (2 * T * h + norm_params), T, repeat=2 * L))
        k, n_, b = self._gemms["qkv_proj"]
        ops.append(self._gemm("qkv_proj", T, k, n_, b, repeat=L))
        # rotary on q and k (llama), KV-cache write, activation (SwiGLU / ReLU), two residual adds
        q_r, kv_r, i_r = self._q_r, self._kv_r, self._inter_r
        ew_bytes = 4.0 * T * kv_r + 6.0 * T * h  # KV write (read k, v; write cache) + residual adds
        ew_flops = 2.0 * T * h
        if m.arch == "llama":
            ew_bytes += 2.0 * T * (q_r + kv_r) + 3.0 * T * i_r
            ew_flops += 3.0 * T * (q_r + kv_r) + 5.0 * T * i_r
        else:
            ew_bytes += 2.0 * T * i_r
            ew_flops += T * i_r
        ops.append(OpCount("elementwise", ELEMENTWISE, ew_flops, ew_bytes * dt, T, repeat=L))
        hd, heads_r, kvl = m.head_dim, self._heads_r, self._kv_token_layer_bytes
        if pre_tokens:
            # QK^T and PV: 2 * head_dim FLOPs each per (query, key) pair and head; KV of the context read
            # once (tiles of one head stay in L2), q read and output written.
            ops.append(
                OpCount(
                    "attn_prefill",
                    ATTENTION,
                    4.0 * hd * heads_r * pre_pairs,
                    pre_ctx * kvl + 2.0 * pre_tokens * q_r * dt,
                    pre_tokens,
                    repeat=L,
                )
            )
        if dec_seqs:
            ops.append(
                OpCount(
                    "attn_decode",
                    ATTENTION,
                    4.0 * hd * heads_r * dec_ctx,
                    dec_ctx * kvl + 2.0 * dec_seqs * q_r * dt,
                    dec_seqs,
                    repeat=L,
                )
            )
        for name in ("o_proj", "mlp_up", "mlp_down"):
            k, n_, b = self._gemms[name]
            ops.append(self._gemm(name, T, k, n_, b, repeat=L))
        ops.append(OpCount("final_norm", ELEMENTWISE, 5.0 * T * h, dt * (2 * T * h + norm_params), T))
        if sampled:
            ops.append(self._gemm("lm_head", float(sampled), h, self._vocab_r))
        return ops

    def comm_s(self, num_tokens: int) -> float:
        """Tensor-parallel all-reduce time: two per layer (after attention and after the MLP)."""
        if self.tp == 1 or num_tokens == 0:
            return 0.0
        per = allreduce_time(num_tokens * self._h * self._dt, self.tp, self.link)
        return 2 * self.model.num_layers * per

    # -- predictions -------------------------------------------------------------------------------
    def op_times(self, seqs: Sequence[SeqWork]) -> dict[str, OpTime]:
        """Roofline of every operator (totals over layers), keyed by operator name."""
        return {op.name: op_time(op, self.gpu) for op in self.op_counts(seqs)}

    def step(self, seqs: Sequence[SeqWork]) -> StepBreakdown:
        """Breakdown of a step computing ``seqs`` = [(num_new_tokens, context_len_after_step, samples)]."""
        ops = self.op_counts(seqs)
        if not ops:
            return StepBreakdown()
        b = StepBreakdown(overhead_s=self.overhead_s)
        hw = self.gpu
        tokens = 0
        for op in ops:
            r = op.repeat
            c = compute_time_s(op.flops, op.size_tokens, hw, op.kind)
            mem = memory_time_s(op.bytes, hw, op.kind)
            if c > mem:
                b.compute_s += c * r
            else:
                b.memory_s += mem * r
            b.flops += op.flops * r
            b.bytes += op.bytes * r
            if op.name == "embedding":
                tokens = int(op.size_tokens)
        b.comm_s = self.comm_s(tokens)
        return b

    def step_seconds(self, seqs: Sequence[SeqWork]) -> float:
        return breakdown_total_s(self.step(seqs))

    @staticmethod
    def plan_seqs(plan: BatchPlan) -> list[SeqWork]:
        return [(s.num_new_tokens, s.context_len, s.sample) for s in plan.seqs]

    def predict(self, plan: BatchPlan) -> StepBreakdown:
        """Breakdown of the compute in ``plan`` (KV transfers are the executor's business)."""
        return self.step(self.plan_seqs(plan))

    def step_time(self, plan: BatchPlan) -> float:
        return breakdown_total_s(self.predict(plan))

    # -- roofline crossover ---------------------------------------------------------------------------
    def gemm_bound(self, tokens: int, gemm: str = "mlp_up") -> str:
        """Whether a weight GEMM with M = ``tokens`` is "memory"- or "compute"-bound on this GPU."""
        if gemm not in self._gemms:
            raise ValueError(f"gemm: unknown {gemm!r} (known: {', '.join(self._gemms)})")
        k, n, b = self._gemms[gemm]
        return op_time(self._gemm(gemm, float(tokens), k, n, b), self.gpu).bound

    def gemm_crossover_tokens(self, gemm: str = "mlp_up", limit: int = 1 << 20) -> int:
        """Smallest token count at which ``gemm`` is compute-bound (binary search)."""
        if self.gemm_bound(limit, gemm) == "memory":
            return limit
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi) // 2
            if self.gemm_bound(mid, gemm) == "compute":
                hi = mid
            else:
                lo = mid + 1
        return lo

    def kv_transfer_bytes(self, num_tokens: int) -> int:
        """Bytes of KV this GPU holds for ``num_tokens`` tokens (all layers)."""
        return num_tokens * self.kv_bytes_per_token


# -- reporting -------------------------------------------------------------------------------------


def step_cost_report(
    model: ModelSpec | str,
    gpu: HardwareSpec | str,
    tp: int = 1,
    prefill_tokens: int = 0,
    decode_batch: int = 0,
    context: int = 0,
    link: LinkSpec | str | None = None,
) -> dict:
    """Cost of one step: a prefill of ``prefill_tokens`` (sampling its last token) plus ``decode_batch``
    decodes at ``context`` tokens each. JSON-ready (used by ``kvbalance cost --json``)."""
    for name, v in (("prefill_tokens", prefill_tokens), ("decode_batch", decode_batch), ("context", context)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name}: must be a non-negative integer, got {v!r}")
    if decode_batch and context < 1:
        raise ValueError(f"context: must be >= 1 when decode_batch > 0, got {context}")
    if not prefill_tokens and not decode_batch:
        raise ValueError("prefill_tokens: give prefill_tokens > 0 or decode_batch > 0 (the step is empty)")
    cm = CostModel(model, gpu, tp, link)
    seqs: list[SeqWork] = [(1, context, True)] * decode_batch
    if prefill_tokens:
        seqs.append((prefill_tokens, prefill_tokens, True))
    b = cm.step(seqs)
    total = breakdown_total_s(b)
    tokens = prefill_tokens + decode_batch
    return {
        "model": cm.model.name,
        "gpu": cm.gpu.name,
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
