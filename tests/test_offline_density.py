"""Compute density, the practical optimum and the dual scan's memory split, against hand computation."""

import pytest

from kvbalance.offline.density import (
    DensityConstants,
    comp_s,
    compute_density,
    group_density,
    ideal_bound_s,
    mem_s,
)
from kvbalance.offline.dual_scan import dual_scan, memory_split, side_budget
from kvbalance.perf.cost import CostModel

K = DensityConstants(
    num_params=8e9,
    hidden_size=4096,
    num_layers=32,
    kv_bytes_per_token=131072,
    flops_per_s=1e14,
    bytes_per_s=1e12,
)


def test_comp_and_mem_match_the_paper_formulas_by_hand():
    p, d = 1000, 200
    comp = (2 * (1000 + 200) * 8e9 + 4 * 1000**2 * 4096 * 32) / 1e14
    mem = (1000 * 200 + 200**2 / 2) * 131072 / 1e12
    assert comp_s(p, d, K) == pytest.approx(comp, rel=1e-12)
    assert mem_s(p, d, K) == pytest.approx(mem, rel=1e-12)
    assert compute_density(p, d, K) == pytest.approx(comp / mem, rel=1e-12)
    # a one-token answer after a long prompt is compute-heavy, a long generation memory-heavy
    assert compute_density(1000, 1, K) > 100 > 1 > compute_density(100, 16384, K)


def test_constants_come_from_the_cost_model():
    cm = CostModel("llama-3.1-8b", "a100-80gb", tp=2)
    k = DensityConstants.from_cost_model(cm)
    g, m = cm.gpu, cm.model
    assert k.num_params == m.num_params
    assert k.kv_bytes_per_token == 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes
    assert k.flops_per_s == pytest.approx(2 * g.peak_flops * g.compute_eff_max)
    assert k.bytes_per_s == pytest.approx(
        2 * g.mem_bandwidth_bytes_s * g.memory_eff_max * g.kv_memory_eff_ratio
    )


def test_group_density_and_optimum():
    assert group_density(10.0, 4.0, 0.25) == pytest.approx(0.75 * 10 / 4)
    assert ideal_bound_s(10.0, 4.0, 0.25) == pytest.approx(7.5)
    assert ideal_bound_s(10.0, 9.0, 0.25) == pytest.approx(9.0)
    with pytest.raises(ValueError, match="sharing"):
        group_density(1.0, 1.0, 1.5)
    with pytest.raises(ValueError, match="d:"):
        compute_density(10, 0, K)


@pytest.mark.parametrize("rho_root,rho_l,rho_r", [(1.2, 5.0, 0.3), (0.9, 1.4, 0.2), (2.0, 40.0, 0.05)])
def test_memory_split_solves_the_balance_equation(rho_root, rho_l, rho_r):
    m = 400_000.0
    m_l, m_r = memory_split(m, rho_root, rho_l, rho_r)
    assert m_l + m_r == pytest.approx(m)
    assert rho_l * m_l + rho_r * m_r == pytest.approx(rho_root * m)
    assert 0 < m_l < m and 0 < m_r < m


def test_memory_split_clamps_outside_the_range():
    assert memory_split(100.0, 10.0, 5.0, 1.0) == (100.0, 0.0)  # the job is denser than the left end
    assert memory_split(100.0, 0.5, 5.0, 1.0) == (0.0, 100.0)
    assert memory_split(100.0, 1.0, 1.0, 1.0) == (50.0, 50.0)


def test_side_budget_is_n_and_c_of_the_paper():
    n, c = side_budget(60_000, 1000, 200)  # N = 60000 / (1000 + 100) = 54.5, C = N * 1000 / 200 = 272.7
    assert n == pytest.approx(60_000 / 1100)
    assert c == 384 and c % 128 == 0


def test_dual_scan_admits_every_request_once_from_both_ends():
    n = 50
    p = [500] * n
    d = [1 + 10 * i for i in range(n)]  # density falls with i: sequence 0..n-1 is non-increasing
    comp = [float(comp_s(p[i], d[i], K)) for i in range(n)]
    mem = [float(mem_s(p[i], d[i], K)) for i in range(n)]
    rho_root = sum(comp) / sum(mem)
    res = dual_scan(list(range(n)), p, d, comp, mem, rho_root, m_tokens=5_000, chunk_tokens=512)
    assert sorted(res.order) == list(range(n))
    assert res.order[0] == 0 and n - 1 in res.order[:3]  # both ends start at once
    lefts = [i for i, s in zip(res.order, res.side) if s == 0]
    rights = [i for i, s in zip(res.order, res.side) if s == 1]
    assert lefts == sorted(lefts) and rights == sorted(rights, reverse=True)
    assert all(t % 128 == 0 for t in res.batch_prefill_tokens)
    assert res.m_left_tokens + res.m_right_tokens == pytest.approx(5_000)
