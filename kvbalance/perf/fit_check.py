"""Issue 11's worst-case check (worst relative error under 30% per operator class) on each way a GPU fit is
scored (:mod:`kvbalance.perf.fit_cv`), raw and resolution-aware (:mod:`kvbalance.perf.fit_floor`), beside the
data's own reproducibility floor, with the points that break it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbalance.perf.fit_cv import sample_keys
from kvbalance.perf.fit_errors import ClassError, op_class, point_record, rel_error_rows
from kvbalance.perf.fit_floor import (
    FLOOR_BOUND,
    ClassFloor,
    class_floors,
    inside_repeats,
    point_floors,
    resolution_error,
    timer_quantum_s,
)
from kvbalance.perf.profiles import OperatorSample

# The ways a fit's operator errors are scored: JSON name, table header, title, error rows' and predictions'
# attributes (on the FitResult for the physical model, on its CorrectionFit for the others).
WAYS = (
    ("physical_training", "(1) phys train", "(1) physical model, training points", "errors", "physical_s"),
    ("leave_one_point_out", "(2a) LOO point", "(2a) corrected, leave-one-point-out along M",
     "loo_point_errors", "loo_point_s"),
    ("leave_one_model_out", "(2b) LOO model", "(2b) corrected, leave-one-model-out",
     "loo_model_errors", "loo_model_s"),
    ("corrected_training", "(3) corr train", "(3) corrected, training points", "corrected_errors", "corrected_s"),
)  # fmt: skip


@dataclass
class Scoring:
    """One way of scoring a fit: its predictions, raw and resolution-aware errors, and the points past the
    bound under the resolution-aware error (worst first)."""

    name: str
    short: str
    title: str
    pred: np.ndarray = field(repr=False)
    raw: list[ClassError]
    resolution: list[ClassError]
    failures: list[dict] = field(repr=False)
    inside: dict[str, float] = field(default_factory=dict)  # class -> share of predictions in [min, max]

    def failing(self, resolution: bool, bound: float = FLOOR_BOUND) -> dict[str, float]:
        """Classes whose worst error (over all token counts) reaches ``bound``: class -> worst."""
        rows = self.resolution if resolution else self.raw
        return {e.op_class: e.worst for e in rows if e.tokens == "all" and e.worst >= bound}

    def check(self, bound: float = FLOOR_BOUND) -> dict:
        """JSON-ready verdicts, raw and resolution-aware."""
        return {
            kind: {"pass": not fails, "failing_classes": fails}
            for kind, fails in (("raw", self.failing(False, bound)), ("resolution_aware", self.failing(True, bound)))
        }  # fmt: skip


@dataclass
class FitCheck:
    """Every scoring of a fit, the timer quantum and the floor per class."""

    quantum_s: float
    floors: list[ClassFloor]
    scorings: list[Scoring]


def _failures(samples, pred, err_q, floors, quantum_s, bound) -> list[dict]:
    meas = np.array([s.time_s for s in samples])
    inside = inside_repeats(pred, samples)
    bad = np.flatnonzero(err_q >= bound)
    bad = bad[np.argsort(-err_q[bad], kind="stable")]
    return [
        point_record(samples[i], meas[i], pred[i])
        | {
            "min_s": samples[i].min_s,
            "max_s": samples[i].max_s,
            "resolution_aware_error": float(err_q[i]),
            "measured_quanta": float(meas[i] / quantum_s),
            "inside_repeats": bool(inside[i]),
            "group_floor": None if np.isnan(floors[i]) else float(floors[i]),
        }  # fmt: skip
        for i in bad
    ]


def fit_check(result, bound: float = FLOOR_BOUND) -> FitCheck:
    """The :class:`FitCheck` of a :class:`~kvbalance.perf.fit_gpu.FitResult` (every way it has predictions
    for: the physical model's alone without corrections)."""
    samples: Sequence[OperatorSample] = result.samples
    c = result.correction
    keys = c.keys if c is not None else sample_keys(samples, result.hardware)
    q = timer_quantum_s(samples)
    classes = [op_class(s) for s in samples]
    labels = np.array(classes)
    meas = np.array([s.time_s for s in samples])
    tokens = np.array([s.num_tokens for s in samples])
    floors = point_floors(samples, keys)
    out = []
    for name, short, title, err_attr, pred_attr in WAYS if c is not None else WAYS[:1]:
        owner = result if err_attr == "errors" else c
        pred = getattr(owner, pred_attr)
        err_q = resolution_error(pred, meas, q)
        res_rows = rel_error_rows(classes, tokens, err_q)
        fails = _failures(samples, pred, err_q, floors, q, bound)
        inside = inside_repeats(pred, samples)
        share = {c: float(inside[labels == c].mean()) for c in dict.fromkeys(classes)}
        out.append(Scoring(name, short, title, pred, getattr(owner, err_attr), res_rows, fails, share))
    return FitCheck(q, class_floors(samples, keys, classes, q, bound), out)


def _verdict(fails: dict[str, float]) -> str:
    if not fails:
        return "PASS"
    worst = sorted(fails.items(), key=lambda kv: -kv[1])
    return "FAIL (" + ", ".join(f"{cls} {w:.0%}" for cls, w in worst) + ")"


def check_lines(check: FitCheck, bound: float = FLOOR_BOUND) -> list[str]:
    """One line per scoring: ``check (worst < 30% per class) - <scoring>: raw <verdict>, resolution-aware
    <verdict>``."""
    head = f"check (worst < {bound:.0%} per class) - "
    lines = []
    for i, s in enumerate(check.scorings):
        lead = head if i == 0 else " " * len(head)
        lines.append(f"{lead}{s.title}: raw {_verdict(s.failing(False, bound))}, "
                     f"resolution-aware {_verdict(s.failing(True, bound))}")  # fmt: skip
    return lines


def format_floors(check: FitCheck, bound: float = FLOOR_BOUND) -> str:
    """The floor per class: duplicated groups, worst floor and share past ``bound`` (raw, resolution-aware),
    timer-limited points, and the worst group."""
    q_us = check.quantum_s * 1e6
    lines = [
        f"reproducibility floor (one kernel: same key, M, TP, profiled >= 2 times; min over p of the worst error;"
        f" timer quantum {q_us:g} us):",
        f"  {'class':<20} {'points':>6} {'groups':>6} {'worst':>7} {f'>{bound:.0%}':>6} {'worst_q':>7} "
        f"{f'>{bound:.0%}_q':>6} {'<=5q':>6}  worst group",
    ]
    for f in check.floors:
        lines.append(f"  {f.op_class:<20} {f.points:>6} {f.groups:>6} {f.worst:>7.1%} {f.share_past:>6.1%} "
                     f"{f.worst_q:>7.1%} {f.share_past_q:>6.1%} {f.low_points:>6}  {f.worst_group}")  # fmt: skip
    return "\n".join(lines)


def format_inside(check: FitCheck) -> str:
    """Per class, the share of each scoring's predictions inside the repeats' [min, max]."""
    cols = "".join(f" {s.short:>15}" for s in check.scorings)
    lines = ["predictions inside the repeats' [min, max], share per class:", f"  {'class':<20}{cols}"]
    for cls in check.scorings[0].inside if check.scorings else ():
        lines.append(f"  {cls:<20}" + "".join(f" {s.inside[cls]:>15.1%}" for s in check.scorings))
    return "\n".join(lines)


def format_failure(f: dict) -> str:
    floor = f"group floor {f['group_floor']:.0%}" if f["group_floor"] is not None else "profiled once"
    rep = f"repeats {f['min_s'] * 1e6:g}-{f['max_s'] * 1e6:g}us" if f["min_s"] is not None else "no repeats"
    return (f"  {f['class']:<14} {f['model']:<28} {f['op']:<24} tp={f['tp']} M={f['num_tokens']:<5} "
            f"measured {f['measured_s'] * 1e6:8.1f}us ({rep}) predicted {f['predicted_s'] * 1e6:8.1f}us "
            f"({f['rel_error']:+.1%}, err_q {f['resolution_aware_error']:.1%}; {floor})")  # fmt: skip


def summary(check: FitCheck, bound: float = FLOOR_BOUND) -> dict:
    """JSON-ready: the quantum, ``floor`` per class, and per scoring its ``resolution_aware`` errors, its
    ``check`` (raw and resolution-aware), the share of its predictions per class inside the repeats' [min, max]
    (``inside_repeats``) and its ``failures`` (resolution-aware, every point past ``bound``)."""
    return {
        "timer_quantum_s": check.quantum_s,
        "floor": [f.to_dict() for f in check.floors],
        "resolution_aware": {s.name: [e.to_dict() for e in s.resolution] for s in check.scorings},
        "inside_repeats": {s.name: s.inside for s in check.scorings},
        "check": {s.name: {"bound": bound, **s.check(bound)} for s in check.scorings},
        "failures": {s.name: s.failures for s in check.scorings},
    }
