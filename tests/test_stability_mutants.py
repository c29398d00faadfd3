"""Edges of theory/stability.py and theory/area.py that the formula tests leave open (milliseconds each).

Each test pins one boundary of the stability paper's formulas or one input rule, with the value worked out
by hand: the fields named in errors, the strict inequalities of mu (1 - delta) and of the skew rule, the
floating-point guard of the instance count, and the input kinds a length distribution may take
(pmf objects, samplers, observed samples, paired traces).
"""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

from kvbalance.theory import (
    area_stats,
    batch_time_estimate,
    capacity_report,
    expected_area,
    instances_needed,
    representative_batch_time,
    stability_margin,
    stability_verdict,
    stable_service_rate,
)


class Const:
    """A sampler that always draws ``value`` (Monte Carlo path, deterministic result)."""

    def __init__(self, value) -> None:
        self.value = value

    def sample(self, rng, n):
        return np.full(n, self.value)


class Seeded:
    """A sampler whose draws depend on the rng: integers 1..100, as floats."""

    def sample(self, rng, n):
        return rng.integers(1, 101, size=n).astype(np.float64)


# -- stability.py -----------------------------------------------------------------------------------------


def test_each_positive_input_is_named_in_its_error():
    for args, name in (
        ((0, 1, 1), "kv_capacity_tokens"),
        ((1, 0, 1), "batch_time_s"),
        ((1, 1, 0), "expected_area"),
    ):
        with pytest.raises(ValueError, match=f"^{name} must be a positive finite number, got 0$"):
            stable_service_rate(*args)
    with pytest.raises(ValueError, match="^kv_capacity_tokens must be a positive finite number"):
        stability_margin(1, 0)
    with pytest.raises(ValueError, match="^mu must be a positive finite number, got 0$"):
        stability_verdict(1.0, 0, 0.1)
    with pytest.raises(ValueError, match="^mu must be a positive finite number, got 0$"):
        instances_needed(1.0, 0, 0.1)


def test_stability_margin_bounds():
    assert stability_margin(0, 1000) == 0.0  # an empty largest request holds no memory
    assert stability_margin(1, 1000) == 0.001
    for bad in (-1, float("inf")):
        with pytest.raises(ValueError, match="^max_total_tokens must be a non-negative finite number, got"):
            stability_margin(bad, 1000)
    with pytest.raises(
        ValueError,
        match="^max_total_tokens=1001 exceeds kv_capacity_tokens=1000.0: the largest request can never fit in KV memory$",
    ):
        stability_margin(1001, 1000)


def test_verdict_and_instances_accept_delta_zero_and_reject_outside_the_unit_interval():
    assert stability_verdict(49.9, 50, 0.0) is True  # delta = 0: the bound is mu itself
    assert instances_needed(49.9, 50, 0.0) == 1 and instances_needed(50.0, 50, 0.0) == 2
    for delta in (-0.1, 1.5):
        with pytest.raises(ValueError, match=f"^delta must lie in \\[0, 1\\], got {delta}$"):
            instances_needed(1.0, 50, delta)
    for rate in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="^rate must be a non-negative finite number of requests/s, got"):
            instances_needed(rate, 50, 0.1)
    with pytest.raises(ValueError, match="^delta = 1: one request can fill KV memory, no instance count"):
        instances_needed(1.0, 50, 1.0)


def test_instances_needed_below_one_request_per_second_bound():
    # bound mu (1 - delta) = 0.5 req/s: 0.4 req/s needs one instance, 1.2 needs three (1.2 / 2 = 0.6)
    assert instances_needed(0.4, 1.0, 0.5) == 1
    assert instances_needed(1.2, 1.0, 0.5) == 3
    assert instances_needed(2.0, 1.0, 0.0) == 3  # 2 / 2 = 1 is not strictly below mu = 1


