"""GPU calibration (``kvbalance calibrate``): the fitter recovers known parameters from profiles the cost model
itself generates, a fitted preset file loads through ``--gpu PATH`` and reproduces its step times, the readers
reject malformed profiles, and the committed presets match the measured profiles where those are present."""

import csv
import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from kvbalance.cli import main
from kvbalance.perf.cost import CostModel, curve_eff
from kvbalance.perf.fit_gpu import fit_gpu, op_class, operator_errors, predict_operator_samples
from kvbalance.perf.profiles import (
    HOST_PARTS,
    VIDUR_OPS,
    AllReduceSample,
    HostSample,
    OperatorSample,
    ProfileShape,
    load_allreduce_samples,
    load_host_samples,
    load_operator_samples,
)
from kvbalance.specs import LinkSpec, MemoryCurve, get_gpu

PROFILES = Path(
    os.environ.get("KVBALANCE_PROFILES") or Path(__file__).resolve().parents[1].parent / "shared" / "profiles"
)
needs_profiles = pytest.mark.skipif(
    not (PROFILES / "vidur" / "compute").is_dir(), reason=f"measured profiles not found at {PROFILES}"
)

SHAPES = (
    ProfileShape("gated-7b", 32, 32, 4096, 11008, 32000, True),
    ProfileShape("plain-3b", 32, 32, 2560, 10240, 51200, False),
)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 136, 192, 200, 256, 270, 384, 400, 512, 700, 1024, 2048, 4096)
TRUTH = get_gpu("h100-sxm").with_(
    name="truth",
    shape_corrections={},  # the physical model only: the fitter must recover its parameters
    compute_eff_max=0.7,
    compute_half_tokens=100.0,
    memory_eff_max=0.85,
    memory_half_bytes=0.0,
    per_layer_overhead_s=0.0,
    kernel_latency_s=5e-6,
    step_overhead_s=8e-4,
    host_overhead_per_seq_s=6e-5,
    host_overhead_tp_s=5e-3,
    host_overhead_tp_per_seq_s=4e-5,
    host_overhead_per_tp_rank_s=7e-4,
    tp_link=LinkSpec("nvlink4-fitted", 300e9, 2e-5),
    elementwise_curves={
        "embedding": MemoryCurve(
            0.2, 40.0, 2e-6, 0.05, small_tokens=16, small_latency_s=1.4e-6, small_per_token_s=6e-7
        ),  # fmt: skip
        "norm": MemoryCurve(0.3, 150.0, 2.5e-6, 0.3),
        "layer_norm": MemoryCurve(0.4, 300.0, 3e-6, 0.5),
        "rope": MemoryCurve(0.45, 120.0, 1.5e-6, 0.1),
        "activation": MemoryCurve(0.6, 100.0, 1e-6, -0.1, wave_weight=0.5),
        "activation_ungated": MemoryCurve(0.7, 20.0, 1e-6, 0.2),
        "residual_add": MemoryCurve(0.8, 2.0, 1.5e-6, 0.6, l2_bytes_scale=0.8, l2_sharpness=4.0),
    },
)


def synthetic_ops(hw=TRUTH):
    samples = []
    for shape in SHAPES:
        for tp in (1, 2, 4) if shape.gated_mlp else (1,):
            for n in TOKENS:
                for prof_op, op in VIDUR_OPS.items():
                    if prof_op == "post_attention_layernorm" and not shape.gated_mlp:
                        continue  # parallel attention + MLP (phi-2): one norm per layer
                    samples.append(OperatorSample("synth", shape, op, prof_op, n, tp, 1.0))
    times = predict_operator_samples(samples, hw)
    return [dataclasses.replace(s, time_s=float(t)) for s, t in zip(samples, times)]


def synthetic_host(hw=TRUTH):
    return [
        HostSample("m", b, tp, hw.host_overhead_s(b, b, tp))
        for b in (8, 16, 32, 64, 128)
        for tp in (1, 2, 4, 8)
    ]


