"""Tests for the queueing-stability formulas (theory/stability.py) and the elastic reserve formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvbalance.perf.memory import (
    activation_reserve_bytes,
    kv_bytes_per_token,
    kv_pool_bytes,
    lendable_kv_tokens,
    reserve_share_of_kv,
)
from kvbalance.specs import ModelSpec, get_model
from kvbalance.theory import (
    CapacityReport,
    area_stats,
    batch_time_estimate,
    capacity_report,
    expected_area,
    instances_needed,
    memory_time_area,
    stability_margin,
    stability_verdict,
    stable_service_rate,
)
from kvbalance.workloads.lengths import Empirical
from kvbalance.workloads.lengths import Uniform as UniformInt


def brute_force_area(s: int, o: int, chunk: int) -> int:
    """g(s, o) summed token by token: prefill chunks k = 1.. until s is covered, then each decode step."""
    total, k = 0, 1
    while (k - 1) * chunk < s:
        total += min(k * chunk, s)
        k += 1
    for j in range(1, o + 1):
        total += s + j
    return total


# ---- g(s, o) ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 16])
def test_area_matches_brute_force_including_non_dividing_chunks(chunk):
    for s in range(0, 40):
        for o in range(0, 12):
            assert memory_time_area(s, o, chunk) == brute_force_area(s, o, chunk), (s, o, chunk)


def test_area_equals_papers_sum_when_chunk_divides_prompt():
    s_hat = 512
    for n in range(1, 6):
        s, o = n * s_hat, 37
        paper = sum(k * s_hat for k in range(1, n + 1)) + sum(s + j for j in range(1, o + 1))
        assert memory_time_area(s, o, s_hat) == paper


def test_area_is_vectorised_and_exact_integer():
    s = np.array([10, 513, 1600, 2133])
    o = np.array([1600, 1, 10, 1066])
    g = memory_time_area(s, o, 512)
    assert g.dtype == np.int64
    assert g.tolist() == [brute_force_area(int(a), int(b), 512) for a, b in zip(s, o)]
    # decode part in closed form: o*s + o(o+1)/2
    assert memory_time_area(0, 5, 4) == 15


def test_area_rejects_bad_lengths():
    with pytest.raises(ValueError, match="s must"):
        memory_time_area(-1, 3, 4)
    with pytest.raises(ValueError, match="chunk_size"):
        memory_time_area(3, 3, 0)
    with pytest.raises(ValueError, match="whole token"):
        memory_time_area(2.5, 3, 4)


# ---- E[g] ---------------------------------------------------------------------------------------------


def test_expected_area_exact_matches_brute_force_over_small_product():
    s_dist, o_dist = UniformInt(3, 9), UniformInt(1, 5)
    brute = np.mean([brute_force_area(s, o, 4) for s in range(3, 10) for o in range(1, 6)])
    assert expected_area(s_dist, o_dist, 4) == pytest.approx(brute, rel=1e-12)
    # the same distributions as (values, probs) tuples and as sample arrays
    as_tuple = (np.arange(3, 10), np.full(7, 1 / 7))
    assert expected_area(as_tuple, np.arange(1, 6), 4) == pytest.approx(brute, rel=1e-12)


def test_expected_area_uniform_exact_agrees_with_monte_carlo_within_1pct():
    s_dist, o_dist = UniformInt(10, 1600), UniformInt(10, 1600)
    exact = expected_area(s_dist, o_dist, 512)
    mc = expected_area(s_dist, o_dist, 512, exact=False, n_samples=100_000, seed=1)
    assert mc == pytest.approx(exact, rel=0.01)


def test_expected_area_samples_duck_typed_distributions():
    class Fixed:  # has only .sample, so its moments come from Monte Carlo
        def sample(self, rng, n):
            return np.full(n, 100.0)

    got = expected_area(Fixed(), UniformInt(1, 3), 64, n_samples=1000)
    want = np.mean([brute_force_area(100, o, 64) for o in (1, 2, 3)])
    assert got == pytest.approx(want, rel=1e-12)
    stats = area_stats(Fixed(), UniformInt(1, 3), 64, n_samples=1000)
    assert not stats.exact and stats.max_total_tokens == 103


def test_expected_area_paired_samples_is_exact_mean_over_pairs():
    s = np.array([10, 700, 1500])
    o = np.array([300, 5, 1200])
    want = sum(brute_force_area(a, b, 512) for a, b in zip(s, o)) / 3
    assert expected_area(s, o, 512, paired=True) == want
    # independent use of the same arrays mixes the pairs, so it differs
    assert expected_area(Empirical(s), Empirical(o), 512) != pytest.approx(want)


def test_monte_carlo_is_deterministic_for_a_seed():
    a = expected_area(UniformInt(1, 50), UniformInt(1, 50), 8, exact=False, n_samples=5000, seed=7)
    b = expected_area(UniformInt(1, 50), UniformInt(1, 50), 8, exact=False, n_samples=5000, seed=7)
    assert a == b


# ---- mu, delta, verdict ---------------------------------------------------------------------------------


def test_stable_service_rate_is_m_over_b_times_eg():
    assert stable_service_rate(131_000, 0.05, 1_000_000) == 131_000 / (0.05 * 1_000_000)
    with pytest.raises(ValueError, match="batch_time_s"):
        stable_service_rate(131_000, 0.0, 1.0)


def test_stability_margin_and_oversized_request():
    assert stability_margin(3200, 131_000) == 3200 / 131_000
    with pytest.raises(ValueError, match="never fit"):
        stability_margin(200_000, 131_000)


def test_verdict_at_the_boundaries():
    mu, delta = 10.0, 0.1
    assert stability_verdict(mu, mu, delta) is False  # critical load is not stable
    assert stability_verdict(mu * 1.01, mu, delta) is False
    assert stability_verdict(math.nextafter(mu * (1 - delta), 0), mu, delta) is True
    assert stability_verdict(mu * (1 - delta), mu, delta) == "margin"
    assert stability_verdict(9.5, mu, delta) == "margin"
    assert stability_verdict(0.0, mu, delta) is True
    with pytest.raises(ValueError, match="rate"):
        stability_verdict(-1.0, mu, delta)


def test_instances_needed_is_smallest_stable_count():
    assert instances_needed(0.0, 10.0, 0.1) == 1
    assert instances_needed(8.9, 10.0, 0.1) == 1
    assert instances_needed(9.0, 10.0, 0.1) == 2  # 9/1 is not < 9
    assert instances_needed(18.0, 10.0, 0.1) == 3
    assert instances_needed(17.99, 10.0, 0.1) == 2
    assert instances_needed(8.9, 10.0, 0.1, headroom=0.5) == 2
    for rate in np.linspace(0.1, 100, 57):
        n = instances_needed(rate, 3.3, 0.05)
        assert rate / n < 3.3 * 0.95 and (n == 1 or rate / (n - 1) >= 3.3 * 0.95)


def test_batch_time_median_and_trimmed_mean():
    times = [1.0] * 9 + [100.0]
    assert batch_time_estimate(times) == 1.0
    assert batch_time_estimate(times, "trimmed_mean", trim=0.1) == 1.0
    assert batch_time_estimate(times, "trimmed_mean", trim=0.0) == pytest.approx(10.9)
    assert batch_time_estimate(list(range(1, 21)), "trimmed_mean") == pytest.approx(10.5)
    with pytest.raises(ValueError, match="empty"):
        batch_time_estimate([])


def test_capacity_report_for_papers_llama3_8b_setup():
    report = capacity_report(
        UniformInt(10, 1600),
        UniformInt(10, 1600),
        kv_capacity_tokens=131_000,
        chunk_size=512,
        batch_time_s=0.05,
        rate_rps=3.0,
    )
    assert isinstance(report, CapacityReport)
    assert report.max_total_tokens == 3200 and report.delta == pytest.approx(3200 / 131_000)
    assert report.mean_input_tokens == pytest.approx(805) and report.mean_output_tokens == pytest.approx(805)
    assert report.mu_rps == pytest.approx(131_000 / (0.05 * report.expected_area))
    assert report.stable is False and report.instances_needed == 2
    d = report.to_dict()
    assert {"mu_rps", "delta", "b_s", "stable", "instances_needed", "expected_area"} <= d.keys()
    # 2:1 P/D ratio has the same total length but less decode area, so a higher mu
    r21 = capacity_report(
        UniformInt(10, 2133),
        UniformInt(10, 1066),
        kv_capacity_tokens=131_000,
        chunk_size=512,
        batch_time_s=0.05,
    )
    assert r21.mu_rps > report.mu_rps and r21.stable is None


# ---- elastic reserve -------------------------------------------------------------------------------------

QWEN25_7B = dict(
    num_layers=28,
    hidden_size=3584,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    intermediate_size=18944,
    vocab_size=152064,
    dtype_bytes=2,
)


QWEN = ModelSpec(name="qwen-shape", max_context=32768, **QWEN25_7B)


def test_reserve_is_several_gb_at_32k_chunk_and_shrinks_with_tp():
    r1 = activation_reserve_bytes(QWEN, chunk_size=32768, tp=1)
    r4 = activation_reserve_bytes(QWEN, chunk_size=32768, tp=4)
    assert 3e9 < r1 < 8e9
    # the replicated residual stream keeps it from dividing by exactly tp
    assert 2.0 < r1 / r4 <= 4.0


def test_reserve_closed_form_and_growth_with_chunk():
    c, e, h, d = 1024, 2, 3584, 128
    attn = c * e * ((28 + 2 * 4) * d + (28 + 4) * d + 28 * d + h)
    mlp = c * e * (3 * 18944 + h)
    sampler = 256 * 152064 * (e + 8)
    assert activation_reserve_bytes(QWEN, c) == 2 * c * h * e + max(attn, mlp, sampler)
    assert activation_reserve_bytes(QWEN, 8192) == activation_reserve_bytes(get_model("qwen2.5-7b"), 8192)
    sizes = [activation_reserve_bytes(QWEN, c) for c in (2048, 8192, 32768)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[1] < sizes[2]
    with pytest.raises(ValueError, match="chunk_size"):
        activation_reserve_bytes(QWEN, 0)


def test_reserve_share_of_kv_and_lendable_tokens():
    gib = 1024**3
    reserve = activation_reserve_bytes(QWEN, chunk_size=32768)
    pool = kv_pool_bytes(80 * gib, 15 * gib, reserve, 0.9)
    assert pool == int(0.9 * 80 * gib) - 15 * gib - reserve
    share = reserve_share_of_kv(80 * gib, 15 * gib, reserve, 0.9)
    assert share == pytest.approx(reserve / (0.9 * 80 * gib - 15 * gib))
    assert 0.05 < share < 0.15
    assert kv_bytes_per_token(QWEN) == 2 * 28 * 4 * 128 * 2
    assert kv_bytes_per_token(QWEN, tp=8) == 2 * 28 * 1 * 128 * 2  # 4 KV heads replicated over 8 ranks
    assert lendable_kv_tokens(reserve, QWEN) == reserve // (2 * 28 * 4 * 128 * 2)
    with pytest.raises(ValueError, match="no memory left"):
        kv_pool_bytes(16 * gib, 15 * gib, reserve, 0.9)