def test_instances_needed_floating_point_guards():
    # floor(rate / mu) + 1 overshoots by one here: rate / 37 < mu already (the downward guard)
    rate, mu = 243.45262639794387, 6.579800713457943
    assert rate / 37 < mu and np.floor(rate / mu) + 1 == 38
    assert instances_needed(rate, mu, 0.0) == 37
    # and undershoots here: rate / 30 equals mu, not strictly below (the upward guard)
    rate, mu = 2108.7687815281693, 70.29229271760565
    assert not rate / 30 < mu and np.floor(rate / mu) + 1 == 30
    assert instances_needed(rate, mu, 0.0) == 31
    # large loads: the first estimate is already right (no linear search from far away)
    assert instances_needed(3e9, 1e9, 0.0) == 4
    assert instances_needed(1e15, 1.0, 0.0) == 10**15 + 1
    # an overshoot by one at 3.8e11 instances: the guard steps down once (not down to 1 and back up)
    rate, mu = 343650965137.71906, 0.8927560963415868
    assert rate / 384932644589 < mu and np.floor(rate / mu) + 1 == 384932644590
    assert instances_needed(rate, mu, 0.0) == 384932644589


def test_batch_time_estimate_rejects_bad_durations_by_name():
    for bad in ([float("nan")], [-1.0], [1.0, float("inf")]):
        with pytest.raises(ValueError, match="^step_times must be non-negative finite durations in seconds$"):
            batch_time_estimate(bad)
    assert batch_time_estimate([0.0, 0.0, 3.0]) == 0.0  # zero-length steps are durations too
    with pytest.raises(ValueError, match="^step_times is empty$"):
        batch_time_estimate(np.array([]))
    with pytest.raises(ValueError, match="^method must be 'median' or 'trimmed_mean', got 'mode'$"):
        batch_time_estimate([1.0], "mode")


def test_batch_times_may_be_any_real_numbers_numpy_converts():
    assert batch_time_estimate([Fraction(1, 2), Fraction(3, 2)]) == 1.0
    assert batch_time_estimate([Decimal("1"), Decimal("2"), Decimal("6")], "trimmed_mean", trim=0.0) == 3.0
    assert representative_batch_time(["1", "3"], "mean") == (2.0, "mean")  # e.g. strings read from a CSV
    assert representative_batch_time(["1", "1", "4"]) == (2.0, "trimmed_mean")


def test_representative_batch_time_methods_and_the_strict_skew_rule():
    t = [1.0, 1.0, 2.5]  # mean 1.5, median 1.0
    assert representative_batch_time(t, "trimmed_mean") == (
        batch_time_estimate(t, "trimmed_mean"),
        "trimmed_mean",
    )
    assert representative_batch_time([1.0, 2.0, 3.0, 10.0], "trimmed_mean") == (4.0, "trimmed_mean")
    assert representative_batch_time(t, skew_tolerance=0.5) == (1.0, "median")  # 1.5 is not above 1.5
    assert representative_batch_time(t, skew_tolerance=0.49)[1] == "trimmed_mean"
    assert representative_batch_time([1.0, 1.0, 1.0], skew_tolerance=0.0) == (1.0, "median")
    with pytest.raises(ValueError, match="^skew_tolerance must be >= 0, got -0.1$"):
        representative_batch_time(t, skew_tolerance=-0.1)


