"""Measured-shape corrections of the GPU cost model (perf/correction.py, perf/fit_cv.py): a corrected preset
reproduces a profiled point's measured time for a profiled shape on its GPU, is the physical model exactly
elsewhere (other GPUs, other shapes, attention), round-trips through ``--gpu PATH``; the cross-validation
predicts each point from its neighbours only (exact formulas on small tables)."""

import dataclasses
import math

import numpy as np
import pytest

from kvbalance.perf.correction import (
    ShapeCorrections,
    build_corrections,
    evaluate,
    log_ratio_at,
    loo_group_log_ratio,
    loo_point_log_ratio,
)
from kvbalance.perf.cost import CostModel
from kvbalance.perf.fit_cv import fit_corrections, loo_model_refit, sample_keys
from kvbalance.perf.fit_gpu import predict_operator_samples
from kvbalance.perf.profiles import VIDUR_OPS, OperatorSample, ProfileShape
from kvbalance.specs import HardwareSpec, ShapeCorrection, get_gpu

SHAPE = ProfileShape("gated-7b", 32, 32, 4096, 11008, 32000, True)
TOKENS = (1, 2, 4, 8, 16, 64, 256, 504, 512, 520, 1024, 2048)
STEP = 2.8  # the H100's down-projection jumps 2.8x past M = 512 (a cuBLAS kernel switch)
PHYS = get_gpu("h100-sxm").with_(name="phys", shape_corrections={})


def _measured():
    """Profiles of SHAPE at tp 1: the physical model's time, with a kernel switch in mlp_down past M=512 and a
    20% slower rotary everywhere."""
    samples = [
        OperatorSample("synth", SHAPE, op, prof, n, 1, 1.0)
        for n in TOKENS
        for prof, op in VIDUR_OPS.items()
        if prof != "post_attention_layernorm"
    ]
    phys = predict_operator_samples(samples, PHYS)
    scale = [
        STEP if (s.op == "mlp_down" and s.num_tokens > 512) else 1.2 if s.op == "rope" else 1.0
        for s in samples
    ]
    meas = [dataclasses.replace(s, time_s=float(p * f)) for s, p, f in zip(samples, phys, scale)]
    return meas, phys


@pytest.fixture(scope="module")
def corrected():
    meas, phys = _measured()
    fit = fit_corrections(meas, phys, PHYS)
    return PHYS.with_(name="corrected", shape_corrections=fit.corrections), meas, fit


def test_correction_reproduces_profiled_points_on_its_gpu(corrected):
    hw, meas, _ = corrected
    cm = CostModel(SHAPE.model_spec(), hw, 1)
    L = cm.model.num_layers
    for s in meas:
        if s.op in ("mlp_down", "rope", "o_proj"):
            t = cm.op_times([(s.num_tokens, s.num_tokens, False)])[s.op].time_s / L
            assert t == pytest.approx(s.time_s, rel=1e-5), (s.op, s.num_tokens)
    assert predict_operator_samples(meas, hw) == pytest.approx([s.time_s for s in meas], rel=1e-5)
    # the step pays the measured kernel: the switch adds (STEP - 1) x the physical down-projection
    phys_cm = CostModel(SHAPE.model_spec(), PHYS, 1)
    for n, f in ((512, 1.0), (1024, STEP)):
        seqs = [(n, n, False)]
        down = phys_cm.op_times(seqs)["mlp_down"].time_s
        rope = phys_cm.op_times(seqs)["rope"].time_s
        extra = cm.step_seconds(seqs) - phys_cm.step_seconds(seqs)
        assert extra == pytest.approx((f - 1) * down + 0.2 * rope, rel=1e-4)


def test_between_profiled_token_counts_the_log_ratio_is_linear_in_log_m(corrected):
    hw, _, _ = corrected
    cm, phys = CostModel(SHAPE.model_spec(), hw, 1), CostModel(SHAPE.model_spec(), PHYS, 1)

    def ratio(model, n):
        return (
            model.op_times([(n, n, False)])["mlp_down"].time_s
            / phys.op_times([(n, n, False)])["mlp_down"].time_s
        )

    # GEMM corrections interpolate within 128-row tiles: M = 516 is in 520's tile (513-640), which holds it
    assert hw.shape_corrections[cm.kernel_keys()["mlp_down"]].tile_tokens == 128
    assert ratio(cm, 516) == pytest.approx(STEP, rel=1e-5)
    assert ratio(cm, 508) == pytest.approx(1.0, rel=1e-5)  # between 504 and 512 (tile 385-512)
    # the same corrections without a tile (a preset written before the field): M = 516 lies halfway (in log M,
    # nearly) between 512 (ratio 1) and 520 (ratio 2.8)
    untiled = {k: dataclasses.replace(c, tile_tokens=0) for k, c in hw.shape_corrections.items()}
    old = CostModel(SHAPE.model_spec(), hw.with_(shape_corrections=untiled), 1)
    w = (math.log(516) - math.log(512)) / (math.log(520) - math.log(512))
    assert ratio(old, 516) == pytest.approx(math.exp(w * math.log(STEP)), rel=1e-5)
    # beyond the profiled range the end values hold
    for n, f in ((8192, STEP), (1, 1.0)):
        assert ratio(cm, n) == pytest.approx(f)


