"""Fit a GPU preset's efficiency curves on measured operator times (``kvbalance calibrate``).

Each profiled operator is evaluated on the cost model at its own shape (M tokens, K, N, TP sharding, fp16:
:meth:`CostModel.kernel`), and the preset's parameters are fitted by least squares on log time
(``scipy.optimize.least_squares``, trust-region reflective with bounds), one operator class at a time:

- weight GEMMs: ``max(F (M + M_half) / (M peak e_c), B / (bw e_m)) + t_kernel`` -> ``compute_eff_max``,
  ``compute_half_tokens``, ``memory_eff_max``, ``kernel_latency_s``;
- each element-wise class: ``B max(T_w, T_sat) / (T bw e) + t0``, T_w = T padded by ``w`` towards whole waves
  of SM-count rows -> a :class:`MemoryCurve`;
- the element-wise small-token path, where a class has one: ``t0 + t_token * T`` at or below a threshold;
- host time per step: ``t_fixed + t_seq * batch (+ t_tp + t_tp_seq * batch + t_rank * (tp - 1) when tp > 1)``;
- the TP link: ring all-reduce ``2 (n - 1) / n * bytes / bw + latency``.

Then, per profiled kernel shape, the measured correction ``log(measured / physical)`` over M
(:mod:`kvbalance.perf.correction`), scored by cross-validation (:mod:`kvbalance.perf.fit_cv`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbalance.perf.cost import OpCount, op_time
from kvbalance.perf.fit_cv import CORRECTION_TILES, CorrectionFit, fit_corrections, sample_models
from kvbalance.perf.fit_errors import (  # noqa: F401  (re-exported: the report and tests import them here)
    BATCH_RANGES,
    BYTE_RANGES,
    GEMM_OPS,
    TOKEN_RANGES,
    ClassError,
    error_rows,
    op_class,
    operator_errors,
)
from kvbalance.perf.fit_host import (  # noqa: F401  (re-exported: tests import them here)
    HOST_PARAMS,
    allreduce_predict,
    fit_host,
    fit_link,
)
from kvbalance.perf.kernels import wave_rows
from kvbalance.perf.profiles import AllReduceSample, HostSample, OperatorSample
from kvbalance.specs import ELEMENTWISE_CLASSES, HardwareSpec, MemoryCurve

GEMM_PARAMS = ("compute_eff_max", "compute_half_tokens", "memory_eff_max", "kernel_latency_s")
# Small-token path of an element-wise class: thresholds tried (tokens), distinct token counts the line needs
# at or below them, and the cut in squared log error it must bring to be kept.
SMALL_PATH_MAX_TOKENS = 64
SMALL_PATH_MIN_POINTS = 3
SMALL_PATH_GAIN = 0.1


@dataclass
class _Kernels:
    """Per-sample work of one class (the cost model's counts at each sample's shape) and measured times."""

    flops: np.ndarray
    bytes: np.ndarray
    tokens: np.ndarray
    time_s: np.ndarray


def kernel_counts(samples: Sequence[OperatorSample], hw: HardwareSpec) -> list[OpCount]:
    """The cost model's count of every sample's operator at the sample's shape and TP degree."""
    return [cm.kernel(s.op, s.num_tokens) for s, cm in zip(samples, sample_models(samples, hw))]


def _kernels(counts: Sequence[OpCount], samples: Sequence[OperatorSample]) -> _Kernels:
    return _Kernels(
        np.array([c.flops for c in counts]),
        np.array([c.bytes for c in counts]),
        np.maximum(np.array([c.size_tokens for c in counts]), 1.0),
        np.array([s.time_s for s in samples]),
    )


def _gemm_model(k: _Kernels, peak: float, bw: float) -> Callable[[np.ndarray], np.ndarray]:
    def predict(x: np.ndarray) -> np.ndarray:
        eff_c, half, eff_m, lat = x
        compute = k.flops * (k.tokens + half) / (k.tokens * peak * eff_c)
        return np.maximum(compute, k.bytes / (bw * eff_m)) + lat

    return predict