def test_capacity_report_passes_sampling_pairing_and_headroom_through():
    r = capacity_report(
        Const(10.0), 3, kv_capacity_tokens=1160, chunk_size=4, batch_time_s=0.5, rate_rps=30.0, headroom=0.5
    )
    # g(10, 3) = 58 for every draw; bound per instance 40 (1 - 13/1160)(1 - 0.5) = 19.78: two instances
    assert r.expected_area == 58.0 and not r.area_exact and r.b_s == 0.5 and r.rate_rps == 30.0
    assert r.headroom == 0.5 and r.instances_needed == 2 and r.stable is True
    assert (
        capacity_report(Const(10.0), 3, kv_capacity_tokens=1160, chunk_size=4, batch_time_s=0.5).rate_rps
        is None
    )
    # delta and headroom are not interchangeable: delta = 0.5 with headroom 0 vs. the other way round
    d = capacity_report(
        10, 3, kv_capacity_tokens=26, chunk_size=4, batch_time_s=0.5, rate_rps=0.85, headroom=0.1
    )
    mu = 26 / (0.5 * 58)  # 0.897; bound mu (1 - 0.5)(1 - 0.1) = 0.403: 0.85 / 2 is above it, three instances
    assert d.mu_rps == mu and d.delta == 0.5 and d.instances_needed == 3 and d.stable == "margin"
    paired = capacity_report(
        [10, 2], [3, 1], kv_capacity_tokens=630, chunk_size=4, batch_time_s=1.0, paired=True
    )
    assert paired.expected_area == (58 + 5) / 2 and paired.max_total_tokens == 13
    mc = dict(kv_capacity_tokens=10**6, chunk_size=16, batch_time_s=1.0)
    a = capacity_report(Seeded(), 5, **mc, n_samples=1000, seed=3)
    assert a.expected_area == area_stats(Seeded(), 5, 16, n_samples=1000, seed=3).expected_area
    assert a.expected_area != capacity_report(Seeded(), 5, **mc, n_samples=1000, seed=4).expected_area
    assert a.expected_area != capacity_report(Seeded(), 5, **mc, n_samples=999, seed=3).expected_area
    default = capacity_report(Seeded(), 5, **mc)
    assert default.expected_area == area_stats(Seeded(), 5, 16, n_samples=200_000, seed=0).expected_area


# -- area.py ----------------------------------------------------------------------------------------------


def test_monte_carlo_rounds_and_clips_float_draws_and_keeps_ints():
    # 2.6 rounds to 3 (not truncated to 2), -0.4 and 0.3 to 0; g(3, 1) = 3 + 4 = 7, g(0, 1) = 1
    assert area_stats(Const(2.6), 1, 4).expected_area == 7.0
    assert area_stats(Const(2.6), 1, 4, exact=False).expected_area == 7.0
    assert (
        area_stats(Const(-0.4), 1, 4).expected_area == 1.0
        and area_stats(Const(0.3), 1, 4).mean_input_tokens == 0
    )
    with pytest.raises(ValueError, match="^s must be non-negative token counts$"):
        area_stats(Const(-3), 1, 4)  # integer draws are taken as they are
    big = 2**53 + 1  # above float64's exact integers: integer draws must stay integers
    s = area_stats(Const(big), 0, big, exact=False)
    assert s.max_total_tokens == big and s.mean_input_tokens == float(big)
    # rounded float draws become integers too: 2^60 + 1 is not a float64
    f = area_stats(Const(float(2**60)), 1, 2**61, exact=False)
    assert f.max_total_tokens == 2**60 + 1


def test_monte_carlo_draws_from_the_pmf_with_its_probabilities():
    s = area_stats(([1, 100], [0.99, 0.01]), 0, 128, exact=False, n_samples=20_000, seed=1)
    assert s.mean_input_tokens == pytest.approx(1.99, abs=0.5)  # uniform draws would average 50.5
    assert s.exact is False and s.mean_output_tokens == 0.0 and s.max_total_tokens == 100


def test_length_distribution_kinds():
    # an object with values and probs, with values only (equally likely), and a zero-probability value
    assert expected_area(SimpleNamespace(values=[2, 4], probs=[0.25, 0.75]), 1, 4) == 0.25 * 5 + 0.75 * 9
    assert expected_area(SimpleNamespace(values=[2, 4]), 1, 4) == 7.0
    assert expected_area(SimpleNamespace(values=[2, 4], probs=None), 1, 4) == 7.0
    st = area_stats(([1, 100], [1.0, 0.0]), 1, 4)
    assert st.max_total_tokens == 2 and st.expected_area == 3.0  # ess sup ignores a value never drawn
    assert expected_area(([2, 4], [Decimal("0.5"), Decimal("0.5")]), 1, 4) == 7.0
    with pytest.raises(TypeError, match="^length distribution .* has neither values/probs nor .sample"):
        area_stats({2: 1.0}, 1, 4)  # a dict's .values is a method, not a pmf


