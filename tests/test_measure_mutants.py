"""theory/measure.py helpers pinned to hand-computed values, without simulating (milliseconds each).

A hand-built run result (timelines written row by row, finish times, a summary) goes through
``saturation_from_run``; workload areas of ``fixed:S:O``, ``uniform`` and a two-row trace are checked against
g(s, o) = sum_{k=1}^{ceil(s/s_hat)} min(k s_hat, s) + sum_{j=1}^{o} (s + j) by hand; the throughput
ceilings against M / (b E[g]), s_hat / (b E[s + o - 1]) and max_num_seqs / (b E[steps]).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from kvbalance.metrics.timeline import Timeline
from kvbalance.theory.measure import (
    WorkloadArea,
    batch_time_stats,
    mixed_requests,
    mixture_area,
    queue_growth,
    sample_and_hold,
    saturation_from_run,
    steady_window,
    throughput_bounds,
    window_step_times,
    workload_area,
)
from kvbalance.workloads.presets import build_requests


def test_workload_area_of_a_fixed_workload_is_g_of_its_lengths():
    # s = 10, o = 3, s_hat = 4: prefill 4 + 8 + 10 = 22, decode 11 + 12 + 13 = 36
    a = workload_area("fixed:10:3", 4)
    assert a == WorkloadArea(58.0, 10.0, 3.0, 13, 3 + 3 - 1.0)
    assert a.to_dict() == {
        "expected_area": 58.0,
        "mean_input_tokens": 10.0,
        "mean_output_tokens": 3.0,
        "max_total_tokens": 13,
        "mean_batch_steps": 5.0,
    }
    assert workload_area("fixed:10:3", 4, max_context=2048).max_total_tokens == 13  # no cap on fixed


def test_workload_area_of_a_uniform_workload_averages_g_and_the_steps():
    a = workload_area("uniform:2-4:1-3", 2)
    g = {
        (s, o): (2 * (-(-s // 2)) * (-(-s // 2) - 1) // 2 + s) + o * s + o * (o + 1) // 2
        for s in (2, 3, 4)
        for o in (1, 2, 3)
    }
    assert a.expected_area == pytest.approx(sum(g.values()) / 9, rel=1e-12)
    assert (a.mean_input_tokens, a.mean_output_tokens, a.max_total_tokens) == (3.0, 2.0, 7)
    # ceil(s/2) is 1, 2, 2 for s = 2, 3, 4: E[ceil(s/2) + o - 1] = 5/3 + 2 - 1
    assert a.mean_batch_steps == pytest.approx(8 / 3, rel=1e-12)


def test_workload_area_caps_the_largest_request_at_the_context():
    a = workload_area("alpaca", 64, max_context=256)
    assert a.max_total_tokens == 256  # inputs and outputs each reach 255; their sum is capped at 256
    assert a.mean_input_tokens + a.mean_output_tokens <= 256


def test_workload_area_of_a_trace_uses_its_pairs(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("input_len,output_len\n10,1\n2,5\n")
    a = workload_area(f"trace:{path}", 4)
    # g(10, 1) = 22 + 11 = 33, g(2, 5) = 2 + (5 x 2 + 15) = 27; steps 3 + 1 - 1 = 3 and 1 + 5 - 1 = 5
    # ess sup of the pairs is 11 (10 + 1), not max(s) + max(o) = 15
    assert a == WorkloadArea((33 + 27) / 2, 6.0, 3.0, 11, 4.0)


def test_mixture_area_mixes_each_statistic_linearly_and_takes_the_largest_present_request():
    a = WorkloadArea(58.0, 10.0, 3.0, 13, 5.0)
    b = WorkloadArea(10.0, 2.0, 4.0, 100, 2.0)
    m = mixture_area([a, b], [0.25, 0.75])
    assert m == WorkloadArea(0.25 * 58 + 0.75 * 10, 0.25 * 10 + 1.5, 0.75 + 3.0, 100, 1.25 + 1.5)
    assert mixture_area([a, b], [1.0, 0.0]).max_total_tokens == 13  # a part of weight 0 never arrives
    assert mixture_area([a], [1]) == a
    assert mixture_area([a, b], ["0.25", "0.75"]) == m
    for parts, weights in (([a, b], [1.0]), ([], []), ([a, b], [1.5, -0.5]), ([a, b], [0.5, 0.4])):
        with pytest.raises(
            ValueError, match="^weights: need one non-negative weight per part, summing to 1$"
        ):
            mixture_area(parts, weights)


def test_throughput_bounds_are_the_three_ceilings_and_the_smallest_binds():
    a = WorkloadArea(58.0, 10.0, 3.0, 13, 5.0)
    r = throughput_bounds(a, kv_capacity_tokens=1160, batch_time_s=0.5, chunk_size=4, max_num_seqs=2)
    assert r == {
        "memory_bound_rps": 1160 / (0.5 * 58),  # 40
        "token_budget_bound_rps": 4 / (0.5 * 12),  # s + o - 1 = 12 tokens per request
        "max_num_seqs_bound_rps": 2 / (0.5 * 5),  # 0.8
        "binding": "token_budget",
    }
    mem = throughput_bounds(a, kv_capacity_tokens=116, batch_time_s=0.5, chunk_size=512, max_num_seqs=256)
    assert mem["binding"] == "memory" and mem["memory_bound_rps"] == 4.0
    seqs = throughput_bounds(a, kv_capacity_tokens=11600, batch_time_s=0.5, chunk_size=512, max_num_seqs=1)
    assert seqs["binding"] == "max_num_seqs" and seqs["max_num_seqs_bound_rps"] == 0.4


def _key(r) -> tuple:
    return (r.arrival_s, r.prompt_token_ids.uid, len(r.prompt_token_ids), r.sampling.max_tokens)


def test_mixed_requests_superpose_the_streams_at_rate_over_k_and_renumber():
    reqs = mixed_requests(["fixed:10:3", "fixed:5:2"], 5, 2.0, 7, 2048)
    s0 = build_requests("fixed:10:3", 3, 1.0, 7, 2048)
    s1 = build_requests("fixed:5:2", 2, 1.0, 7 + 7919, 2048, uid_offset=10_000_000)
    expect = sorted([(*_key(r), 0) for r in s0] + [(*_key(r), 1) for r in s1])
    assert [(*_key(r), r.meta["stream"]) for r in reqs] == expect
    assert [r.request_id for r in reqs] == [f"r{i:06d}" for i in range(5)]


def test_mixed_requests_at_infinite_rate_interleave_by_position_then_stream():
    reqs = mixed_requests(["fixed:10:3", "fixed:5:2"], 5, math.inf, 0, 2048)
    assert [r.meta["stream"] for r in reqs] == [0, 1, 0, 1, 0]
    assert [len(r.prompt_token_ids) for r in reqs] == [10, 5, 10, 5, 10]
    assert [r.prompt_token_ids.uid for r in reqs] == [0, 10_000_000, 1, 10_000_001, 2]
    assert all(r.arrival_s == 0.0 for r in reqs)
    three = mixed_requests(["fixed:1:1", "fixed:2:1", "fixed:3:1"], 4, math.inf, 0, 2048)
    assert [r.meta["stream"] for r in three] == [0, 1, 2, 0]  # 4 // 3 each, the first gets the remainder
    with pytest.raises(ValueError, match="^workloads: need at least one workload$"):
        mixed_requests([], 4, 1.0, 0, 2048)


def test_batch_time_stats_by_hand():
    t = [1.0] * 9 + [11.0]
    assert batch_time_stats(t) == {
        "auto": 1.0,
        "auto_method": "trimmed_mean",  # mean 2 > 1.1 x median 1
        "median": 1.0,
        "trimmed_mean": 1.0,
        "mean": 2.0,
        "p10": 1.0,
        "p90": pytest.approx(2.0, rel=1e-12),  # linear interpolation: 1 + 0.1 x (11 - 1)
        "count": 10,
    }
    assert batch_time_stats(["1", "3"])["mean"] == 2.0  # anything numpy reads as floats, e.g. CSV strings
    s = batch_time_stats([4, 1, 2, 3])  # integers are durations too
    assert (s["median"], s["mean"], s["auto_method"], s["p10"], s["p90"]) == (2.5, 2.5, "median", 1.3, 3.7)
    with pytest.raises(ValueError, match="step_times is empty"):
        batch_time_stats([])


def test_steady_window_is_the_10th_to_90th_percentile_completion():
    assert steady_window(list(range(11))) == (1.0, 9.0)
    assert steady_window([3, 1]) == (1.2, 2.8)
    assert steady_window(["3", "1"]) == (1.2, 2.8)
    with pytest.raises(ValueError, match="^need at least two completions to find a steady window$"):
        steady_window([1.0])


def _timeline(rows) -> Timeline:
    tl = Timeline()
    for time_s, running, kv_used, kv_cap, batch_tokens, step_s in rows:
        tl.record(time_s, running, 0, kv_used, kv_cap, batch_tokens, step_s)
    return tl


def test_window_step_times_keeps_non_empty_steps_started_inside_the_closed_window():
    tl = _timeline(
        [
            (0.0, 1, 0, 100, 5, 0.1),
            (1.0, 1, 0, 100, 5, 0.2),
            (2.0, 0, 0, 100, 0, 0.3),
            (3.0, 1, 0, 100, 5, 0.4),
        ]
    )
    assert window_step_times(tl, 1.0, 3.0).tolist() == [0.2, 0.4]  # both ends included, the empty step not
    assert window_step_times(tl, 0.5, 2.5).tolist() == [0.2]
    one = _timeline([(0.0, 1, 0, 100, 1, 0.5)])  # a single decode token is a step
    assert window_step_times(one, 0.0, 1.0).tolist() == [0.5]


def test_saturation_from_a_hand_built_run():
    # two instances; completions 0..10 s give the window [1, 9]
    a = _timeline([(0.0, 9, 0, 100, 8, 1.0), (1.0, 2, 50, 100, 8, 1.0), (5.0, 4, 80, 200, 8, 3.0)])
    b = _timeline([(9.0, 6, 10, 100, 0, 2.0), (9.5, 1, 0, 100, 8, 0.5)])
    run = SimpleNamespace(
        finish_times=lambda: np.arange(11.0),
        timelines=[a, b],
        requests=[object()] * 11,
        summary={"steady_throughput_rps": 1.25, "preemptions": 3},
    )
    sat = saturation_from_run(run, 2)
    assert sat.window_s == (1.0, 9.0) and sat.throughput_rps == 1.25 and sat.num_instances == 2
    assert sat.step_times_s.tolist() == [1.0, 3.0]  # b's 9.0 step computed nothing, 9.5 is outside
    assert sat.b == batch_time_stats([1.0, 3.0])
    # step-weighted KV usage over rows at 1, 5 (a) and 9 (b): (50 + 240 + 20) / (100 + 600 + 200)
    assert sat.kv_usage_window == pytest.approx(310 / 900, rel=1e-12)
    assert sat.running_median == 4.0  # median of 2, 4, 6
    assert (sat.num_requests, sat.preemptions, sat.summary, sat.run) == (11, 3, run.summary, run)
    assert sat.to_dict() == {
        "throughput_rps": 1.25,
        "b_s": 2.0,
        "b_method": "median",
        "b_median_s": 2.0,
        "b_trimmed_mean_s": 2.0,
        "b_mean_s": 2.0,
        "b_p10_s": 1.2,
        "b_p90_s": 2.8,
        "window_steps": 2,
        "window_s": [1.0, 9.0],
        "num_instances": 2,
        "num_requests": 11,
        "preemptions": 3,
        "kv_usage_window": pytest.approx(310 / 900, abs=1e-6),  # to_json_value rounds
        "running_median": 4.0,
    }


def test_saturation_errors_and_a_window_without_capacity():
    empty = SimpleNamespace(
        finish_times=lambda: np.arange(11.0),
        timelines=[_timeline([(0.0, 1, 0, 100, 8, 1.0)])],
        requests=[],
        summary={"steady_throughput_rps": 1.0, "preemptions": 0},
    )
    with pytest.raises(ValueError, match="^saturated run has no steps inside its steady window; use more"):
        saturation_from_run(empty, 1)
    free = SimpleNamespace(**{**vars(empty), "timelines": [_timeline([(2.0, 1, 0, 0, 8, 1.0)])]})
    assert math.isnan(saturation_from_run(free, 1).kv_usage_window)  # no capacity in the window
    tiny = SimpleNamespace(**{**vars(empty), "timelines": [_timeline([(2.0, 1, 1, 2, 8, 0.25)])]})
    assert saturation_from_run(tiny, 1).kv_usage_window == 0.5  # capacity x time 0.5 token-seconds


def test_sample_and_hold_takes_the_last_row_at_or_before_each_time():
    times, values = np.array([1.0, 2.0, 4.0]), np.array([5.0, 6.0, 7.0])
    grid = np.array([0.0, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0])
    assert sample_and_hold(times, values, grid).tolist() == [0.0, 5.0, 5.0, 6.0, 6.0, 7.0, 7.0]


def test_queue_growth_fits_the_trend_on_the_grid():
    times = 10.0 + np.arange(8.0)
    q = [0, 0, 1, 2, 3, 4, 10, 12]
    g = queue_growth(times, q, 10.0, 17.0, points=8)
    slope, intercept = np.polyfit(np.arange(8.0), np.array(q, dtype=float), 1)
    assert g["grid_s"].tolist() == times.tolist() and g["queue"].tolist() == q
    assert g["slope_rps"] == pytest.approx(slope, rel=1e-12) and g["intercept"] == pytest.approx(
        intercept, abs=1e-12
    )
    assert (g["t_start_s"], g["t_end_s"], g["max"]) == (10.0, 17.0, 12.0)
    assert (g["first_quarter_mean"], g["last_quarter_mean"], g["growing"]) == (0.0, 11.0, True)
    # levels off: last quarter 7 is not above 2 x 1 + 5
    flat = queue_growth(np.arange(4.0), [1, 3, 5, 7], 0.0, 3.0, points=4)
    assert flat["slope_rps"] == pytest.approx(2.0) and flat["intercept"] == pytest.approx(1.0)
    assert (flat["first_quarter_mean"], flat["last_quarter_mean"], flat["growing"]) == (1.0, 7.0, False)
    assert queue_growth(np.arange(4.0), [1, 3, 5, 7.5], 0.0, 3.0, points=4)["growing"] is True
    shrinking = queue_growth(np.arange(4.0), [20, 0, 0, 30], 0.0, 3.0, points=4)
    assert shrinking["slope_rps"] > 0 and shrinking["growing"] is False  # 30 is not above 2 x 20 + 5
    assert queue_growth(np.arange(4.0), [0, 30, 0, 6], 0.0, 3.0, points=4)["growing"] is False  # slope < 0
    assert len(queue_growth(times, q, 10.0, 17.0)["grid_s"]) == 400
    slow = queue_growth(np.arange(8.0), [0, 0, 0, 0, 0, 0, 6, 6], 0.0, 7.0, points=8)
    assert 0 < slow["slope_rps"] < 1 and slow["growing"] is True  # any positive trend counts
    text = queue_growth(["0", "1", "2", "3"], ["1", "3", "5", "7"], 0.0, 3.0, points=4)
    assert text["queue"].tolist() == [1.0, 3.0, 5.0, 7.0]
    with pytest.raises(ValueError, match=r"^t_end: must be after t_start \(3.0\), got 3.0$"):
        queue_growth(times, q, 3.0, 3.0)
