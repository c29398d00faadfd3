"""Tile-aware corrections and the combination of repeated measurements (perf/correction.py): a GEMM correction
interpolates only within M's 128-row tile bucket (both sides of a boundary, one knot held, an empty bucket
falling back to every knot), leave-one-point-out follows the same rule, a repeated knot is the log mean kept
within 10% of every repeat (the minimax ratio where they spread further), and the rule travels in the preset
file (an old file without it keeps one interpolation over every knot). Hand-computed expectations."""

import json
import math

import numpy as np
import pytest

from kvbalance.perf.correction import (
    KNOT_BAND,
    ShapeCorrections,
    build_corrections,
    evaluate,
    knot_log_ratio,
    loo_point_log_ratio,
    tile_bucket,
)
from kvbalance.perf.fit_cv import CORRECTION_TILES
from kvbalance.perf.fit_floor import minimax_floor
from kvbalance.specs import HardwareSpec, ShapeCorrection, get_gpu


def _lin(m0, r0, m1, r1, m):
    """The log ratio linear in log M between (m0, r0) and (m1, r1), at m."""
    return r0 + (r1 - r0) * (math.log(m) - math.log(m0)) / (math.log(m1) - math.log(m0))


def _at(c: ShapeCorrection, tokens):
    """Both lookups (the simulator's scalar one and the vectorised one) at ``tokens``; they must agree."""
    vec = evaluate({"k": c}, ["k"] * len(tokens), np.array(tokens, dtype=float))
    corr = ShapeCorrections({"k": c}, {"op": "k"})
    scalar = [math.log(corr.factor("op", float(t))) for t in tokens]
    assert scalar == pytest.approx(list(vec), abs=1e-12)
    return list(vec)


def test_tile_bucket_is_ceil_of_m_over_the_tile():
    assert list(tile_bucket(np.array([0.5, 1, 127, 128, 129, 256, 257, 512, 520]), 128)) == [
        1, 1, 1, 1, 2, 2, 3, 4, 5
    ]  # fmt: skip


def test_knots_on_both_sides_of_a_tile_boundary_do_not_blend():
    c = ShapeCorrection((64, 120, 128, 136, 200), (0.0, 0.1, 0.2, 1.0, 1.2), tile_tokens=128)
    got = _at(c, [124, 130, 168, 64, 32])
    assert got == pytest.approx([
        _lin(120, 0.1, 128, 0.2, 124),  # inside tile 1, between its knots
        1.0,  # tile 2 starts at 136's knot: held, not blended with 128's
        _lin(136, 1.0, 200, 1.2, 168),
        0.0,
        0.0,  # below tile 1's first knot: held
    ])  # fmt: skip
    # without a tile (every preset written before the field): 130 blends 128 and 136
    assert _at(ShapeCorrection(c.tokens, c.log_ratio), [130])[0] == pytest.approx(
        _lin(128, 0.2, 136, 1.0, 130)
    )


def test_one_knot_in_a_bucket_is_held_and_an_empty_bucket_falls_back_to_every_knot():
    c = ShapeCorrection((100, 300, 520), (0.0, 0.5, 1.0), tile_tokens=128)
    got = _at(c, [260, 383, 450, 2000, 1, 129])
    assert got == pytest.approx([
        0.5,  # tile 3 (257-384) has 300 only
        0.5,
        _lin(300, 0.5, 520, 1.0, 450),  # tile 4 (385-512) has none: across the tiles, as without one
        1.0,  # past the last knot (tile 16 empty): the end holds
        0.0,  # tile 1 has 100
        _lin(100, 0.0, 300, 0.5, 129),  # tile 2 (129-256) empty
    ])  # fmt: skip


def test_leave_one_point_out_follows_the_tile_rule():
    tokens = np.array([120, 128, 136, 200, 300, 520], dtype=float)
    lr = np.array([0.1, 0.2, 1.0, 1.2, 0.5, 0.9])
    keys = ["gemm:4096x4096:16b:tp1"] * len(tokens)
    got = loo_point_log_ratio(keys, tokens, lr, {"gemm": 128})
    assert got == pytest.approx([
        0.2,  # 120 from 128 (its tile), not 136
        0.1,  # 128 from 120
        1.2,  # 136 from 200
        1.0,  # 200 from 136
        _lin(200, 1.2, 520, 0.9, 300),  # alone in tile 3: its neighbours across the tiles
        0.5,  # the end, alone in tile 5: its neighbour
    ])  # fmt: skip
    # the same as evaluating the table built without each point
    for j in range(len(tokens)):
        rest = np.arange(len(tokens)) != j
        table = build_corrections([keys[0]] * 5, tokens[rest], lr[rest], {"gemm": 128})
        assert evaluate(table, keys[:1], tokens[j : j + 1])[0] == pytest.approx(got[j])
    # an untiled class (element-wise here) keeps the old rule: 128 between 120 and 136
    plain = loo_point_log_ratio(["norm:4096:16b:tp1"] * len(tokens), tokens, lr, {"gemm": 128})
    assert plain[1] == pytest.approx(_lin(120, 0.1, 136, 1.0, 128))


