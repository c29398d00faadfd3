"""The utilisation monitor: compute and memory seconds of steps over a sliding window."""

from __future__ import annotations

import pytest

from kvbalance.batch import StepBreakdown
from kvbalance.cluster.monitor import UtilizationMonitor


def bd(compute_s: float = 0.0, memory_s: float = 0.0, overhead_s: float = 0.0) -> StepBreakdown:
    return StepBreakdown(compute_s=compute_s, memory_s=memory_s, overhead_s=overhead_s)


def test_steps_inside_the_window_sum_over_its_wall_time():
    m = UtilizationMonitor(window_s=1.0)
    m.add_gpu("g0")
    for i in range(10):  # 10 steps of 50 ms each 100 ms apart: 30 ms compute, 15 ms memory, 5 ms overhead
        m.record_step("g0", 0.1 * i, bd(0.03, 0.015, 0.005))
    u = m.utilization("g0", 1.0)
    assert u.compute_util == pytest.approx(0.3) and u.memory_util == pytest.approx(0.15)
    assert u.busy_util == pytest.approx(0.5) and u.time_util == pytest.approx(0.45)
    assert u.combined == pytest.approx(0.45) and u.memory_share == pytest.approx(1 / 3)
    assert not u.memory_bound and u.covered_s == pytest.approx(1.0)


def test_a_step_straddling_the_window_edge_counts_pro_rata():
    m = UtilizationMonitor(window_s=1.0)
    m.add_gpu("g0")
    m.record_step("g0", 0.0, bd(0.4, 0.4), duration_s=0.8)  # [0, 0.8): half of it in [0.4, 1.4]
    m.record_step("g0", 1.2, bd(0.0, 0.4), duration_s=0.4)  # [1.2, 1.6): half of it before 1.4
    u = m.utilization("g0", 1.4)
    assert u.compute_util == pytest.approx(0.2) and u.memory_util == pytest.approx(0.2 + 0.2)
    assert u.busy_util == pytest.approx(0.4 + 0.2)
    later = m.utilization("g0", 3.0)  # everything has left the window
    assert later.combined == 0 and later.busy_util == 0


def test_warm_up_divides_by_the_time_watched_and_kv_occupancy_can_bind():
    m = UtilizationMonitor(window_s=2.0)
    m.add_gpu("g0", now=10.0)
    m.record_step("g0", 10.0, bd(0.0, 0.25))
    u = m.utilization("g0", 10.5)
    assert u.covered_s == pytest.approx(0.5) and u.memory_util == pytest.approx(0.5)
    m.record_kv("g0", 0.9)
    u = m.utilization("g0", 10.5)
    assert u.combined == pytest.approx(0.9) and u.memory_bound


def test_idle_gpu_is_zero_and_snapshots_go_into_history():
    m = UtilizationMonitor(window_s=1.0)
    m.add_gpu("busy")
    m.add_gpu("idle")
    m.record_step("busy", 0.0, bd(0.5), duration_s=0.5)
    snap = m.sample(1.0)
    assert snap["busy"].combined == pytest.approx(0.5) and snap["idle"].combined == 0
    assert snap["idle"].memory_share == 0.5 and not snap["idle"].memory_bound
    assert m.history == [(1.0, snap)] and m.gpus == ["busy", "idle"]


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="window_s"):
        UtilizationMonitor(window_s=0)
    m = UtilizationMonitor()
    m.add_gpu("g0", now=1.0)
    with pytest.raises(ValueError, match="gpu"):
        m.add_gpu("g0")
    with pytest.raises(ValueError, match="gpu"):
        m.record_step("g9", 1.0, bd(0.1))
    with pytest.raises(ValueError, match="start_s"):
        m.record_step("g0", 0.5, bd(0.1))
    m.record_step("g0", 2.0, bd(0.1))
    with pytest.raises(ValueError, match="start_s"):
        m.record_step("g0", 1.5, bd(0.1))
    with pytest.raises(ValueError, match="duration_s"):
        m.record_step("g0", 3.0, bd(0.1), duration_s=-1)
    with pytest.raises(ValueError, match="kv_utilization"):
        m.record_kv("g0", 1.5)


def test_cost_model_steps_classify_prefill_as_compute_and_decode_as_memory_bound():
    from kvbalance.perf.cost import CostModel, breakdown_total_s

    cm = CostModel("llama-13b", "a100-80gb")
    m = UtilizationMonitor(window_s=2.0)
    for g in ("prefill", "decode"):
        m.add_gpu(g)
    for g, seqs in (("prefill", [(2048, 2048, True)]), ("decode", [(1, 1500, True)] * 48)):
        b, t = cm.step(seqs), 0.0
        while t < 2.0:
            m.record_step(g, t, b)
            t += breakdown_total_s(b)
    snap = m.snapshot(2.0)
    assert snap["prefill"].memory_share < 0.2 and not snap["prefill"].memory_bound
    # fitted presets: 48-token GEMMs sit near the roofline ridge (the A40-fitted GEMM curve reaches half its
    # peak fraction at M=117), so a third of this decode step's time is compute-bound
    assert snap["decode"].memory_share > 0.6 and snap["decode"].memory_bound
    for u in snap.values():  # back-to-back steps: busy all the time, operators most of it
        assert u.busy_util == pytest.approx(1.0) and 0.8 < u.time_util < 1.0
