"""Fit a HardwareSpec's efficiency factors and overheads to measured step times (profile -> fitted preset),
with a guessed CPU base spec for real runs on this machine.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvbalance.perf.cost import ATTENTION, OP_NAMES, CostModel, SeqWork, curve_eff
from kvbalance.perf.kernels import wave_rows
from kvbalance.specs import HardwareSpec, ModelSpec, get_link, get_model

# (seqs of the step, measured seconds)
ProfileSample = tuple[Sequence[SeqWork], float]

FITTABLE = (
    "compute_eff_max",
    "memory_eff_max",
    "attention_eff_ratio",
    "kv_memory_eff_ratio",
    "step_overhead_s",
    "per_layer_overhead_s",
    "compute_half_tokens",
    "memory_half_bytes",
)
_FRACTIONS = {"compute_eff_max", "memory_eff_max", "attention_eff_ratio"}
# Step and per-layer overhead are collinear for one model (both constant per step): fit the step overhead
# only unless profiles span models with different layer counts.
DEFAULT_FIT = ("compute_eff_max", "memory_eff_max", "step_overhead_s")


def cpu_base_spec(
    num_cores: int | None = None,
    freq_hz: float = 2.5e9,
    flops_per_cycle: int = 32,
    name: str = "cpu",
) -> HardwareSpec:
    """A guessed spec for this machine's CPU, to be refined by :func:`fit_hardware`.

    Guesses (documented, not measured): peak = cores * 2.5 GHz * 32 FLOP/cycle (two 256-bit FMA units on
    fp32: 2 units * 8 lanes * 2 FLOPs); memory bandwidth = 6 GB/s per core clamped to [20, 300] GB/s
    (a desktop's two DDR channels to a server's eight or twelve); capacity = physical RAM. Efficiencies
    assume eager PyTorch: GEMMs saturate early (half at M=4) near 50%, attention (unfused) at 0.3x that,
    2 ms per step and 50 us per layer of Python/dispatch overhead.
    """
    cores = num_cores or os.cpu_count() or 1
    if cores < 1:
        raise ValueError(f"num_cores: must be >= 1, got {cores}")
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 << 30
    return HardwareSpec(
        name=name,
        peak_flops=cores * freq_hz * flops_per_cycle,
        mem_bandwidth_bytes_s=min(max(cores * 6e9, 20e9), 300e9),
        mem_capacity_bytes=int(ram),
        compute_eff_max=0.5,
        compute_half_tokens=4.0,
        memory_eff_max=0.7,
        memory_half_bytes=64 * 1024,
        attention_eff_ratio=0.3,
        step_overhead_s=2e-3,
        per_layer_overhead_s=50e-6,
        tp_link=get_link("pcie4"),
        kind="cpu",
        source=f"guess from {cores} cores (kvbalance.perf.calibrate.cpu_base_spec)",
    )


class _Features:
    """Per-sample, per-operator FLOPs, bytes, sizes and repeats: everything that does not depend on the fit.

    :meth:`predict` is the vectorised form of :meth:`CostModel.step_seconds` (a test holds them equal)."""

    def __init__(self, cm: CostModel, samples: Sequence[ProfileSample]) -> None:
        n, k = len(samples), len(OP_NAMES)
        col = {name: j for j, name in enumerate(OP_NAMES)}
        self.flops = np.zeros((n, k))
        self.bytes = np.zeros((n, k))
        self.size = np.ones((n, k))
        self.repeat = np.zeros((n, k))
        self.comm = np.zeros(n)
        self.num_seqs = np.array([len(seqs) for seqs, _ in samples], dtype=float)
        self.num_tokens = np.array([sum(s[0] for s in seqs) for seqs, _ in samples], dtype=float)
        self.attention = np.array([name.startswith("attn") for name in OP_NAMES])
        self.curve = [""] * k
        for i, (seqs, _) in enumerate(samples):
            ops = cm.op_counts(seqs)
            for op in ops:
                j = col[op.name]
                assert (op.kind == ATTENTION) == self.attention[j]
                self.flops[i, j] = op.flops
                self.bytes[i, j] = op.bytes
                self.size[i, j] = max(op.size_tokens, 1.0)
                self.repeat[i, j] = op.repeat
                self.curve[j] = op.curve
            self.comm[i] = cm.comm_s(sum(s[0] for s in seqs))
        self.has_bytes = self.bytes > 0
        self.num_layers = cm.model.num_layers
        self.tp = cm.tp

    def predict(self, hw: HardwareSpec) -> np.ndarray:
        eff_c = hw.compute_eff_max * np.where(self.attention, hw.attention_eff_ratio, 1.0)
        compute = self.flops * (self.size + hw.compute_half_tokens) / (self.size * hw.peak_flops * eff_c)
        streaming = (self.bytes + hw.memory_half_bytes) / (
            hw.mem_bandwidth_bytes_s
            * hw.memory_eff_max
            * np.where(self.attention, hw.kv_memory_eff_ratio, 1.0)
        )
        latency = np.broadcast_to(np.full(len(OP_NAMES), hw.kernel_latency_s), self.size.shape).copy()
        for j, cls in enumerate(self.curve):
            if not cls:
                continue
            c = hw.elementwise_curves.get(cls)
            latency[:, j] = c.latency_s if c is not None else 0.0
            if c is not None:
                sz = self.size[:, j]
                streaming[:, j] = (
                    self.bytes[:, j]
                    * np.maximum(wave_rows(sz, c.wave_weight, hw.num_sms), c.sat_tokens)
                    / (sz * hw.mem_bandwidth_bytes_s * curve_eff(c, self.bytes[:, j], hw))
                )
                small = sz <= c.small_tokens
                streaming[small, j] = c.small_per_token_s * sz[small]
                latency[small, j] = c.small_latency_s
        memory = np.where(self.has_bytes, streaming, 0.0)
        ops = ((np.maximum(compute, memory) + latency) * self.repeat).sum(axis=1)
        host = np.array([hw.host_overhead_s(s, t, self.tp) for s, t in zip(self.num_seqs, self.num_tokens)])
        return ops + host + hw.per_layer_overhead_s * self.num_layers + self.comm


def predict_samples(
    model: ModelSpec | str, hw: HardwareSpec, samples: Sequence[ProfileSample], tp: int = 1
) -> np.ndarray:
    """Predicted seconds for each sample's step (vectorised; equals ``CostModel.step_seconds`` under the
    ``hardware`` engine profile: the spec's own host terms, paid serially, over its own TP link)."""
    cm = CostModel(model, hw, tp, engine="hardware")
    return _Features(cm, samples).predict(hw)


