"""perf/calibrate.py's CPU guess and the fit's bookkeeping, by hand (well under a second each).

``cpu_base_spec``: peak = cores x 2.5 GHz x 32 FLOP/cycle, bandwidth 6 GB/s per core clamped to [20, 300] GB/s,
capacity = physical RAM (16 GiB when unknown). ``fit_hardware`` on a one-parameter fit of exact samples:
its errors, names, note and the relative errors |pred - meas| / meas it reports.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvbalance.perf import calibrate
from kvbalance.perf.calibrate import FITTABLE, cpu_base_spec, fit_hardware, predict_samples
from kvbalance.perf.cost import CostModel
from kvbalance.specs import get_link


def test_cpu_base_spec_fields(monkeypatch):
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1000}
    monkeypatch.setattr(os, "sysconf", lambda key: pages[key])
    s = cpu_base_spec(4)
    assert (s.name, s.kind, s.peak_flops, s.mem_bandwidth_bytes_s) == ("cpu", "cpu", 4 * 2.5e9 * 32, 24e9)
    assert s.mem_capacity_bytes == 4096 * 1000 and s.tp_link == get_link("pcie4")
    assert (s.compute_eff_max, s.compute_half_tokens, s.memory_eff_max, s.memory_half_bytes) == (
        0.5,
        4.0,
        0.7,
        65536,
    )
    assert (s.attention_eff_ratio, s.step_overhead_s, s.per_layer_overhead_s) == (0.3, 2e-3, 50e-6)
    assert s.source == "guess from 4 cores (kvbalance.perf.calibrate.cpu_base_spec)"
    assert (
        cpu_base_spec(1).mem_bandwidth_bytes_s == 20e9 and cpu_base_spec(100).mem_bandwidth_bytes_s == 300e9
    )
    assert (
        cpu_base_spec(2, 1e9, 8, name="box").peak_flops == 16e9 and cpu_base_spec(2, name="box").name == "box"
    )
    with pytest.raises(ValueError, match="^num_cores: must be >= 1, got -1$"):
        cpu_base_spec(-1)


def test_cpu_base_spec_without_core_count_or_ram(monkeypatch):
    def no_sysconf(key):
        raise ValueError(key)

    monkeypatch.setattr(os, "sysconf", no_sysconf)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert cpu_base_spec().peak_flops == 8 * 2.5e9 * 32 and cpu_base_spec().mem_capacity_bytes == 16 << 30
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert cpu_base_spec().peak_flops == 1 * 2.5e9 * 32  # unknown: one core


STEPS = [[(1, 64, True)] * b for b in (1, 4, 16)] + [[(n, n, True)] for n in (8, 64)]


def _samples(hw, tp=1):
    cm = CostModel("tiny-llama", hw, tp)
    return [(s, cm.step_seconds(s)) for s in STEPS]


def test_fit_hardware_bookkeeping():
    base = cpu_base_spec(8)
    true = base.with_(step_overhead_s=4e-3)
    samples = _samples(true)
    r = fit_hardware("tiny-llama", base, samples, fit=("step_overhead_s",))
    assert r.params["step_overhead_s"] == pytest.approx(4e-3, rel=1e-6) and r.num_samples == 5
    assert r.hardware.name == "cpu-fitted"
    assert (
        r.hardware.source == "fitted from 5 profiled steps of tiny-llama (params: step_overhead_s); base: cpu"
    )
    meas = np.array([t for _, t in samples])
    rel = np.abs(predict_samples("tiny-llama", r.hardware, samples) - meas) / meas
    assert r.mean_rel_error == pytest.approx(float(np.mean(rel)), rel=1e-9, abs=1e-15)
    assert r.max_rel_error == pytest.approx(float(np.max(rel)), rel=1e-9, abs=1e-15)
    base_rel = np.abs(predict_samples("tiny-llama", base, samples) - meas) / meas
    assert (
        r.base_median_rel_error == pytest.approx(float(np.median(base_rel)), rel=1e-12)
        and r.base_median_rel_error > 0.01
    )
    named = fit_hardware("tiny-llama", base, samples[:1], fit=("step_overhead_s",), name="mine")
    assert named.hardware.name == "mine" and named.num_samples == 1  # as many samples as parameters is enough


def test_fit_hardware_uses_the_tp_degree():
    base = cpu_base_spec(8)
    samples = _samples(base.with_(step_overhead_s=4e-3), tp=2)
    r = fit_hardware("tiny-llama", base, samples, tp=2, fit=("step_overhead_s",))
    assert r.params["step_overhead_s"] == pytest.approx(4e-3, rel=1e-6) and r.max_rel_error < 1e-6


def test_fit_hardware_input_errors():
    base = cpu_base_spec(4)
    with pytest.raises(
        ValueError, match=f"^fit: unknown parameter 'peak' \\(fittable: {', '.join(FITTABLE)}\\)$"
    ):
        fit_hardware("tiny-llama", base, [([(1, 1, True)], 1.0)] * 3, fit=("peak",))
    with pytest.raises(ValueError, match="^samples: need at least 2 profile samples, got 1$"):
        fit_hardware("tiny-llama", base, [([(1, 1, True)], 1.0)], fit=("step_overhead_s", "compute_eff_max"))
    with pytest.raises(ValueError, match="^samples: need at least 1 profile samples, got 0$"):
        fit_hardware("tiny-llama", base, [], fit=())
    assert fit_hardware("tiny-llama", base, [([(1, 1, True)], 1.0)], fit=()).num_samples == 1
    with pytest.raises(ValueError, match="^samples: every measured time must be > 0 seconds$"):
        fit_hardware("tiny-llama", base, [([(1, 1, True)], 0.0)] * 2, fit=("step_overhead_s",))


def test_from_free_bounds():
    assert calibrate._from_free("compute_eff_max", -700.0) == 0.0  # at the cut: no exp(700) term
    assert calibrate._from_free("compute_eff_max", -699.0) == 1.0 / (1.0 + np.exp(699.0))
    assert calibrate._from_free("kv_memory_eff_ratio", 701.0) == 10.0
