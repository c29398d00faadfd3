"""``kvbalance profile``: grid timing on the real executor, the fitted CPU preset, and its use by the simulator."""

from __future__ import annotations

import json
import math
import warnings

import pytest

pytest.importorskip("torch")

from kvbalance.model.weights import RandomWeightsWarning  # noqa: E402
from kvbalance.profile import (  # noqa: E402
    ProfileConfig,
    _build_executor,
    fit_cpu_preset,
    kv_blocks_for_grid,
    measure_grid,
    profile_grid,
    run_profile,
)
from kvbalance.sim.run import SimulateConfig, run_simulation  # noqa: E402
from kvbalance.specs import HardwareSpec, get_gpu  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_random_weights():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RandomWeightsWarning)
        yield


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RandomWeightsWarning)
        result = run_profile(
            ProfileConfig.quick_config("tiny-llama", validate=False), out, log=lambda _: None
        )
    return out, result


def test_grid_covers_prefill_decode_and_mixed_steps():
    grid = profile_grid(quick=False, max_context=8192)
    names = [p.name for p in grid]
    assert any(n.startswith("prefill-") for n in names)
    assert any(n.startswith("decode-64x") for n in names)
    assert any(n.startswith("mixed-") for n in names)
    for p in grid:
        for n, ctx, _ in p.seqs:
            assert 1 <= n <= ctx


def test_grid_respects_max_context():
    for p in profile_grid(quick=False, max_context=512):
        assert all(ctx <= 512 for _, ctx, _ in p.seqs)


def test_measured_steps_are_positive_and_forward_fits_inside():
    grid = profile_grid(quick=True, max_context=512)[:3]
    ex, config = _build_executor("tiny-llama", kv_blocks_for_grid(grid, 16), 16, 1, 0)
    samples = measure_grid(ex, grid, vocab=config.vocab_size, repeats=2, max_repeat_s=1.0)
    assert [s.name for s in samples] == [p.name for p in grid]
    for s in samples:
        assert s.step_s > 0 and 0 < s.forward_s <= s.step_s * 1.5  # medians of separate repeats
        assert 1 <= s.repeats <= 2


def test_profile_writes_hardware_and_profile_json(tiny_profile):
    out, result = tiny_profile
    profile = json.loads((out / "profile.json").read_text())
    assert profile["model"] == "tiny-llama"
    assert len(profile["samples"]) == len(profile_grid(quick=True, max_context=512))
    fit = profile["fit"]
    assert math.isfinite(fit["median_rel_error"])
    # loose: a shared 2-core machine is noisy and tiny-llama steps are pure dispatch overhead
    assert fit["median_rel_error"] < 1.0
    assert all(s["predicted_s"] > 0 for s in profile["samples"])


def test_fitted_preset_loads_back_through_get_gpu(tiny_profile):
    out, _ = tiny_profile
    hw = get_gpu(str(out / "hardware.json"))
    assert isinstance(hw, HardwareSpec) and hw.kind == "cpu"
    assert hw == HardwareSpec.from_dict(json.loads((out / "hardware.json").read_text()))
    assert get_gpu(out / "hardware.json") == hw  # a Path works too


def test_get_gpu_names_a_missing_hardware_file(tmp_path):
    with pytest.raises(ValueError, match="gpu: no such hardware file"):
        get_gpu(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="gpu: cannot read hardware file"):
        get_gpu(str(bad))


def test_simulate_config_accepts_the_fitted_preset(tiny_profile):
    out, _ = tiny_profile
    cfg = SimulateConfig(
        model="tiny-llama", gpu=str(out / "hardware.json"), workload="fixed:32:8", rate=math.inf,
        num_requests=8, kv_tokens=2048,
    )  # fmt: skip
    result = run_simulation(cfg, report=False)
    assert not result.run.unfinished
    assert result.summary["makespan_s"] > 0


def test_fit_on_synthetic_samples_recovers_a_known_spec():
    from kvbalance.perf.calibrate import cpu_base_spec, predict_samples
    from kvbalance.profile import StepSample

    truth = cpu_base_spec(num_cores=1).with_(compute_eff_max=0.3, memory_eff_max=0.4, step_overhead_s=4e-3)
    grid = profile_grid(quick=False, max_context=8192)
    times = predict_samples("smollm2-135m", truth, [(p.seqs, 1.0) for p in grid])
    samples = [
        StepSample(p.name, p.seqs, float(t), float(t), float(t), float(t), 1) for p, t in zip(grid, times)
    ]
    fit = fit_cpu_preset("smollm2-135m", samples, ("compute_eff_max", "memory_eff_max", "step_overhead_s"))
    assert fit.median_rel_error < 0.01
    assert fit.params["compute_eff_max"] == pytest.approx(0.3, rel=0.05)


def test_quick_profile_with_validation_reports_real_and_predicted(tmp_path):
    cfg = ProfileConfig.quick_config("tiny-llama", num_requests=4, max_output_tokens=8)
    result = run_profile(cfg, tmp_path, log=lambda _: None)
    v = json.loads((tmp_path / "validation.json").read_text())
    assert v == json.loads(json.dumps(result["validation"]))
    for side in ("real", "predicted"):
        assert v[side]["output_tokens"] == v["workload"]["output_tokens"]
        assert v[side]["output_tokens_per_s"] > 0 and v[side]["makespan_s"] > 0
    assert math.isfinite(v["throughput_rel_error"]) and math.isfinite(v["makespan_rel_error"])


def test_cli_profile_quick_no_validate(tmp_path, capsys):
    from kvbalance.cli import main

    assert main(["profile", "--model", "tiny-llama", "--quick", "--no-validate", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "hardware.json").is_file()
    assert "median |error|" in capsys.readouterr().out


def test_profile_config_names_bad_fields():
    with pytest.raises(ValueError, match="threads"):
        ProfileConfig(threads=0)
    with pytest.raises(ValueError, match="model"):
        ProfileConfig(model="no-such-model")
