"""Busy fraction over time per instance and the hot-spot ratio (BanaServe's load-imbalance measure).

An instance is busy while a step runs. ``busy_fraction_series`` bins its steps' [start, start + duration)
intervals into fixed windows (exact overlap, not sampled); ``hot_spot_ratio`` is max / min of the whole-run
busy fraction over instances of the same role (1.0 = perfectly even; inf when one of them never ran).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


def busy_fraction_series(
    starts_s: Sequence[float], durations_s: Sequence[float], t_end_s: float, window_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """(window start times, busy fraction in each window) over [0, t_end_s), for one instance's steps.

    Exact and vectorised: with the steps sorted by start (they never overlap on one instance), the busy time
    before ``t`` is ``B(t) = (durations of the steps before the last one starting by t) + min(t - its start,
    its duration)``; a window's busy time is ``B(end) - B(start)``."""
    if window_s <= 0:
        raise ValueError(f"window_s: must be > 0, got {window_s}")
    n = max(1, math.ceil(t_end_s / window_s))
    edges = np.arange(n + 1, dtype=np.float64) * window_s
    s = np.asarray(starts_s, dtype=np.float64)
    d = np.asarray(durations_s, dtype=np.float64)
    if not len(s):
        return edges[:-1], np.zeros(n)
    order = np.argsort(s, kind="stable")
    s, d = s[order], d[order]
    before = np.concatenate(([0.0], np.cumsum(d)[:-1]))  # busy time of the steps before step k
    k = np.searchsorted(s, edges, side="right") - 1  # the last step starting at or before each edge
    kk = np.maximum(k, 0)
    busy_before = np.where(k >= 0, before[kk] + np.minimum(edges - s[kk], d[kk]), 0.0)
    return edges[:-1], np.diff(busy_before) / window_s


def busy_fraction(durations_s: Sequence[float], span_s: float) -> float:
    """Share of ``span_s`` spent running steps (steps never overlap on one instance)."""
    return float(np.sum(durations_s)) / span_s if span_s > 0 else 0.0


def hot_spot_ratio(busy_by_instance: Mapping[str, float], roles: Mapping[str, str]) -> dict[str, float]:
    """max / min busy fraction across the instances of each role (roles with one instance give 1.0)."""
    out: dict[str, float] = {}
    for role in sorted(set(roles.values())):
        vals = [busy_by_instance[name] for name, r in roles.items() if r == role]
        lo, hi = min(vals), max(vals)
        out[role] = hi / lo if lo > 0 else (1.0 if hi == 0 else math.inf)
    return out