def _curve_model(k: _Kernels, hw: HardwareSpec) -> Callable[[np.ndarray], np.ndarray]:
    compute = k.flops * (k.tokens + hw.compute_half_tokens) / (k.tokens * hw.peak_flops * hw.compute_eff_max)
    l2 = hw.l2_cache_bytes
    ratio = k.bytes / l2 if l2 > 0 else np.full_like(k.bytes, np.inf)

    def predict(x: np.ndarray) -> np.ndarray:
        eff, sat, lat, gain, wave, scale, sharp = x
        eff_b = np.maximum(eff + gain / (1.0 + (ratio / scale) ** sharp), 1e-6)
        rows = np.maximum(wave_rows(k.tokens, wave, hw.num_sms), sat)
        memory = k.bytes * rows / (k.tokens * hw.mem_bandwidth_bytes_s * eff_b)
        return np.maximum(compute, memory) + lat

    return predict


def fit_log_least_squares(
    predict: Callable[[np.ndarray], np.ndarray],
    measured: np.ndarray,
    x0: Sequence[float],
    lower: Sequence[float],
    upper: Sequence[float],
) -> np.ndarray:
    """Parameters minimising sum(log(predict(x)) - log(measured))^2 within [lower, upper]. Each parameter is
    scaled by its start value so the trust region sees comparable steps."""
    from scipy.optimize import least_squares

    x0 = np.asarray(x0, dtype=float)
    scale = np.where(x0 > 0, x0, 1.0)
    log_meas = np.log(measured)

    def residuals(u: np.ndarray) -> np.ndarray:
        return np.log(predict(u * scale)) - log_meas

    lo, hi = np.asarray(lower, dtype=float) / scale, np.asarray(upper, dtype=float) / scale
    u0 = np.clip(x0 / scale, lo, hi)
    r = least_squares(residuals, u0, bounds=(lo, hi), x_scale="jac", xtol=1e-12, ftol=1e-12, gtol=1e-12)
    return r.x * scale


def fit_gemm(samples: Sequence[OperatorSample], base: HardwareSpec) -> dict[str, float]:
    gemm = [s for s in samples if s.op in GEMM_OPS]
    if len(gemm) < len(GEMM_PARAMS):
        raise ValueError(f"samples: need at least {len(GEMM_PARAMS)} GEMM samples, got {len(gemm)}")
    k = _kernels(kernel_counts(gemm, base), gemm)
    predict = _gemm_model(k, base.peak_flops, base.mem_bandwidth_bytes_s)
    x = fit_log_least_squares(
        predict, k.time_s, (0.6, 64.0, 0.8, 4e-6), (1e-3, 0, 1e-3, 0), (1, 1e5, 1, 1e-3)
    )
    return dict(zip(GEMM_PARAMS, (float(v) for v in x)))


def _fit_curve(k: _Kernels, hw: HardwareSpec) -> tuple[np.ndarray, float]:
    """Best (eff, sat_tokens, latency_s, l2_eff_gain, wave_weight, l2_bytes_scale, l2_sharpness) of one class and its cost (sum of squared log errors)."""
    cache = hw.l2_cache_bytes > 0  # fit the L2 gain only where the GPU's cache size is known
    predict = _curve_model(k, hw)
    best, best_cost = None, np.inf
    # the kinks (saturation, waves, L2 cliff) have local minima: start on both sides of each (smooth, and
    # quantised with a sharp cliff where the GPU has SMs and L2)
    shapes = [(0.0, 1.0)] + ([(0.8 if hw.num_sms > 0 else 0.0, 8.0), (0.0, 8.0)] if cache else [])
    for sat, (wave, sharp) in itertools.product((16.0, 128.0, 1024.0), shapes):
        x = fit_log_least_squares(
            predict,
            k.time_s,
            (0.5, sat, 2e-6, 0.2 if cache else 0.0, wave, 1.0, sharp),
            (1e-3, 0, 0, -1.0 if cache else 0.0, 0.0, 0.05 if cache else 1.0, 1.0),
            (
                4,
                1e5,
                1e-3,
                4.0 if cache else 1e-12,
                1.0 if hw.num_sms > 0 else 1e-12,
                20.0 if cache else 1 + 1e-12,
                20.0 if cache else 1 + 1e-12,
            ),
        )
        cost = float(np.sum((np.log(predict(x)) - np.log(k.time_s)) ** 2))
        if cost < best_cost:
            best, best_cost = x, cost
    if cache:
        best[3] = max(float(best[3]), 1e-3 - float(best[0]))
    return best, best_cost


