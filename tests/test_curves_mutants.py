"""Element-wise memory curves of the cost model by hand, and the step's small-kernel path (milliseconds each).

``wave_rows``: T + w (ceil(T / SMs) SMs - T); ``curve_eff``: eff + gain / (1 + (bytes / (s L2)) ** p);
memory time bytes * max(rows, T_sat) / (T bw e), or ``small_per_token_s * T`` at or below ``small_tokens``;
the step books each launch's latency (the small path's at or below ``small_tokens``) as overhead, and the
vectorised fit predictor must give the same step time on such a GPU.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kvbalance.batch import StepBreakdown
from kvbalance.perf.calibrate import predict_samples
from kvbalance.perf.cost import CostModel, breakdown_total_s
from kvbalance.perf.kernels import curve_eff, elementwise_counts, memory_time_s, wave_rows
from kvbalance.specs import MemoryCurve, get_gpu


def test_wave_rows_by_hand():
    assert wave_rows(100, 0.5, 64) == 100 + 0.5 * 28  # two waves of 64 rows pay for 128
    assert wave_rows(100, 1.0, 64) == 128
    assert wave_rows(2.5, 0.5, 1) == 2.75  # ceil(2.5) = 3 rows on one SM
    assert wave_rows(np.array([1.0, 64.0, 65.0]), 0.5, 64).tolist() == [32.5, 64.0, 96.5]
    assert (
        wave_rows(100, 0.5, 0) == 100 and wave_rows(100, 0.0, 64) == 100 and wave_rows(100, -1.0, 64) == 100
    )
    assert wave_rows(math.inf, 0.0, 64) == math.inf  # no wave term: nothing is computed


def test_curve_eff_by_hand():
    hw = dataclasses.replace(get_gpu("a100-80gb"), l2_cache_bytes=1e6)
    c = MemoryCurve(eff=0.5, l2_eff_gain=0.3, l2_bytes_scale=2.0, l2_sharpness=2.0)
    assert curve_eff(c, 4e6, hw) == pytest.approx(0.5 + 0.3 / (1 + 2.0**2), rel=1e-12)  # 4e6 / (2 x 1e6) = 2
    assert curve_eff(dataclasses.replace(c, l2_eff_gain=1.0), 4e6, hw) == pytest.approx(
        0.5 + 1 / 5, rel=1e-12
    )
    assert curve_eff(dataclasses.replace(c, l2_eff_gain=0.0), 4e6, hw) == 0.5
    assert curve_eff(c, 4e6, dataclasses.replace(hw, l2_cache_bytes=0.0)) == 0.5  # no cache term
    half = dataclasses.replace(hw, l2_cache_bytes=0.5)
    one = MemoryCurve(eff=0.5, l2_eff_gain=0.3)  # scale 1, sharpness 1: eff + gain L2 / (L2 + bytes)
    assert curve_eff(one, 1.0, half) == pytest.approx(0.5 + 0.3 / 3, rel=1e-12)


def test_memory_time_on_a_curve_by_hand():
    c = MemoryCurve(eff=0.5, sat_tokens=10, wave_weight=0.5, small_tokens=4, small_per_token_s=1e-7)
    hw = dataclasses.replace(
        get_gpu("a100-80gb"), num_sms=64, l2_cache_bytes=0.0, elementwise_curves={"norm": c}
    )
    bw = hw.mem_bandwidth_bytes_s
    assert memory_time_s(1e6, hw, "elementwise", 100, "norm") == pytest.approx(1e6 * 114 / (100 * bw * 0.5))
    # 5 tokens: one wave of 64 rows, half paid for: 5 + 0.5 x 59 = 34.5 rows
    assert memory_time_s(1e6, hw, "elementwise", 5, "norm") == pytest.approx(1e6 * 34.5 / (5 * bw * 0.5))
    flat = dataclasses.replace(hw, elementwise_curves={"rope": MemoryCurve(eff=0.5, sat_tokens=10)})
    assert memory_time_s(1e6, flat, "elementwise", 5, "rope") == pytest.approx(
        1e6 * 10 / (5 * bw * 0.5)
    )  # T_sat
    assert memory_time_s(1e6, hw, "elementwise", 4, "norm") == pytest.approx(4e-7)  # the small path
    assert memory_time_s(0.0, hw, "elementwise", 100, "norm") == 0.0


def test_elementwise_counts_by_hand():
    # T = 3 tokens, h = 64, q 64 and kv 16 per rank, I = 100, 2 bytes, norm weights 128
    gated = elementwise_counts(3, 64, 64, 16, 100, 2, True, 128)
    assert gated == {
        "embedding": (0.0, 768.0),
        "norm": (960.0, 1024.0),
        "rope": (720.0, 960.0),
        "kv_write": (0.0, 384.0),
        "activation": (1500.0, 1800.0),  # SwiGLU: reads gate and up, writes one
        "residual_add": (192.0, 1152.0),
    }
    plain = elementwise_counts(3, 64, 64, 16, 100, 2, False, 128)
    assert plain["activation"] == (300.0, 1200.0) and {
        k: v for k, v in plain.items() if k != "activation"
    } == {k: v for k, v in gated.items() if k != "activation"}


def test_breakdown_total_adds_every_part():
    assert breakdown_total_s(StepBreakdown(1.0, 2.0, 4.0, 8.0, 16.0)) == 31.0


def _curvy_gpu():
    small = MemoryCurve(
        eff=0.6, latency_s=3e-6, small_tokens=16, small_latency_s=1e-6, small_per_token_s=1e-8
    )
    return dataclasses.replace(
        get_gpu("a100-80gb"),
        kv_memory_eff_ratio=0.5,
        num_sms=108,
        host_overhead_per_token_s=1e-7,
        elementwise_curves={
            "embedding": small,
            "norm": MemoryCurve(eff=0.7, sat_tokens=32, latency_s=2e-6, wave_weight=0.5),
        },
    )


@pytest.mark.parametrize("tokens", [8, 16, 17, 64])
def test_step_books_the_small_path_latency_and_splits_by_roofline(tokens):
    cm = CostModel("llama-2-7b", _curvy_gpu(), engine="hardware")  # the spec's host terms, serial
    seqs = [(tokens, tokens + 100, True), (1, 300, True)]
    b, times = cm.step(seqs), cm.op_times(seqs)
    latency = sum(t.latency_s for t in times.values())
    assert b.overhead_s == pytest.approx(cm.host_overhead_s(2, tokens + 1) + latency, rel=1e-12)
    assert b.compute_s == pytest.approx(sum(t.compute_s for t in times.values() if t.compute_s > t.memory_s))
    assert b.memory_s == pytest.approx(sum(t.memory_s for t in times.values() if t.compute_s <= t.memory_s))
    emb = times["embedding"].latency_s
    assert emb == (1e-6 if tokens + 1 <= 16 else 3e-6)  # one launch over all the step's tokens


def test_vectorised_prediction_on_curves_small_paths_and_kv_ratio():
    hw = _curvy_gpu()
    steps = [[(1, 300, True)] * 3, [(15, 15, True)], [(16, 400, False), (1, 50, True)], [(200, 200, True)]]
    cm = CostModel("llama-2-7b", hw, engine="hardware")  # predict_samples: the spec's host terms, serial
    pred = predict_samples("llama-2-7b", hw, [(s, 1.0) for s in steps])
    assert pred.tolist() == pytest.approx([cm.step_seconds(s) for s in steps], rel=1e-12)