def nelder_mead(
    f: Callable[[np.ndarray], float],
    x0: np.ndarray,
    step: float = 0.5,
    max_iter: int = 2000,
    xtol: float = 1e-7,
    ftol: float = 1e-12,
) -> tuple[np.ndarray, float]:
    """Minimise ``f`` from ``x0`` with SciPy's Nelder-Mead simplex (reflect 1, expand 2, contract 0.5, shrink
    0.5), started from ``x0`` and ``x0 + step`` along each axis; stops after ``max_iter`` iterations or once
    the simplex spans less than ``xtol`` in every coordinate and ``ftol`` in value."""
    x0 = np.asarray(x0, dtype=float)
    if x0.size == 0:  # nothing to fit (fit_hardware with fit=()): the point itself
        return x0, float(f(x0))
    simplex = np.vstack([x0, x0 + step * np.eye(x0.size)])
    # SciPy counts the start simplex as its first iteration
    options = {"initial_simplex": simplex, "maxiter": max_iter + 1, "xatol": xtol, "fatol": ftol}
    from scipy import optimize  # (imported here: half a second that every simulation would pay at start)

    res = optimize.minimize(f, x0, method="Nelder-Mead", options=options)
    return res.x, float(res.fun)


@dataclass
class CalibrationResult:
    """A fitted spec and how well it explains the profile (relative errors |pred - meas| / meas)."""

    hardware: HardwareSpec
    params: dict[str, float]
    median_rel_error: float
    mean_rel_error: float
    max_rel_error: float
    base_median_rel_error: float  # the base spec's error on the same samples, for comparison
    num_samples: int

    def to_dict(self) -> dict:
        return {
            "hardware": self.hardware.to_dict(),
            "params": dict(self.params),
            "median_rel_error": self.median_rel_error,
            "mean_rel_error": self.mean_rel_error,
            "max_rel_error": self.max_rel_error,
            "base_median_rel_error": self.base_median_rel_error,
            "num_samples": self.num_samples,
        }