def test_no_correction_elsewhere_is_the_physical_model_exactly(corrected):
    hw, _, _ = corrected
    steps = [[(1, 700, True)] * 32, [(2048, 2048, True)], [(1, 300, True)] * 8 + [(512, 1024, False)]]
    # other shapes on the corrected GPU (llama-2-13b; the same model at tp 2) and other GPUs
    for model, tp, gpu in (
        ("llama-2-13b", 1, hw),
        (SHAPE.model_spec(), 2, hw),
        (SHAPE.model_spec(), 1, "h200"),
    ):
        base = PHYS if gpu is hw else gpu
        assert [CostModel(model, gpu, tp).step_seconds(s) for s in steps] == [
            CostModel(model, base, tp).step_seconds(s) for s in steps
        ]
    # attention and the KV write are never corrected, on a profiled shape either
    cm, phys = CostModel(SHAPE.model_spec(), hw, 1), CostModel(SHAPE.model_spec(), PHYS, 1)
    mixed = [(1, 700, True)] * 4 + [(512, 1024, True)]
    for name in ("attn_prefill", "attn_decode", "kv_write", "lm_head"):
        assert cm.op_times(mixed)[name] == phys.op_times(mixed)[name], name
    assert cm.kernel_keys()["kv_write"] is None


def test_presets_carry_corrections_only_on_their_own_gpu():
    assert get_gpu("h100-sxm").shape_corrections and get_gpu("a40").shape_corrections
    for name in ("h200", "a100-40gb", "a100-80gb", "l40s"):
        assert get_gpu(name).shape_corrections == {}, name


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_preset_with_corrections_round_trips_through_gpu_path(corrected, tmp_path, suffix):
    hw, meas, _ = corrected
    path = tmp_path / f"fit{suffix}"
    hw.save(path)
    loaded = get_gpu(str(path))
    assert loaded == hw and loaded.shape_corrections == hw.shape_corrections
    steps = [[(1, 700, True)] * 32, [(1024, 1024, True)], [(1, 300, True)] * 8 + [(600, 1024, False)]]
    assert [CostModel(SHAPE.model_spec(), str(path)).step_seconds(s) for s in steps] == [
        CostModel(SHAPE.model_spec(), hw).step_seconds(s) for s in steps
    ]


def test_step_and_op_times_agree_with_corrections(corrected):
    hw, _, _ = corrected
    cm = CostModel(SHAPE.model_spec(), hw, engine="hardware")  # the spec's host terms, paid serially
    for seqs in (
        [(8, 8, True)],
        [(1, 100, True)] * 16,
        [(600, 600, True)],
        [(1, 50, True)] * 3 + [(900, 900, False)],
    ):
        b = cm.step(seqs)
        assert b.compute_s + b.memory_s + b.overhead_s == pytest.approx(
            sum(t.time_s for t in cm.op_times(seqs).values())
            + cm.host_overhead_s(len(seqs), sum(n for n, _, _ in seqs))
        )
        assert b.flops == pytest.approx(sum(t.flops for t in cm.op_times(seqs).values()))


def test_leave_one_point_out_predicts_from_the_neighbours_only():
    keys = ["a"] * 5 + ["b", "b", "c"]
    tokens = np.array([1, 2, 4, 8, 4, 16, 32, 64], dtype=float)
    # shape a: M=4 measured twice (log ratios 2 and 2.1, within 10% of each other: the knot is their mean)
    lr = np.array([0.0, 1.0, 2.0, 3.0, 2.1, 0.5, -0.5, 7.0])
    got = loo_point_log_ratio(keys, tokens, lr)
    w = (math.log(4) - math.log(2)) / (math.log(8) - math.log(2))
    expect = [1.0, 0.0 + (2.05 - 0.0) * (math.log(2) / math.log(4)), 1.0 + (3.0 - 1.0) * w, 2.05, 1.0 + 2.0 * w,
              -0.5, 0.5, 0.0]  # fmt: skip
    assert got == pytest.approx(expect)
    table = build_corrections(keys, tokens, lr)
    assert table["a"] == ShapeCorrection((1, 2, 4, 8), (0.0, 1.0, 2.05, 3.0))
    assert evaluate(table, keys, tokens) == pytest.approx([0, 1, 2.05, 3, 2.05, 0.5, -0.5, 7])
    assert evaluate(table, [None, "zz"], np.array([4.0, 4.0])) == pytest.approx([0, 0])