def test_length_distribution_errors_name_the_input():
    with pytest.raises(ValueError, match="^samples must hold whole token counts, got non-integer values$"):
        area_stats([1.5, 2.0], 1, 4)
    with pytest.raises(ValueError, match="^values must hold whole token counts"):
        area_stats(([2.5], [1.0]), 1, 4)
    msg = "^a \\(values, probs\\) distribution needs two non-empty arrays of equal length$"
    for bad in (([1, 2], [1.0]), ([], [])):
        with pytest.raises(ValueError, match=msg):
            area_stats(bad, 1, 4)
    for probs in ([1.5, -0.5], [0.5, 0.6]):
        with pytest.raises(ValueError, match="^probs must be non-negative and sum to 1$"):
            area_stats(([1, 2], probs), 1, 4)
    assert expected_area(([1, 2], [1.0, 0.0]), 0, 4) == 1.0  # zero probabilities are allowed


def test_monte_carlo_output_lengths_use_their_own_moments():
    # o always 3 by sampler: E[g] = f(10) + 10 x 3 + (9 + 3) / 2 = 22 + 30 + 6
    s = area_stats(10, Const(3), 4)
    assert s.expected_area == 58.0 and s.exact is False and s.mean_output_tokens == 3.0
    assert s.max_total_tokens == 13


def test_paired_lengths_fields_and_errors():
    one = area_stats([10], [3], 4, paired=True)
    assert (one.expected_area, one.mean_input_tokens, one.mean_output_tokens, one.exact) == (
        58.0,
        10.0,
        3.0,
        True,
    )
    with pytest.raises(ValueError, match="^input lengths must hold whole token counts"):
        area_stats([1.5], [1], 4, paired=True)
    with pytest.raises(ValueError, match="^output lengths must be non-negative token counts$"):
        area_stats([1], [-1], 4, paired=True)
    with pytest.raises(
        ValueError, match="^paired \\(s_i, o_i\\) samples need two non-empty arrays of equal length$"
    ):
        area_stats([], [], 4, paired=True)
    raw = area_stats(Const(10.0), Const(3.0), 4, exact=False, n_samples=5)
    assert (raw.expected_area, raw.mean_input_tokens, raw.mean_output_tokens, raw.exact) == (
        58.0,
        10.0,
        3.0,
        False,
    )
    assert area_stats(Const(10.0), 3, 4, n_samples=1).expected_area == 58.0  # one sample is a sample


def test_expected_area_passes_its_sampling_options_through():
    base = area_stats(Seeded(), 5, 16).expected_area  # defaults: 200_000 samples, seed 0
    assert expected_area(Seeded(), 5, 16) == base
    assert (
        expected_area(Seeded(), 5, 16, n_samples=1000, seed=3)
        == area_stats(Seeded(), 5, 16, n_samples=1000, seed=3).expected_area
    )
    assert expected_area(Seeded(), 5, 16, seed=3) != base
    assert expected_area(Seeded(), 5, 16, n_samples=1000) != base
    raw = area_stats(Seeded(), Seeded(), 16, exact=False, n_samples=1000).expected_area
    assert expected_area(Seeded(), Seeded(), 16, exact=False, n_samples=1000) == raw
    # from the sampled moments E[s] E[o] instead of the sample mean of s o: not the same number
    assert area_stats(Seeded(), Seeded(), 16, n_samples=1000).expected_area != raw
    assert area_stats(Seeded(), 5, 16, seed=0) == area_stats(Seeded(), 5, 16, n_samples=200_000)