def _to_free(name: str, value: float) -> float:
    if name in _FRACTIONS:
        v = min(max(value, 1e-6), 1 - 1e-9)
        return math.log(v / (1 - v))
    return math.log(max(value, 1e-9))


def _from_free(name: str, u: float) -> float:
    if name in _FRACTIONS:
        return 1.0 / (1.0 + math.exp(-u)) if u > -700 else 0.0
    if name == "kv_memory_eff_ratio":
        return min(math.exp(min(u, 700.0)), 10.0)  # HardwareSpec's bound
    return math.exp(min(u, 700.0))


def fit_hardware(
    model: ModelSpec | str,
    base: HardwareSpec,
    samples: Sequence[ProfileSample],
    tp: int = 1,
    fit: Sequence[str] = DEFAULT_FIT,
    name: str | None = None,
    restarts: int = 3,
) -> CalibrationResult:
    """Fit the ``fit`` fields of ``base`` so predicted step times match ``samples`` (least squares on log
    time ratios, Nelder-Mead in a transformed space: logit for fractions, log for positive values)."""
    m = get_model(model)
    # measured-shape corrections belong to the operator profiles they were learnt on, not to these steps
    base = base.with_(shape_corrections={})
    fit = tuple(fit)
    for p in fit:
        if p not in FITTABLE:
            raise ValueError(f"fit: unknown parameter {p!r} (fittable: {', '.join(FITTABLE)})")
    if len(samples) < max(len(fit), 1):
        raise ValueError(f"samples: need at least {max(len(fit), 1)} profile samples, got {len(samples)}")
    measured = np.array([float(t) for _, t in samples])
    if not np.all(measured > 0):
        raise ValueError("samples: every measured time must be > 0 seconds")
    feats = _Features(CostModel(m, base, tp, engine="hardware"), samples)
    log_meas = np.log(measured)

    def spec_of(u: np.ndarray) -> HardwareSpec:
        return base.with_(**{p: _from_free(p, float(v)) for p, v in zip(fit, u)})

    def objective(u: np.ndarray) -> float:
        try:
            hw = spec_of(u)
        except ValueError:
            return math.inf
        pred = feats.predict(hw)
        return float(np.sum((np.log(pred) - log_meas) ** 2))

    u = np.array([_to_free(p, getattr(base, p)) for p in fit])
    best = objective(u)
    for _ in range(max(restarts, 1)):  # restart from the best point until a restart no longer improves
        u_new, f_new = nelder_mead(objective, u, step=0.7)
        improved = best - f_new
        if f_new < best:
            u, best = u_new, f_new
        if improved < 1e-12:
            break
    fitted = spec_of(u).with_(
        name=name or f"{base.name}-fitted",
        fitted_on=name or f"{base.name}-fitted",
        source=_fit_note(base, m, len(samples), fit),
    )
    rel = np.abs(feats.predict(fitted) - measured) / measured
    base_rel = np.abs(feats.predict(base) - measured) / measured
    return CalibrationResult(
        hardware=fitted,
        params={p: getattr(fitted, p) for p in fit},
        median_rel_error=float(np.median(rel)),
        mean_rel_error=float(np.mean(rel)),
        max_rel_error=float(np.max(rel)),
        base_median_rel_error=float(np.median(base_rel)),
        num_samples=len(samples),
    )


def _fit_note(base: HardwareSpec, model: ModelSpec, n: int, fit: Sequence[str]) -> str:
    return f"fitted from {n} profiled steps of {model.name} (params: {', '.join(fit)}); base: {base.name}"
