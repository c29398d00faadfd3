"""Per-kernel cost formulas of the roofline model: what one operator launch moves and computes (GEMM and
element-wise counts) and how long it takes on a HardwareSpec (compute curve, memory curves, kernel latency).
:mod:`kvbalance.perf.cost` assembles them into a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbalance.specs import HardwareSpec, MemoryCurve

GEMM, ATTENTION, ELEMENTWISE = "gemm", "attention", "elementwise"

ELEMENTWISE_OPS = ("embedding", "norm", "final_norm", "rope", "kv_write", "activation", "residual_add")


def elementwise_class(op: str, arch: str = "llama") -> str:
    """The element-wise class (HardwareSpec.elementwise_curves key) of operator ``op`` in a model of ``arch``:
    llama runs RMSNorm and SwiGLU, opt LayerNorm and a plain activation. The KV-cache write has no profile of
    its own: it follows the rotary kernel's curve (the same per-token rows of heads)."""
    if op in ("norm", "final_norm"):
        return "norm" if arch == "llama" else "layer_norm"
    if op == "activation":
        return "activation" if arch == "llama" else "activation_ungated"
    if op == "kv_write":
        return "rope"
    if op in ELEMENTWISE_OPS:
        return op
    raise ValueError(f"op: {op!r} is not an element-wise operator (known: {', '.join(ELEMENTWISE_OPS)})")


@dataclass(frozen=True, slots=True)
class OpCount:
    """One operator's work per kernel launch on one GPU, launched ``repeat`` times per step."""

    name: str
    kind: str  # GEMM, ATTENTION or ELEMENTWISE
    flops: float
    bytes: float
    size_tokens: float  # the M dimension (tokens) that sets the compute efficiency
    repeat: int = 1
    curve: str = ""  # element-wise class (HardwareSpec.elementwise_curves key); "" for GEMMs and attention


@dataclass(frozen=True, slots=True)
class OpTime:
    """An operator's roofline: totals over its ``repeat`` launches (seconds, per GPU). ``latency_s`` is the
    kernels' fixed time (launch and ramp), which a step books as overhead."""

    name: str
    kind: str
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    latency_s: float = 0.0

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.latency_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"

    def to_dict(self) -> dict:
        return {
            "flops": self.flops,
            "bytes": self.bytes,
            "compute_s": self.compute_s,
            "memory_s": self.memory_s,
            "latency_s": self.latency_s,
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


def memory_time_s(
    num_bytes: float, hw: HardwareSpec, kind: str = GEMM, size_tokens: float = 1.0, curve: str = ""
) -> float:
    """Element-wise class ``curve`` with a fitted :class:`MemoryCurve`: bytes * max(T, T_sat) / (T * bw * e),
    e = :func:`curve_eff`, with T in the numerator padded towards whole waves (:func:`wave_rows`); at or below the curve's ``small_tokens``, its small path ``small_per_token_s * T``.
    Otherwise bytes / (bw * eff_m(bytes)), eff_m(b) = eff_max * b / (b + b_half); attention's KV reads scaled
    by ``kv_memory_eff_ratio``."""
    if num_bytes <= 0:
        return 0.0
    c = hw.elementwise_curves.get(curve) if curve else None
    if c is not None:
        x = max(size_tokens, 1.0)
        if x <= c.small_tokens:
            return c.small_per_token_s * x
        rows = wave_rows(x, c.wave_weight, hw.num_sms)
        return (
            num_bytes * max(rows, c.sat_tokens) / (x * hw.mem_bandwidth_bytes_s * curve_eff(c, num_bytes, hw))
        )
    eff = hw.memory_eff_max * (hw.kv_memory_eff_ratio if kind == ATTENTION else 1.0)
    return (num_bytes + hw.memory_half_bytes) / (hw.mem_bandwidth_bytes_s * eff)


def wave_rows(tokens, wave_weight: float, num_sms: int):
    """Token rows a one-block-per-row kernel pays for: T + w * (ceil(T / SMs) * SMs - T) (T without SMs or w)."""
    if wave_weight <= 0 or num_sms <= 0:
        return tokens
    return tokens + wave_weight * (-(-tokens // num_sms) * num_sms - tokens)  # ceil, for floats and arrays


def curve_eff(c: MemoryCurve, num_bytes, hw: HardwareSpec):
    """A class's bandwidth fraction for a launch moving ``num_bytes``: eff + gain / (1 + (bytes / (s L2)) ** p)
    (:class:`~kvbalance.specs.MemoryCurve`)."""
    if hw.l2_cache_bytes <= 0 or c.l2_eff_gain == 0:
        return c.eff
    return c.eff + c.l2_eff_gain / (
        1.0 + (num_bytes / (c.l2_bytes_scale * hw.l2_cache_bytes)) ** c.l2_sharpness
    )


def kernel_latency_s(hw: HardwareSpec, kind: str, curve: str = "", size_tokens: float = math.inf) -> float:
    """Fixed time of one kernel: the class curve's latency for element-wise kernels (its small path's at or
    below ``small_tokens``; by default the large-token latency), else the GPU's."""
    if kind == ELEMENTWISE:
        c = hw.elementwise_curves.get(curve) if curve else None
        if c is None:
            return 0.0
        return c.small_latency_s if max(size_tokens, 1.0) <= c.small_tokens else c.latency_s
    return hw.kernel_latency_s


def op_time(op: OpCount, hw: HardwareSpec) -> OpTime:
    r = op.repeat
    curve = op.curve
    return OpTime(
        name=op.name,
        kind=op.kind,
        flops=op.flops * r,
        bytes=op.bytes * r,
        compute_s=compute_time_s(op.flops, op.size_tokens, hw, op.kind) * r,
        memory_s=memory_time_s(op.bytes, hw, op.kind, op.size_tokens, curve) * r,
        latency_s=kernel_latency_s(hw, op.kind, curve, op.size_tokens) * r,
    )


def gemm_count(name: str, tokens: float, k: int, n: int, dtype_bytes: int, bias: int = 0, repeat: int = 1):
    """A weight GEMM [tokens x k] @ [k x n] (+ bias of ``bias`` elements): 2 M K N FLOPs; weights, input and
    output moved once."""
    return OpCount(
        name=name,
        kind=GEMM,
        flops=2.0 * tokens * k * n,
        bytes=dtype_bytes * (k * n + bias + tokens * (k + n)),
        size_tokens=tokens,
        repeat=repeat,
    )


def elementwise_counts(
    tokens: float,
    hidden: int,
    q_r: int,
    kv_r: int,
    inter_r: int,
    dtype_bytes: int,
    gated: bool,
    norm_params: int,
) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) of one launch of each element-wise kernel over ``tokens`` tokens on one rank:
    embedding gather, norm, rotary on q and k, KV-cache write, MLP activation (SwiGLU reads gate and up, or
    one input), one residual add."""
    T, h, dt = float(tokens), hidden, dtype_bytes
    act = (5.0 * T * inter_r, 3.0 * T * inter_r * dt) if gated else (T * inter_r, 2.0 * T * inter_r * dt)
    return {
        "embedding": (0.0, 2.0 * T * h * dt),
        "norm": (5.0 * T * h, dt * (2.0 * T * h + norm_params)),
        "rope": (3.0 * T * (q_r + kv_r), 2.0 * T * (q_r + kv_r) * dt),
        "kv_write": (0.0, 4.0 * T * kv_r * dt),
        "activation": act,
        "residual_add": (T * h, 3.0 * T * h * dt),
    }
