"""Fit a GPU preset's engine host time per step and its TP link (``kvbalance calibrate``): least squares on
log time (:func:`~kvbalance.perf.fit_gpu.fit_log_least_squares`) over vLLM's host time per step and NCCL's
all-reduce times.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbalance.perf.profiles import AllReduceSample, HostSample
from kvbalance.specs import LinkSpec

HOST_PARAMS = (
    "step_overhead_s",
    "host_overhead_per_seq_s",
    "host_overhead_tp_s",
    "host_overhead_tp_per_seq_s",
    "host_overhead_per_tp_rank_s",
)


def fit_host(samples: Sequence[HostSample]) -> dict[str, float]:
    """Host time per step: fixed + per sequence, and when tp > 1: + TP fixed + TP per sequence + per extra
    worker (``HardwareSpec.host_overhead_s``)."""
    if len(samples) < len(HOST_PARAMS):
        raise ValueError(
            f"samples: need at least {len(HOST_PARAMS)} host-overhead samples, got {len(samples)}"
        )
    b = np.array([s.batch_size for s in samples], dtype=float)
    tp = np.array([s.tp for s in samples], dtype=float)
    multi = (tp > 1).astype(float)
    t = np.array([s.time_s for s in samples])

    def predict(x: np.ndarray) -> np.ndarray:
        return x[0] + x[1] * b + multi * (x[2] + x[3] * b) + x[4] * (tp - 1)

    from kvbalance.perf.fit_gpu import fit_log_least_squares

    x = fit_log_least_squares(
        predict, t, (1e-3, 5e-5, 2e-3, 5e-5, 5e-4), (1e-6, 0, 0, 0, 0), (1, 1e-2, 1, 1e-2, 1e-1)
    )
    return dict(zip(HOST_PARAMS, (float(v) for v in x)))


def allreduce_predict(samples: Sequence[AllReduceSample], link: LinkSpec) -> np.ndarray:
    n = np.array([s.num_workers for s in samples], dtype=float)
    size = np.array([s.size_bytes for s in samples], dtype=float)
    return 2.0 * (n - 1) / n * size / link.bandwidth_bytes_s + link.latency_s


def fit_link(samples: Sequence[AllReduceSample], base: LinkSpec, name: str) -> LinkSpec:
    """The TP link's latency and bandwidth from ring all-reduce times."""
    if len(samples) < 2:
        raise ValueError(f"samples: need at least 2 all-reduce samples, got {len(samples)}")
    t = np.array([s.time_s for s in samples])

    def predict(x: np.ndarray) -> np.ndarray:
        return allreduce_predict(samples, LinkSpec("fit", x[0], x[1]))

    from kvbalance.perf.fit_gpu import fit_log_least_squares

    x = fit_log_least_squares(predict, t, (base.bandwidth_bytes_s, 1e-5), (1e8, 0), (1e13, 1e-2))
    datasheet = base.note.split("; latency and bandwidth fitted")[
        0
    ]  # a re-fit starts from the datasheet note
    note = f"{datasheet}; latency and bandwidth fitted on {len(samples)} NCCL all-reduce times ({samples[0].topology})"
    return LinkSpec(name, float(x[0]), float(x[1]), note)