def synthetic_allreduce(link=TRUTH.tp_link):
    out = []
    for n in (2, 4, 8):
        for size in (2048, 65536, 1 << 20, 8 << 20, 64 << 20):
            t = 2 * (n - 1) / n * size / link.bandwidth_bytes_s + link.latency_s
            out.append(AllReduceSample("synth", n, size, t))
    return out


@pytest.fixture(scope="module")
def synthetic_fit():
    base = get_gpu("h100-sxm")
    return fit_gpu(base, synthetic_ops(), synthetic_host(), synthetic_allreduce())


def test_fitter_recovers_known_parameters_from_synthetic_profiles(synthetic_fit):
    hw = synthetic_fit.hardware
    for f in ("compute_eff_max", "compute_half_tokens", "memory_eff_max", "kernel_latency_s", "step_overhead_s",
              "host_overhead_per_seq_s", "host_overhead_tp_s", "host_overhead_tp_per_seq_s",
              "host_overhead_per_tp_rank_s"):  # fmt: skip
        assert getattr(hw, f) == pytest.approx(getattr(TRUTH, f), rel=0.01), f
    assert hw.tp_link.bandwidth_bytes_s == pytest.approx(300e9, rel=0.01)
    assert hw.tp_link.latency_s == pytest.approx(2e-5, rel=0.01)
    assert set(hw.elementwise_curves) == set(TRUTH.elementwise_curves)
    for cls, truth in TRUTH.elementwise_curves.items():
        got = hw.elementwise_curves[cls]
        for f in ("eff", "sat_tokens", "latency_s", "l2_eff_gain", "small_tokens", "small_latency_s",
                  "small_per_token_s", "wave_weight", "l2_bytes_scale", "l2_sharpness"):  # fmt: skip
            tol = 1e-6 if f == "wave_weight" else 1e-9  # dimensionless, 0 in most classes
            assert getattr(got, f) == pytest.approx(getattr(truth, f), rel=0.01, abs=tol), (cls, f)
    assert all(
        e.worst < 1e-3 for e in synthetic_fit.errors + synthetic_fit.host_errors + synthetic_fit.link_errors
    )
    # peaks stay the datasheet's; the source says what the fit saw
    assert hw.peak_flops == 989e12 and hw.mem_bandwidth_bytes_s == 3.35e12
    assert "fitted by kvbalance calibrate" in hw.source and "all-reduces" in hw.source


def test_fitted_preset_file_loads_through_gpu_path_and_reproduces_step_times(synthetic_fit, tmp_path):
    path = tmp_path / "h100-fit.json"
    synthetic_fit.hardware.save(path)
    loaded = get_gpu(str(path))
    assert loaded == synthetic_fit.hardware
    assert predict_operator_samples(synthetic_fit.samples, loaded) == pytest.approx(synthetic_fit.predicted_s)
    steps = [[(1, 700, True)] * 32, [(2048, 2048, True)], [(1, 300, True)] * 8 + [(512, 1024, False)]]
    for tp in (1, 2):
        fitted = CostModel("llama-2-13b", synthetic_fit.hardware, tp)
        from_file = CostModel("llama-2-13b", str(path), tp)
        assert [from_file.step_seconds(s) for s in steps] == [fitted.step_seconds(s) for s in steps]


def test_host_overhead_grows_with_the_batch(synthetic_fit):
    cm = CostModel("llama-2-7b", synthetic_fit.hardware, engine="hardware")  # the spec's host terms, serial
    small, large = cm.step([(1, 500, True)]), cm.step([(1, 500, True)] * 64)
    lat_small = sum(t.latency_s for t in cm.op_times([(1, 500, True)]).values())
    lat_large = sum(t.latency_s for t in cm.op_times([(1, 500, True)] * 64).values())
    per_seq = synthetic_fit.hardware.host_overhead_per_seq_s
    assert (large.overhead_s - lat_large) - (small.overhead_s - lat_small) == pytest.approx(63 * per_seq)
    assert cm.host_overhead_s(64, 64) == pytest.approx(cm.overhead_s + 64 * per_seq)
    hw = synthetic_fit.hardware
    for tp in (2, 4):
        cm_tp = CostModel("llama-2-7b", hw, tp=tp, engine="hardware")
        tp_extra = hw.host_overhead_tp_s + hw.host_overhead_per_tp_rank_s * (tp - 1)
        assert cm_tp.overhead_s == pytest.approx(cm.overhead_s + tp_extra)
        assert cm_tp.host_overhead_s(64, 64) == pytest.approx(
            cm_tp.overhead_s + 64 * (per_seq + hw.host_overhead_tp_per_seq_s)
        )


