"""workloads/offline.py's tuner solves for a knob with SciPy's Brent root finder (``crossing``): where a
monotone function crosses a target, a step of a piecewise-constant one (what a share of sampled requests
gives), and the nearer end of the range where the function never crosses."""

from __future__ import annotations

import math

import pytest

from kvbalance.workloads.offline import crossing


def test_finds_the_crossing_of_an_increasing_and_a_decreasing_function():
    assert crossing(lambda x: x**3, 0.0, 2.0, 2.0, increasing=True) == pytest.approx(2 ** (1 / 3), abs=1e-9)
    assert crossing(lambda x: math.exp(-x), 0.0, 5.0, 0.25, increasing=False) == pytest.approx(
        math.log(4), abs=1e-9
    )


def test_finds_the_step_of_a_piecewise_constant_function():
    def share(x: float) -> float:  # 1 of 8 sampled items per 1/8 of x
        return math.floor(8 * x) / 8

    x = crossing(share, 0.0, 1.0, 0.3, increasing=True)
    assert x == pytest.approx(3 / 8, abs=1e-9)


def test_the_nearer_end_where_the_function_stays_on_one_side():
    assert crossing(lambda x: x, 0.0, 1.0, 5.0, increasing=True) == 1.0  # always below: as high as it goes
    assert crossing(lambda x: x, 0.0, 1.0, -5.0, increasing=True) == 0.0
    assert crossing(lambda x: -x, 0.0, 1.0, 5.0, increasing=False) == 0.0  # always below: as low as it goes
    assert crossing(lambda x: -x, 0.0, 1.0, -5.0, increasing=False) == 1.0
    assert crossing(lambda x: x, 0.0, 1.0, 0.0, increasing=True) == 0.0  # reached at an end