def _fit_line(tokens: np.ndarray, time_s: np.ndarray) -> tuple[np.ndarray, float]:
    """``latency + per_token * T`` on log time (a small-token path) and its cost."""

    def predict(x: np.ndarray) -> np.ndarray:
        return x[0] + x[1] * tokens

    x = fit_log_least_squares(predict, time_s, (1e-6, 1e-7), (0, 0), (1e-3, 1e-4))
    return x, float(np.sum((np.log(predict(x)) - np.log(time_s)) ** 2))


def _small_path(k: _Kernels, x: np.ndarray, hw: HardwareSpec) -> tuple[float, float]:
    """The token threshold at or below which a line fits the class better than its curve (0: none), and the
    cost of the best split. Candidates: the class's token counts up to ``SMALL_PATH_MAX_TOKENS`` with at least
    ``SMALL_PATH_MIN_POINTS`` distinct counts at or below them."""
    curve_cost = (np.log(_curve_model(k, hw)(x)) - np.log(k.time_s)) ** 2
    best_thr, best_cost = 0.0, float(curve_cost.sum())
    counts = np.unique(k.tokens[k.tokens <= SMALL_PATH_MAX_TOKENS])
    for thr in counts[SMALL_PATH_MIN_POINTS - 1 :]:
        small = k.tokens <= thr
        _, line_cost = _fit_line(k.tokens[small], k.time_s[small])
        cost = line_cost + float(curve_cost[~small].sum())
        if cost < best_cost:
            best_thr, best_cost = float(thr), cost
    return best_thr, best_cost


def _subset(k: _Kernels, sel: np.ndarray) -> _Kernels:
    return _Kernels(k.flops[sel], k.bytes[sel], k.tokens[sel], k.time_s[sel])


def fit_elementwise(samples: Sequence[OperatorSample], hw: HardwareSpec) -> dict[str, MemoryCurve]:
    """One :class:`MemoryCurve` per element-wise class present in ``samples`` (after the GEMM fit: the
    compute part uses ``hw``'s GEMM curve). A small-token path (``MemoryCurve.small_tokens``) is kept where it
    cuts the class's squared log error by ``SMALL_PATH_GAIN`` or more; the curve is then refitted on the
    larger token counts only."""
    curves = {}
    for cls in ELEMENTWISE_CLASSES:
        sel = [s for s in samples if op_class(s) == cls]
        if len(sel) < 3:
            continue
        k = _kernels(kernel_counts(sel, hw), sel)
        x, cost = _fit_curve(k, hw)
        thr, split_cost = _small_path(k, x, hw)
        small_fit = {}
        if thr > 0 and split_cost < (1 - SMALL_PATH_GAIN) * cost:
            small = k.tokens <= thr
            x, _ = _fit_curve(_subset(k, ~small), hw)
            line, _ = _fit_line(k.tokens[small], k.time_s[small])
            small_fit = {
                "small_tokens": thr,
                "small_latency_s": float(line[0]),
                "small_per_token_s": float(line[1]),
            }
        gain = float(x[3]) if hw.l2_cache_bytes > 0 else 0.0
        wave = float(x[4]) if hw.num_sms > 0 else 0.0
        l2 = {"l2_bytes_scale": float(x[5]), "l2_sharpness": float(x[6])} if hw.l2_cache_bytes > 0 else {}
        curves[cls] = MemoryCurve(
            float(x[0]), float(x[1]), float(x[2]), gain, wave_weight=wave, **l2, **small_fit
        )
    return curves


# -- the fit and its errors --------------------------------------------------------------------------


@dataclass
class FitResult:
    hardware: HardwareSpec
    predicted_s: (
        np.ndarray
    )  # per operator sample, the fitted preset's prediction (corrected where it has any)
    samples: list[OperatorSample] = field(repr=False)
    errors: list[ClassError]  # the physical model on its training points
    host_errors: list[ClassError]
    link_errors: list[ClassError]
    physical_s: np.ndarray = field(default=None, repr=False)  # per sample, the physical model's prediction
    correction: CorrectionFit | None = None  # the measured-shape corrections and their cross-validation


def predict_operator_samples(
    samples: Sequence[OperatorSample], hw: HardwareSpec, physical: bool = False
) -> np.ndarray:
    """The cost model's time of each profiled operator on ``hw`` (the scalar path :func:`op_time`, times the
    shape's measured correction where ``hw`` has one, unless ``physical``)."""
    cms = sample_models(samples, hw)
    return np.array(
        [
            op_time(cm.kernel(s.op, s.num_tokens), hw).time_s
            * (1.0 if physical else cm.correction(s.op, s.num_tokens))
            for s, cm in zip(samples, cms)
        ]
    )