def test_small_token_path_of_an_elementwise_class(synthetic_fit):
    """At or below small_tokens the embedding costs small_latency_s + small_per_token_s * T (booked as latency
    and memory time), above it the curve; step() and op_times() agree."""
    hw = synthetic_fit.hardware
    c = hw.elementwise_curves["embedding"]
    cm = CostModel("llama-2-7b", hw, engine="hardware")  # the spec's host terms, paid serially
    for t in (1, 8, 16):
        op = cm.op_times([(t, t, False)])["embedding"]
        assert op.memory_s == pytest.approx(c.small_per_token_s * t) and op.latency_s == c.small_latency_s
        assert op.time_s == pytest.approx(1.4e-6 + 6e-7 * t, rel=0.01)
    above = cm.op_times([(24, 24, False)])["embedding"]
    curve_s = (
        above.bytes * max(24, c.sat_tokens) / (24 * hw.mem_bandwidth_bytes_s * curve_eff(c, above.bytes, hw))
    )
    assert above.latency_s == c.latency_s and above.memory_s == pytest.approx(curve_s)
    assert above.time_s < op.time_s  # the step down past the small path, as in the measured embedding
    for seqs in ([(8, 8, True)], [(1, 100, True)] * 16, [(24, 24, True)]):
        b = cm.step(seqs)
        assert b.compute_s + b.memory_s + b.overhead_s == pytest.approx(
            sum(t.time_s for t in cm.op_times(seqs).values())
            + cm.host_overhead_s(len(seqs), sum(n for n, _, _ in seqs))
        )


