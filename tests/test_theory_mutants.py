"""Queueing stability formulas pinned to hand-computed values: g(s, o), E[g], mu, delta, verdicts, n.

g(s, o) = sum_{k=1}^{ceil(s/s_hat)} min(k s_hat, s) + sum_{j=1}^{o} (s + j); mu = M / (b E[g]);
delta = ess sup(s + o) / M; stable below mu (1 - delta), unstable at or above mu (the stability paper).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvbalance.theory import (
    area_stats,
    batch_time_estimate,
    capacity_report,
    decode_area,
    expected_area,
    instances_needed,
    memory_time_area,
    prefill_area,
    representative_batch_time,
    stability_margin,
    stability_verdict,
    stable_service_rate,
)


def UniformInt(lo: int, hi: int) -> tuple[list[int], list[float]]:
    """A discrete uniform on lo..hi as the (values, probs) pair the theory functions accept."""
    n = hi - lo + 1
    return list(range(lo, hi + 1)), [1 / n] * n


def test_prefill_area_sums_the_growing_context_chunk_by_chunk():
    # s = 10, s_hat = 4: chunks end at 4, 8, 10
    assert int(prefill_area(10, 4)) == 4 + 8 + 10
    assert int(prefill_area(8, 4)) == 4 + 8  # s_hat divides s: s_hat n (n + 1) / 2
    assert int(prefill_area(3, 4)) == 3 and int(prefill_area(0, 4)) == 0
    assert int(prefill_area(1, 1)) == 1 and int(prefill_area(3, 1)) == 1 + 2 + 3
    assert prefill_area([10, 8], 4).tolist() == [22, 12]
    with pytest.raises(ValueError, match="chunk_size"):
        prefill_area(10, 0)


def test_decode_area_and_memory_time_area():
    assert int(decode_area(10, 3)) == 11 + 12 + 13
    assert int(decode_area(5, 0)) == 0 and int(decode_area(0, 1)) == 1
    g = memory_time_area(10, 3, 4)
    assert g == 22 + 36 and isinstance(g, int)
    assert memory_time_area(np.array([10, 8]), np.array([3, 1]), 4).tolist() == [58, 12 + 9]


def test_lengths_must_be_whole_non_negative_counts():
    with pytest.raises(ValueError, match="^s must hold whole token counts"):
        prefill_area(2.5, 4)
    with pytest.raises(ValueError, match="^o must be non-negative"):
        decode_area(1, -1)
    with pytest.raises(ValueError, match="^s must be integer token counts"):
        decode_area(np.array(["a"]), 1)
    assert int(prefill_area(np.array([6.0]), 4)[0]) == 4 + 6  # whole floats are accepted
    assert int(decode_area(True, 1)) == 2


def test_expected_area_of_point_masses_and_uniforms_is_exact():
    assert expected_area(10, 3, 4) == 58.0
    # s uniform on {2, 4}, o = 1, s_hat = 4: g = (2 + 3) or (4 + 5)
    assert expected_area(([2, 4], [0.5, 0.5]), 1, 4) == 7.0
    assert expected_area(UniformInt(2, 4), 1, 4) == pytest.approx((5 + 7 + 9) / 3)
    s = area_stats(UniformInt(2, 4), UniformInt(0, 2), 4)
    brute = np.mean([memory_time_area(a, b, 4) for a in (2, 3, 4) for b in (0, 1, 2)])
    assert s.expected_area == pytest.approx(brute, rel=1e-12)
    assert (s.mean_input_tokens, s.mean_output_tokens, s.max_total_tokens, s.exact) == (3.0, 1.0, 6, True)


def test_observed_and_paired_lengths():
    assert expected_area([3, 3, 5], 1, 4) == pytest.approx((2 * (3 + 4) + (9 + 6)) / 3)
    s = area_stats([10, 2], [3, 1], 4, paired=True)
    assert s.expected_area == (58 + (2 + 3)) / 2 and s.max_total_tokens == 13 and s.exact
    with pytest.raises(ValueError, match="paired"):
        area_stats([1, 2], [1], 4, paired=True)


def test_monte_carlo_area_is_seeded_and_close_to_exact():
    class Sampler:
        def sample(self, rng, n):
            return rng.integers(2, 5, size=n).astype(np.float64)  # floats are rounded to whole tokens

    exact = expected_area(UniformInt(2, 4), UniformInt(0, 2), 4)
    mc = area_stats(Sampler(), UniformInt(0, 2), 4, n_samples=20_000, seed=3)
    assert not mc.exact and mc.expected_area == pytest.approx(exact, rel=0.02)
    assert mc == area_stats(Sampler(), UniformInt(0, 2), 4, n_samples=20_000, seed=3)
    raw = area_stats(UniformInt(2, 4), UniformInt(0, 2), 4, exact=False, n_samples=20_000, seed=3)
    assert not raw.exact and raw.expected_area == pytest.approx(exact, rel=0.02) and raw.max_total_tokens == 6
    with pytest.raises(ValueError, match="n_samples must be positive"):
        area_stats(1, 1, 4, n_samples=0)
    with pytest.raises(TypeError, match="neither values/probs nor"):
        area_stats(object(), 1, 4)
    with pytest.raises(ValueError, match="probs must be non-negative and sum to 1"):
        area_stats(([1, 2], [0.5, 0.6]), 1, 4)


def test_service_rate_margin_and_verdict():
    assert stable_service_rate(1000, 0.5, 40) == 1000 / (0.5 * 40) == 50.0
    assert stability_margin(100, 1000) == 0.1 and stability_margin(1000, 1000) == 1.0
    with pytest.raises(ValueError, match="max_total_tokens=1001 exceeds kv_capacity_tokens"):
        stability_margin(1001, 1000)
    with pytest.raises(ValueError, match="^batch_time_s must be a positive finite number"):
        stable_service_rate(1000, 0.0, 40)
    assert stability_verdict(44.9, 50, 0.1) is True
    assert stability_verdict(45.0, 50, 0.1) == "margin"  # mu (1 - delta) = 45 is not strictly below
    assert stability_verdict(49.9, 50, 0.1) == "margin"
    assert stability_verdict(50.0, 50, 0.1) is False  # critical load is not stable
    assert stability_verdict(0.0, 50, 1.0) == "margin"
    with pytest.raises(ValueError, match="delta must lie in"):
        stability_verdict(1.0, 50, 1.5)
    with pytest.raises(ValueError, match="^rate must be"):
        stability_verdict(-1.0, 50, 0.1)


def test_instances_needed_is_the_smallest_stable_count():
    # one instance is stable below mu (1 - delta) = 45 requests/s
    assert instances_needed(0.0, 50, 0.1) == 1
    assert instances_needed(44.9, 50, 0.1) == 1
    assert instances_needed(45.0, 50, 0.1) == 2  # strict inequality: exactly at the bound needs one more
    assert instances_needed(90.0, 50, 0.1) == 3
    assert instances_needed(89.9, 50, 0.1) == 2
    assert instances_needed(89.9, 50, 0.1, headroom=0.5) == 4  # bound 22.5 per instance
    with pytest.raises(ValueError, match="delta = 1"):
        instances_needed(1.0, 50, 1.0)
    with pytest.raises(ValueError, match="headroom must lie in"):
        instances_needed(1.0, 50, 0.1, headroom=1.0)


def test_batch_time_estimators_and_the_skew_rule():
    t = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 11.0]
    assert batch_time_estimate(t) == 1.0
    assert batch_time_estimate(t, "trimmed_mean") == 1.0  # 10% off each end drops the 11
    assert batch_time_estimate([1.0, 2.0, 3.0, 10.0], "trimmed_mean", trim=0.25) == 2.5
    assert representative_batch_time(t) == (1.0, "trimmed_mean")  # mean 2.0 > 1.1 x median: skewed
    even = [1.0, 1.0, 1.05, 1.1]
    assert representative_batch_time(even) == (1.025, "median")
    assert representative_batch_time(t, "mean") == (2.0, "mean")
    assert representative_batch_time(t, "median") == (1.0, "median")
    assert representative_batch_time([1.0, 1.0, 1.25], skew_tolerance=0.1) == (1.0, "median")
    assert representative_batch_time([1.0, 1.0, 1.4], skew_tolerance=0.1)[1] == "trimmed_mean"
    with pytest.raises(ValueError, match="step_times is empty"):
        batch_time_estimate([])
    with pytest.raises(ValueError, match="trim must lie in"):
        batch_time_estimate(t, "trimmed_mean", trim=0.5)
    with pytest.raises(ValueError, match="method must be 'auto'"):
        representative_batch_time(t, "mode")


def test_capacity_report_puts_the_formulas_together():
    r = capacity_report(10, 3, kv_capacity_tokens=1160, chunk_size=4, batch_time_s=0.5, rate_rps=30.0)
    assert r.expected_area == 58.0 and r.mu_rps == 1160 / (0.5 * 58) == 40.0
    assert r.delta == 13 / 1160 and r.stable_bound_rps == pytest.approx(40 * (1 - 13 / 1160))
    assert r.stable is True and r.instances_needed == 1 and r.max_total_tokens == 13 and r.area_exact
    assert (r.mean_input_tokens, r.mean_output_tokens, r.kv_capacity_tokens, r.chunk_size) == (10, 3, 1160, 4)
    over = capacity_report(10, 3, kv_capacity_tokens=1160, chunk_size=4, batch_time_s=0.5, rate_rps=80.0)
    assert over.stable is False and over.instances_needed == 3
    capped = capacity_report(
        10, 3, kv_capacity_tokens=1160, chunk_size=4, batch_time_s=0.5, max_total_tokens=116
    )
    assert capped.delta == 0.1 and capped.stable is None and capped.instances_needed is None
    assert capped.to_dict()["mu_rps"] == 40.0