def fit_physical(base: HardwareSpec, ops: Sequence[OperatorSample]) -> HardwareSpec:
    """``base`` with its GEMM curve and element-wise curves fitted on ``ops`` (the physical model)."""
    hw = base.with_(
        memory_half_bytes=0.0, per_layer_overhead_s=0.0, elementwise_curves={}, **fit_gemm(ops, base)
    )
    return hw.with_(elementwise_curves=fit_elementwise(ops, hw))


def fit_gpu(
    base: HardwareSpec,
    ops: Sequence[OperatorSample],
    host: Sequence[HostSample] = (),
    allreduce: Sequence[AllReduceSample] = (),
    name: str | None = None,
    source: str = "",
    corrections: bool = True,
    cv_refit: bool = False,
) -> FitResult:
    """Fit ``base``'s efficiency curves on ``ops`` (and its host overhead on ``host``, its TP link on
    ``allreduce`` where given), then (``corrections``) each profiled shape's measured correction; peaks,
    bandwidth and capacity stay ``base``'s datasheet values. ``cv_refit``: the leave-one-model-out score refits
    the physical curves without each held-out model (one more fit per model)."""
    if not ops:
        raise ValueError("samples: no operator samples to fit")
    base = base.with_(shape_corrections={})
    hw = fit_physical(base, ops)
    if host:
        hw = hw.with_(**fit_host(host))
    if allreduce:
        link_name = hw.tp_link.name.removesuffix("-fitted") + "-fitted"
        hw = hw.with_(tp_link=fit_link(allreduce, hw.tp_link, link_name))
    pred = predict_operator_samples(ops, hw)
    errors = operator_errors(ops, pred)
    corr = fit_corrections(ops, pred, hw, fit_physical if cv_refit else None) if corrections else None
    gemm = next(e for e in errors if e.op_class == "gemm" and e.tokens == "all")
    note = (
        f"{base.name}: datasheet peaks ({base.source.split('.')[0]}); efficiency curves and kernel latency"
        f"{', host overhead' if host else ''}{', TP link' if allreduce else ''} fitted by kvbalance calibrate"
        f" on {len(ops)} operator times"
        f"{f', {len(host)} host-overhead steps' if host else ''}"
        f"{f', {len(allreduce)} all-reduces' if allreduce else ''} ({source or 'given samples'}); GEMM error "
        f"median {gemm.median:.1%}, worst {gemm.worst:.1%}. Attention is not in the data: "
        f"attention_eff_ratio={hw.attention_eff_ratio} is not fitted."
        f"{_correction_note(corr)}"
    )
    hw = hw.with_(
        name=name or base.name,
        source=note,
        shape_corrections=corr.corrections if corr is not None else {},
        fitted_on=base.name,
    )
    host_err = []
    if host:
        hp = np.array([hw.host_overhead_s(s.batch_size, s.batch_size, s.tp) for s in host])
        hm = np.array([s.time_s for s in host])
        host_err = error_rows([f"host tp{'>1' if s.tp > 1 else '=1'}" for s in host],
                               np.array([s.batch_size for s in host]), hp, hm, BATCH_RANGES)  # fmt: skip
    link_err = []
    if allreduce:
        am = np.array([s.time_s for s in allreduce])
        link_err = error_rows([f"all-reduce x{s.num_workers}" for s in allreduce],
                               np.array([s.size_bytes for s in allreduce]), allreduce_predict(allreduce, hw.tp_link), am,
                               BYTE_RANGES)  # fmt: skip
    final = corr.corrected_s if corr is not None else pred
    return FitResult(hw, final, list(ops), errors, host_err, link_err, pred, corr)


def _correction_note(corr: CorrectionFit | None) -> str:
    if corr is None:
        return ""
    worst = max((e for e in corr.loo_point_errors if e.tokens == "all"), key=lambda e: e.worst)
    tiles = "".join(f", {cls} within {t}-row M tiles" for cls, t in CORRECTION_TILES.items())
    return (
        f" Measured corrections for {len(corr.corrections)} profiled kernel shapes (piecewise-linear in log M"
        f"{tiles});"
        f" leave-one-point-out worst error {worst.worst:.1%} ({worst.op_class})."
    )