def _write_vidur(root: Path) -> None:
    """The synthetic samples in Vidur's CSV layout (ms), for the command line end to end."""
    ops = synthetic_ops()
    rows: dict[tuple, dict] = {}
    for s in ops:
        key = (s.shape, s.num_tokens, s.tp)
        row = rows.setdefault(key, {"n_head": s.shape.num_heads, "n_kv_head": s.shape.num_kv_heads,
                                    "n_embd": s.shape.hidden_size, "n_expanded_embd": s.shape.intermediate_size,
                                    "vocab_size": s.shape.vocab_size, "use_gated_mlp": s.shape.gated_mlp,
                                    "num_tokens": s.num_tokens, "num_tensor_parallel_workers": s.tp})  # fmt: skip
        row[f"time_stats.{s.profile_op}.median"] = s.time_s * 1e3
    for shape in SHAPES:
        d = root / "vidur" / "compute" / "synth" / "org" / shape.model
        d.mkdir(parents=True)
        mine = [r for (sh, _, _), r in rows.items() if sh == shape]
        cols = sorted({c for r in mine for c in r})
        with (d / "mlp.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, cols)
            w.writeheader()
            w.writerows(mine)
    d = root / "vidur" / "cpu_overheads" / "synth"
    d.mkdir(parents=True)
    with (d / "cpu_overheads.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["", *(f"{p}_median" for p in HOST_PARTS), "model_name", "batch_size", "tensor_parallel_degree"]
        )
        for i, s in enumerate(synthetic_host()):
            w.writerow(
                [i, *([s.time_s * 1e3 / len(HOST_PARTS)] * len(HOST_PARTS)), s.model, s.batch_size, s.tp]
            )
    d = root / "vidur" / "network" / "synth_net"
    d.mkdir(parents=True)
    with (d / "all_reduce.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["", "time_stats.all_reduce.median", "num_workers", "size"])
        for i, s in enumerate(synthetic_allreduce()):
            w.writerow([i, s.time_s * 1e3, s.num_workers, s.size_bytes])


def _calibrate_synthetic(tmp_path, *extra):
    _write_vidur(tmp_path / "profiles")
    out = tmp_path / "fit.json"
    argv = ["calibrate", "--profiles", str(tmp_path / "profiles"), "--gpu", "h100-sxm", "--compute", "synth",
            "--network", "synth_net", "--host", "synth", "--out", str(out), "--report", str(tmp_path / "rep")]  # fmt: skip
    assert main([*argv, *extra]) == 0
    return get_gpu(str(out))


def test_calibrate_command_writes_a_preset_and_a_report(tmp_path, capsys):
    hw = _calibrate_synthetic(tmp_path, "--no-plots")
    text = capsys.readouterr().out
    assert "gemm" in text and "median" in text and "1-16" in text and "all-reduce x8" in text
    # synthetic: nothing to correct, every scoring passes
    assert "(2a) corrected, leave-one-point-out along M: raw PASS, resolution-aware PASS" in text
    assert "FAIL" not in text
    assert hw.compute_eff_max == pytest.approx(0.7, rel=0.01)
    assert hw.kernel_latency_s == pytest.approx(5e-6, rel=0.01)
    assert (tmp_path / "rep" / "errors.json").stat().st_size > 0
    assert not (tmp_path / "rep" / "scatter.png").exists()
    with (tmp_path / "rep" / "points.csv").open() as f:
        assert sum(1 for _ in f) == len(synthetic_ops()) + 1


@pytest.mark.slow  # matplotlib's log-axis layout takes tens of seconds on a busy 2-core machine
def test_calibrate_report_plots_every_class(tmp_path):
    _calibrate_synthetic(tmp_path)
    for name in ("scatter.png", "residuals.png", "cv_residuals.png"):
        assert (tmp_path / "rep" / name).stat().st_size > 10_000


def test_bad_profiles_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="^profiles: no compute profiles for gpu 'h100'"):
        load_operator_samples(tmp_path, "h100")
    with pytest.raises(ValueError, match="^profiles: no host-overhead profile"):
        load_host_samples(tmp_path)
    with pytest.raises(ValueError, match="^profiles: no all-reduce profile"):
        load_allreduce_samples(tmp_path)
    d = tmp_path / "vidur" / "compute" / "x" / "o" / "m"
    d.mkdir(parents=True)
    (d / "mlp.csv").write_text("n_head,num_tokens\n32,1\n")
    with pytest.raises(ValueError, match="^n_kv_head: missing"):
        load_operator_samples(tmp_path, "x")
    assert (
        main(["calibrate", "--profiles", str(tmp_path), "--gpu", "nope", "--out", str(tmp_path / "o.json")])
        == 2
    )


@needs_profiles
@pytest.mark.parametrize("gpu, folder", [("h100-sxm", "h100"), ("a40", "a40")])
def test_committed_presets_match_the_measured_profiles(gpu, folder):
    """The shipped fits, on every 7th training sample: the physical model's median error under 10% per
    operator class; with the measured corrections, the measured times (a point whose shape and token count was
    measured once exactly: the median under 1%)."""
    ops = load_operator_samples(PROFILES, folder)[::7]
    hw = get_gpu(gpu)
    meas = np.array([s.time_s for s in ops])
    corrected = predict_operator_samples(ops, hw)
    assert hw.shape_corrections and np.median(np.abs(corrected / meas - 1)) < 0.01
    errors = operator_errors(ops, predict_operator_samples(ops, hw, physical=True))
    totals = {e.op_class: e for e in errors if e.tokens == "all"}
    assert set(totals) == {op_class(s) for s in ops} and "gemm" in totals
    for cls, e in totals.items():
        assert e.median < 0.10, (gpu, cls, e.median)
    assert np.isfinite([e.worst for e in errors]).all()
