"""perf/calibrate.py's optimiser and parameter transforms by hand (milliseconds each; the fits themselves
are in tests/test_calibrate.py, too slow for mutation testing).

Nelder-Mead (SciPy's, through calibrate.nelder_mead's start simplex and iteration count; reflect 1,
expand 2, contract 0.5, shrink 0.5): traced step by step on (x - 3)^2 from x0 = 0, and on a 2-D function
against the textbook rules restated below. Fractions are fitted in logit space, positive values in log space.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvbalance.perf.calibrate import (
    CalibrationResult,
    _from_free,
    _to_free,
    nelder_mead,
    predict_samples,
)
from kvbalance.perf.cost import CostModel
from kvbalance.specs import get_gpu


def _traced(f):
    seen: list = []

    def g(x):
        seen.append(np.array(x, dtype=float).tolist())
        return f(x)

    return g, seen


def test_nelder_mead_one_dimension_step_by_step():
    g, seen = _traced(lambda x: float((x[0] - 3.0) ** 2))
    x, fx = nelder_mead(g, np.array([0]), max_iter=4)  # an int start point is taken as floats
    # start 0 and 0 + 0.5; reflect 1 (4 < 6.25) -> expand 1.5 (2.25 < 4, kept); reflect 2.5 -> expand 3.5
    # (0.25 is not below 0.25: the reflection is kept); reflect 3.5 (not better) -> contract outside to 3.0;
    # reflect 3.5 (not below the worst 0.25) -> contract inside to 2.75
    assert [p[0] for p in seen] == [0.0, 0.5, 1.0, 1.5, 2.5, 3.5, 3.5, 3.0, 3.5, 2.75]
    assert x.tolist() == [3.0] and fx == 0.0


def test_nelder_mead_converges_to_the_tolerances():
    x, fx = nelder_mead(lambda x: float((x[0] - 3.0) ** 2 + (x[1] + 1.0) ** 2), np.array([0.0, 0.0]))
    assert abs(x[0] - 3.0) < 1e-6 and abs(x[1] + 1.0) < 1e-6 and fx < 1e-12
    g, seen = _traced(lambda x: float(-x[0]))  # unbounded: stops at max_iter, two evaluations per iteration
    nelder_mead(g, np.array([0.0]), max_iter=5)
    assert len(seen) == 2 + 2 * 5


def _reference(f, x0, step, iters):
    """Nelder-Mead with the same rules: sort; reflect; expand if the reflection beats the best (keep the
    expansion only if strictly better); accept the reflection if it beats the second worst; otherwise
    contract towards the reflection (if it beats the worst) or the worst, accept if strictly below both,
    else shrink every vertex half way to the best."""
    pts = [np.array(x0, dtype=float)] + [np.array(x0, dtype=float) + step * e for e in np.eye(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(len(pts)), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        c = sum(pts[:-1]) / (len(pts) - 1)
        xr = 2 * c - pts[-1]
        fr = f(xr)
        if fr < vals[0]:
            xe = 3 * c - 2 * pts[-1]
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            toward = xr if fr < vals[-1] else pts[-1]
            xc = (c + toward) / 2
            fc = f(xc)
            if fc < min(fr, vals[-1]):
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [(pts[0] + p) / 2 for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts, vals


def test_nelder_mead_two_dimensions_follows_the_rules_including_shrinks():
    def rosen(x):
        return float((1 - x[0]) ** 2 + 100 * (x[1] - x[0] ** 2) ** 2 + 0.01 * x[0])

    for iters in (1, 3, 12, 40):
        g, seen = _traced(rosen)
        r, rseen = _traced(rosen)
        x, fx = nelder_mead(g, np.array([-1.2, 1.0]), step=0.7, max_iter=iters)
        pts, vals = _reference(r, [-1.2, 1.0], 0.7, iters)
        np.testing.assert_allclose(seen, rseen, rtol=1e-9, atol=1e-12)
        best = int(np.argmin(vals))
        assert x.tolist() == pytest.approx(pts[best].tolist(), rel=1e-12) and fx == pytest.approx(
            vals[best], rel=1e-12
        )


def test_nelder_mead_shrinks_when_nothing_else_helps():
    # only the start simplex is any good: the reflection and the contraction both fail, so it shrinks
    def plateau(x):
        known = {(0.0, 0.0): 0.0, (0.5, 0.0): 1.0, (0.0, 0.5): 2.0}
        return known.get((float(x[0]), float(x[1])), 5.0 + x[0] + 2 * x[1])

    g, seen = _traced(plateau)
    nelder_mead(g, np.array([0.0, 0.0]), max_iter=1)
    assert seen == [[0.0, 0.0], [0.5, 0.0], [0.0, 0.5], [0.5, -0.5], [0.125, 0.25], [0.25, 0.0], [0.0, 0.25]]
    r, rseen = _traced(plateau)
    g, seen = _traced(plateau)
    nelder_mead(g, np.array([0.0, 0.0]), max_iter=6)
    _reference(r, [0.0, 0.0], 0.5, 6)
    np.testing.assert_allclose(seen, rseen, rtol=1e-9, atol=1e-12)


def test_parameter_transforms():
    assert _to_free("compute_eff_max", 0.5) == 0.0
    assert _to_free("memory_eff_max", 0.8) == pytest.approx(math.log(4.0), rel=1e-12)
    top = 1 - 1e-9  # fractions are clipped into (0, 1) before the logit
    assert _to_free("attention_eff_ratio", 1.0) == math.log(top / (1 - top))
    assert _to_free("compute_eff_max", 0.0) == pytest.approx(math.log(1e-6 / (1 - 1e-6)), rel=1e-12)
    assert _to_free("step_overhead_s", 2.0) == math.log(2.0)
    assert _to_free("step_overhead_s", 0.0) == math.log(1e-9)
    assert _from_free("compute_eff_max", 0.0) == 0.5
    assert _from_free("compute_eff_max", math.log(4.0)) == pytest.approx(0.8, rel=1e-12)
    assert _from_free("compute_eff_max", -800.0) == 0.0  # no overflow far out
    assert _from_free("kv_memory_eff_ratio", 5.0) == 10.0 and _from_free("kv_memory_eff_ratio", 1.0) == math.e
    assert _from_free("step_overhead_s", 800.0) == math.exp(700.0)
    for name, v in (("compute_eff_max", 0.3), ("step_overhead_s", 3e-3), ("kv_memory_eff_ratio", 2.0)):
        assert _from_free(name, _to_free(name, v)) == pytest.approx(v, rel=1e-12)


def test_calibration_result_to_dict():
    hw = get_gpu("a100-80gb")
    r = CalibrationResult(hw, {"step_overhead_s": 1e-3}, 0.1, 0.2, 0.3, 0.4, 7)
    assert r.to_dict() == {
        "hardware": hw.to_dict(),
        "params": {"step_overhead_s": 1e-3},
        "median_rel_error": 0.1,
        "mean_rel_error": 0.2,
        "max_rel_error": 0.3,
        "base_median_rel_error": 0.4,
        "num_samples": 7,
    }


def test_predict_samples_defaults_to_one_gpu():
    hw = get_gpu("a100-80gb")
    steps = [[(1, 100, True)] * 4, [(64, 64, True)]]
    pred = predict_samples("llama-2-7b", hw, [(s, 1.0) for s in steps])
    cm = CostModel("llama-2-7b", hw, engine="hardware")  # predict_samples: the spec's host terms, serial
    assert pred.tolist() == pytest.approx([cm.step_seconds(s) for s in steps], rel=1e-9)
