"""What the measured profiles can resolve: the timer's quantum, the reproducibility floor of each operator class
(the smallest worst-case error any deterministic model can reach, given that the same kernel profiled twice
reads differently) and a resolution-aware relative error that does not charge a model for the timer's rounding.

Vidur's CSVs store times in ms with three decimals: every repeat reads a whole number of microseconds, and a
kernel of 1-5 us reads 1 or 2 us from one repeat to the next. The median of an even number of repeats is the
midpoint of two readings, so it is known to half a quantum at best. Two facts follow:

- the **reproducibility floor**: where one kernel (same kernel key, token count M and TP degree) was profiled
  more than once, in different models' CSVs or as two operators of one model (both RMSNorms of a layer), its
  medians t_1..t_n disagree; any single prediction p has a worst relative error max_i |p / t_i - 1| of at
  least (t_max - t_min) / (t_max + t_min), reached at p = 2 t_max t_min / (t_max + t_min) (the two extremes
  bind; equating p / t_min - 1 = 1 - p / t_max gives both: :func:`minimax_floor`);
- the **resolution-aware error** err_q = max(0, |p - t| - q / 2) / t: a prediction within half a quantum of a
  median is as good as the data can tell (:func:`resolution_error`); its floor over a group is
  max(0, (t_max - t_min - q) / (t_max + t_min)) (the same argument with each bound widened by q / 2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbalance.perf.profiles import OperatorSample

# Grid readings are rounded to before their gcd is taken (1 ps: far below any GPU timer, far above the float
# error of a reading in ms with a few decimals).
GRID_S = 1e-12
# Points measured at or below this many timer quanta are timer-limited (a repeat reads 1 or 2 quanta).
LOW_QUANTA = 5
# The worst-case relative error the check allows per operator class (issue 11).
FLOOR_BOUND = 0.30


def timer_quantum_s(samples: Sequence[OperatorSample]) -> float:
    """The profiles' time resolution: the largest q (on a ``GRID_S`` grid) of which every repeat's min and max
    reading is a whole multiple, the gcd of the readings in ps. Readings are what the timer printed; a median
    of an even count is a midpoint, so where no sample has min/max the medians are used (their gcd is q or
    q / 2: the smaller quantum charges a model more, never less)."""
    readings = [t for s in samples for t in (s.min_s, s.max_s) if t is not None]
    if not readings:
        readings = [s.time_s for s in samples]
    if not readings:
        raise ValueError("samples: no times to infer the timer quantum from")
    ticks = np.rint(np.asarray(readings, dtype=float) / GRID_S).astype(np.int64)
    q = int(np.gcd.reduce(ticks))
    if q <= 0:
        raise ValueError("samples: readings are below the 1 ps grid; cannot infer the timer quantum")
    return q * GRID_S


def minimax_floor(times: Sequence[float], quantum_s: float = 0.0) -> float:
    """min over p of max_i err(p, t_i) for one kernel's repeated medians ``times``: (t_max - t_min) /
    (t_max + t_min) for the relative error, max(0, (t_max - t_min - q) / (t_max + t_min)) for the
    resolution-aware one with quantum ``quantum_s`` (module doc)."""
    lo, hi = min(times), max(times)
    return max(0.0, (hi - lo - quantum_s) / (hi + lo))


def minimax_prediction(times: Sequence[float]) -> float:
    """The prediction reaching :func:`minimax_floor` (relative error): 2 t_max t_min / (t_max + t_min), the
    harmonic mean of the extremes."""
    lo, hi = min(times), max(times)
    return 2.0 * hi * lo / (hi + lo)


def resolution_error(pred: np.ndarray, meas: np.ndarray, quantum_s: float) -> np.ndarray:
    """err_q = max(0, |pred - meas| - q / 2) / meas per point (a median of whole-quantum readings is uncertain
    by half a quantum, so the first q / 2 of any miss is not the model's)."""
    pred, meas = np.asarray(pred, dtype=float), np.asarray(meas, dtype=float)
    return np.maximum(0.0, np.abs(pred - meas) - 0.5 * quantum_s) / meas


def inside_repeats(pred: np.ndarray, samples: Sequence[OperatorSample]) -> np.ndarray:
    """Per point, whether the prediction lies in the repeats' [min, max] (False where a sample has none)."""
    lo = np.array([s.min_s if s.min_s is not None else np.nan for s in samples])
    hi = np.array([s.max_s if s.max_s is not None else np.nan for s in samples])
    pred = np.asarray(pred, dtype=float)
    return (pred >= lo) & (pred <= hi)


def low_quanta(samples: Sequence[OperatorSample], quantum_s: float, quanta: int = LOW_QUANTA) -> np.ndarray:
    """Per point, whether its median is at most ``quanta`` timer quanta (half a quantum of float slack)."""
    return np.array([s.time_s for s in samples]) <= (quanta + 1e-6) * quantum_s


def duplicate_groups(samples: Sequence[OperatorSample], keys: Sequence[str | None]) -> list[list[int]]:
    """Indices of the samples that time one kernel (kernel key, M, TP degree), groups of two or more only, in
    order of first appearance; samples without a key (no kernel shape) are in none."""
    groups: dict[tuple, list[int]] = {}
    for i, (s, k) in enumerate(zip(samples, keys)):
        if k is not None:
            groups.setdefault((k, s.num_tokens, s.tp), []).append(i)
    return [g for g in groups.values() if len(g) >= 2]


def point_floors(samples: Sequence[OperatorSample], keys: Sequence[str | None], quantum_s: float = 0.0):
    """Per point, the :func:`minimax_floor` of its duplicated group (NaN where its kernel was profiled once)."""
    meas = np.array([s.time_s for s in samples])
    out = np.full(len(samples), np.nan)
    for g in duplicate_groups(samples, keys):
        out[g] = minimax_floor(meas[g], quantum_s)
    return out


@dataclass
class ClassFloor:
    """The reproducibility floor of one operator class (figures over its duplicated groups) and its
    timer-limited points."""

    op_class: str
    points: int
    groups: int  # duplicated (key, M, TP) groups
    worst: float  # worst group floor, relative error
    share_past: float  # share of groups whose floor exceeds FLOOR_BOUND
    worst_q: float  # worst group floor, resolution-aware
    share_past_q: float
    low_points: int  # points measured at <= LOW_QUANTA quanta
    worst_group: str  # the worst group: key, M, TP, its medians in us and models

    def to_dict(self) -> dict:
        return {"class": self.op_class, "points": self.points, "groups": self.groups,
                "worst_floor": self.worst, "share_past_bound": self.share_past,
                "worst_floor_resolution_aware": self.worst_q, "share_past_bound_resolution_aware": self.share_past_q,
                f"points_at_most_{LOW_QUANTA}_quanta": self.low_points, "worst_group": self.worst_group}  # fmt: skip


def _describe(samples: Sequence[OperatorSample], keys: Sequence[str | None], group: list[int]) -> str:
    s = samples[group[0]]
    us = ", ".join(f"{samples[i].time_s * 1e6:g}" for i in group)
    models = ", ".join(dict.fromkeys(samples[i].shape.model for i in group))
    return f"{keys[group[0]]} M={s.num_tokens} tp={s.tp}: {us} us ({models})"


def class_floors(
    samples: Sequence[OperatorSample],
    keys: Sequence[str | None],
    classes: Sequence[str],
    quantum_s: float,
    bound: float = FLOOR_BOUND,
) -> list[ClassFloor]:
    """:class:`ClassFloor` per class of ``classes`` (each sample's class), in order of first appearance."""
    meas = np.array([s.time_s for s in samples])
    low = low_quanta(samples, quantum_s)
    labels = np.array(classes)
    per: dict[str, list[tuple[float, float, list[int]]]] = {c: [] for c in dict.fromkeys(classes)}
    for g in duplicate_groups(samples, keys):
        t = meas[g]
        per[classes[g[0]]].append((minimax_floor(t), minimax_floor(t, quantum_s), g))
    out = []
    for cls, rows in per.items():
        floors = np.array([r[0] for r in rows])
        floors_q = np.array([r[1] for r in rows])
        worst = max(rows, key=lambda r: r[0]) if rows else None
        n = max(len(rows), 1)
        out.append(
            ClassFloor(
                cls,
                int((labels == cls).sum()),
                len(rows),
                float(floors.max()) if rows else math.nan,
                float((floors > bound).sum() / n),
                float(floors_q.max()) if rows else math.nan,
                float((floors_q > bound).sum() / n),
                int((low & (labels == cls)).sum()),
                _describe(samples, keys, worst[2]) if worst else "",
            )
        )
    return out