def test_leave_one_model_out_uses_only_other_models():
    keys = ["s", "s", "s", "s", "only-b"]
    tokens = np.array([8, 16, 8, 16, 8], dtype=float)
    lr = np.array([0.1, 0.2, 0.5, 0.7, 0.9])
    models = ["a", "a", "b", "b", "b"]
    assert loo_group_log_ratio(keys, tokens, lr, models) == pytest.approx([0.5, 0.7, 0.1, 0.2, 0.0])


def test_scalar_lookup_matches_the_vectorised_one():
    c = ShapeCorrection((1, 8, 512, 520, 4096), (0.0, -0.1, 0.0, 1.03, 0.2))
    corr = ShapeCorrections({"k": c}, {"mlp_down": "k", "o_proj": None, "rope": "missing"})
    assert corr.has("mlp_down") and not corr.has("o_proj") and not corr.has("rope")
    for t in (0.5, 1, 3, 8, 300, 516, 519.9, 2000, 9000):
        expect = evaluate({"k": c}, ["k"], np.array([t]))[0]
        assert math.log(corr.factor("mlp_down", t)) == pytest.approx(expect, abs=1e-12)
        assert corr.factor("rope", t) == 1.0
    x = [math.log(t) for t in c.tokens]
    assert log_ratio_at(x, c.log_ratio, math.log(516)) == pytest.approx(
        1.03 * math.log(516 / 512) / math.log(520 / 512)
    )


def test_bad_corrections_name_the_field():
    with pytest.raises(ValueError, match="^tokens, log_ratio"):
        ShapeCorrection((1, 2), (0.0,))
    with pytest.raises(ValueError, match="^tokens: must be >= 1 and strictly ascending"):
        ShapeCorrection((4, 2), (0.0, 0.0))
    with pytest.raises(ValueError, match="^log_ratio"):
        ShapeCorrection((1,), (float("nan"),))
    d = PHYS.to_dict()
    d["shape_corrections"] = {"k": {"tokens": [1], "ratio": [0]}}
    with pytest.raises(ValueError, match="^shape_corrections"):
        HardwareSpec.from_dict(d)
    d["shape_corrections"] = {"k": {"tokens": [2, 1], "log_ratio": [0, 0]}}
    with pytest.raises(ValueError, match="^shape_corrections: tokens"):
        HardwareSpec.from_dict(d)


def test_leave_one_model_out_with_refit_fits_without_the_held_out_model():
    """Two models with the same shapes: each is predicted by the physical curves refitted on the other alone,
    times the other's corrections (measured against that refit), so it gets the other's measured times."""
    meas, _ = _measured()
    twin = ProfileShape("twin-7b", *dataclasses.astuple(SHAPE)[1:])
    both = meas + [dataclasses.replace(s, shape=twin, time_s=s.time_s * 1.1) for s in meas]
    both.append(
        OperatorSample("synth", twin, "mlp_up", "mlp_up_proj", 1024, 2, 1e-3)
    )  # a shape only the twin has
    seen = []

    def refit(base, samples):
        models = {s.shape.model for s in samples}
        seen.append(models)
        return base.with_(compute_eff_max=0.5 if models == {"gated-7b"} else 0.6)

    keys = sample_keys(both, PHYS)
    got = loo_model_refit(both, PHYS, keys, refit)
    assert seen == [{"twin-7b"}, {"gated-7b"}]
    # the twin's profiled times are 1.1x: each model gets the other's measured times
    expect = [s.time_s * 1.1 for s in meas] + [s.time_s for s in meas]
    assert got[:-1] == pytest.approx(expect, rel=1e-5)
    # a shape the other model never ran: the refitted physical model alone
    refitted = predict_operator_samples(both[-1:], PHYS.with_(compute_eff_max=0.5))
    assert got[-1] == pytest.approx(refitted[0], rel=1e-12) and refitted[0] != pytest.approx(
        predict_operator_samples(both[-1:], PHYS)[0]
    )