def test_repeated_knots_keep_their_log_mean_within_the_band_else_the_minimax_ratio():
    def knot(ratios, band=KNOT_BAND):
        lr = np.log(ratios)
        return math.exp(knot_log_ratio(lr.min(), lr.max(), lr.mean(), band))

    assert KNOT_BAND == 0.10
    # 1, 1, 2 (the residual add's 1, 1, 2 us): floor 1/3 > 10%, the minimax ratio 4/3, worst error = the floor
    p = knot([1.0, 1.0, 2.0])
    assert p == pytest.approx(4.0 / 3.0)
    assert max(abs(p / t - 1) for t in (1.0, 1.0, 2.0)) == pytest.approx(minimax_floor([1.0, 1.0, 2.0]))
    # nine 1s and a 1.2: floor 0.2 / 2.2 < 10%; the log mean 1.2^0.1 = 1.018 is 15% from 1.2, so it moves to
    # the band's edge 1.2 (1 - 0.1) = 1.08 (10% from 1.2, 8% from 1)
    assert knot([1.0] * 9 + [1.2]) == pytest.approx(1.08)
    # close repeats keep the log mean; band 0 is the minimax ratio everywhere
    assert knot([1.0, 1.05]) == pytest.approx(math.sqrt(1.05))
    assert knot([1.0, 1.05], band=0.0) == pytest.approx(2 * 1.05 / 2.05)
    assert knot([1.3]) == pytest.approx(1.3)
    # the fitter stores it: 2 us, 1 us, 2 us over a physical 1 us at one M -> 2 * 2 * 1 / 3
    table = build_corrections(["k"] * 4, np.array([8.0, 8.0, 8.0, 16.0]), np.log([2.0, 1.0, 2.0, 1.5]))
    assert np.exp(table["k"].log_ratio) == pytest.approx([4.0 / 3.0, 1.5], rel=1e-5)


def test_the_tile_rule_travels_in_the_preset_and_an_old_preset_keeps_the_old_rule(tmp_path):
    base = get_gpu("h100-sxm")
    tiled = ShapeCorrection((120, 136), (0.0, 1.0), tile_tokens=128)
    hw = base.with_(
        name="t", shape_corrections={"gemm:k": tiled, "norm:k": ShapeCorrection((1, 8), (0.0, 0.1))}
    )
    path = tmp_path / "t.json"
    hw.save(path)
    data = json.loads(path.read_text())
    assert data["shape_corrections"]["gemm:k"]["tile_tokens"] == 128
    assert "tile_tokens" not in data["shape_corrections"]["norm:k"]  # untiled: the old format exactly
    back = get_gpu(str(path))
    assert back.shape_corrections == hw.shape_corrections
    # an old preset file (no tile_tokens) loads with one interpolation over every knot
    del data["shape_corrections"]["gemm:k"]["tile_tokens"]
    old = HardwareSpec.from_dict(data)
    assert old.shape_corrections["gemm:k"].tile_tokens == 0
    assert evaluate(old.shape_corrections, ["gemm:k"], np.array([128.0]))[0] == pytest.approx(
        _lin(120, 0.0, 136, 1.0, 128)
    )
    assert evaluate(back.shape_corrections, ["gemm:k"], np.array([128.0]))[0] == pytest.approx(0.0)


def test_the_committed_presets_tile_their_gemm_corrections_only():
    assert CORRECTION_TILES == {"gemm": 128}
    for name in ("h100-sxm", "a40"):
        corr = get_gpu(name).shape_corrections
        assert corr
        for key, c in corr.items():
            assert c.tile_tokens == (128 if key.startswith("gemm:") else 0), key


def test_bad_tile_names_the_field():
    for bad in (-1, 1.5, "128"):
        with pytest.raises(ValueError, match="^tile_tokens: must be an integer >= 0"):
            ShapeCorrection((1,), (0.0,), tile_tokens=bad)
    d = get_gpu("a40").to_dict()
    d["shape_corrections"] = {"k": {"tokens": [1], "log_ratio": [0.0], "tile_tokens": -128}}
    with pytest.raises(ValueError, match="^shape_corrections: tile_tokens"):
        HardwareSpec.from_dict(d)
