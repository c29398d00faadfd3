"""Fitting a CPU hardware preset to the profiled steps: this machine's measured peaks and
:func:`kvbalance.perf.calibrate.fit_hardware` from :func:`cpu_base_spec`, started from several memory
efficiencies."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from kvbalance.perf.calibrate import CalibrationResult, cpu_base_spec, fit_hardware, predict_samples
from kvbalance.profile.config import FIT_PARAMS
from kvbalance.profile.grid import StepSample


def measure_peaks(threads: int = 1, repeats: int = 3) -> dict[str, float]:
    """This machine's fp32 GEMM rate (1024^3 matmul) and copy bandwidth (64 MiB arrays), best of ``repeats``,
    on thread CPU time (so another process sharing the cores does not lower them)."""
    import torch

    torch.set_num_threads(threads)
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    src, dst = np.ones(16 << 20, dtype=np.float32), np.empty(16 << 20, dtype=np.float32)
    a @ b
    np.copyto(dst, src)
    clock = time.thread_time if threads == 1 else time.process_time
    gemm, copy = math.inf, math.inf
    for _ in range(repeats):
        t = clock()
        a @ b
        gemm = min(gemm, clock() - t)
        t = clock()
        np.copyto(dst, src)
        copy = min(copy, clock() - t)
    return {
        "peak_flops": 2.0 * n**3 / max(gemm, 1e-9),
        "mem_bandwidth_bytes_s": 2.0 * src.nbytes / max(copy, 1e-9),
    }


def fit_cpu_preset(
    model: str,
    samples: Sequence[StepSample],
    fit: Sequence[str] = FIT_PARAMS,
    name: str | None = None,
    clock: str = "wall",
    peaks: dict[str, float] | None = None,
) -> CalibrationResult:
    """Fit ``cpu_base_spec()``'s ``fit`` fields to the samples' median step times (``clock`` "wall": step_s,
    "cpu": cpu_s); fills each sample's ``predicted_s``. ``peaks`` (from :func:`measure_peaks`) replace the
    base spec's guessed peak FLOP/s and bandwidth, so the fitted efficiencies are fractions of measured rates
    (the guessed 20 GB/s floor is far above one core of a shared VM, and the fit then stalls far from the optimum).
    """
    base = cpu_base_spec(num_cores=1, name=name or "cpu")  # one compute thread per engine
    if peaks:
        base = base.with_(**peaks, source=base.source + "; peaks measured by kvbalance.profile.measure_peaks")
    pairs = [(s.seqs, s.cpu_s if clock == "cpu" else s.step_s) for s in samples]
    # Nelder-Mead finds local optima here (a large step overhead can stand in for weight streaming): start it
    # from several memory efficiencies and keep the fit with the lowest median error.
    result = min(
        (
            fit_hardware(model, base.with_(memory_eff_max=m), pairs, fit=fit, name=name)
            for m in (0.7, 0.2, 0.05)
        ),
        key=lambda r: (r.median_rel_error, r.mean_rel_error),
    )
    pred = predict_samples(model, result.hardware, pairs)
    for s, p in zip(samples, pred):
        s.predicted_s = float(p)
    return result
