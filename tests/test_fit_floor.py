"""What the profiles can resolve (perf/fit_floor.py) and the check per scoring (perf/fit_check.py): the
minimax floor of repeated measurements, the timer quantum inferred from the readings, the resolution-aware
error, the repeats' min/max/std read from a CSV, and the check's verdicts; all against hand-computed values."""

import csv
from types import SimpleNamespace

import numpy as np
import pytest

from kvbalance.perf.fit_check import FitCheck, Scoring, check_lines, fit_check
from kvbalance.perf.fit_check import summary as check_summary
from kvbalance.perf.fit_errors import ClassError, operator_errors
from kvbalance.perf.fit_floor import (
    class_floors,
    duplicate_groups,
    inside_repeats,
    low_quanta,
    minimax_floor,
    minimax_prediction,
    point_floors,
    resolution_error,
    timer_quantum_s,
)
from kvbalance.perf.profiles import OperatorSample, ProfileShape, load_operator_samples
from kvbalance.specs import get_gpu


def sample(t_us, lo_us=None, hi_us=None, tokens=1, tp=1, model="m"):
    # readings pass through ms, as the loader reads them (float noise included)
    lo, hi = (None if v is None else float(f"{v / 1000:.4f}") * 1e-3 for v in (lo_us, hi_us))
    shape = ProfileShape(model, 32, 32, 4096, 11008, 32000, True)
    return OperatorSample("g", shape, "residual_add", "add", tokens, tp, t_us * 1e-6, lo, hi)


def test_minimax_floor_of_one_kernel_measured_1_1_2():
    t = [1e-6, 1e-6, 2e-6]
    assert minimax_floor(t) == pytest.approx(1 / 3)
    p = minimax_prediction(t)
    assert p == pytest.approx(4 / 3 * 1e-6)
    # at p both extremes are missed by exactly the floor; any other p misses one of them by more
    assert p / 1e-6 - 1 == pytest.approx(1 / 3) and 1 - p / 2e-6 == pytest.approx(1 / 3)
    for other in (1.3e-6, 1.37e-6):
        assert max(abs(other / x - 1) for x in t) > 1 / 3
    assert minimax_floor([188.5e-6, 263e-6]) == pytest.approx(74.5 / 451.5)
    # resolution-aware: each bound widened by q/2 -> max(0, (t_max - t_min - q) / (t_max + t_min))
    assert minimax_floor(t, 1e-6) == 0.0
    assert minimax_floor([1e-6, 1.5e-6], 1e-6) == 0.0  # within a quantum: no floor (never negative)
    assert minimax_floor([1e-6, 3e-6], 1e-6) == pytest.approx(0.25)


def test_groups_are_one_kernel_at_one_token_count_and_degree_profiled_twice_or_more():
    s = [
        sample(1),
        sample(1, model="n"),
        sample(2, model="o"),
        sample(5, tokens=2),
        sample(6, tp=2),
        sample(7),
    ]
    keys = ["a", "a", "a", "a", "a", None]
    assert duplicate_groups(s, keys) == [[0, 1, 2]]  # M=2, tp=2: measured once; no key: in no group
    assert duplicate_groups(s[3:5], keys[3:5]) == []
    floors = point_floors(s, keys)
    assert floors[:3] == pytest.approx([1 / 3] * 3) and np.isnan(floors[3:]).all()


def test_class_floors_count_groups_worst_share_past_bound_and_timer_limited_points():
    s = [sample(1), sample(2), sample(10, tokens=2), sample(11, tokens=2), sample(100, tokens=3)]
    keys = ["a", "a", "a", "a", "a"]
    (f,) = class_floors(s, keys, ["residual_add"] * 5, 1e-6)
    assert (f.op_class, f.points, f.groups) == ("residual_add", 5, 2)
    assert f.worst == pytest.approx(1 / 3) and f.share_past == 0.5  # 1/3 > 30%; 1/21 is not
    assert (
        f.worst_q == pytest.approx(0.0, abs=1e-12) and f.share_past_q == 0.0
    )  # (2 - 1 - 1) / 3 = 0, (11 - 10 - 1) / 21 = 0
    assert f.low_points == 2  # 1 and 2 us are at <= 5 quanta; 10, 11 and 100 us are not
    assert "M=1 tp=1: 1, 2 us" in f.worst_group
    assert low_quanta([sample(5), sample(5.5)], 1e-6).tolist() == [True, False]


def test_timer_quantum_is_inferred_from_the_readings():
    on_us = [sample(2, lo, hi) for lo, hi in ((1, 3), (7, 12), (5, 9))]
    assert timer_quantum_s(on_us) == pytest.approx(1e-6, rel=1e-9)
    on_half_us = [sample(2, lo, hi) for lo, hi in ((1.5, 2), (3.5, 7), (2, 4.5))]
    assert timer_quantum_s(on_half_us) == pytest.approx(5e-7, rel=1e-9)
    # no repeats: the medians (a median of an even count is a midpoint: q/2 at worst)
    assert timer_quantum_s([sample(2), sample(3.5)]) == pytest.approx(5e-7, rel=1e-9)
    with pytest.raises(ValueError, match="^samples: no times"):
        timer_quantum_s([])


def test_resolution_aware_error_forgives_half_a_quantum_and_is_exact_beyond():
    meas = np.array([1e-6, 2e-6, 2e-6, 10e-6])
    pred = np.array([1.4e-6, 3e-6, 1.5e-6, 8e-6])
    got = resolution_error(pred, meas, 1e-6)
    # 0.4 us < q/2: 0; (1 - 0.5) / 2; (0.5 - 0.5) / 2 = 0; (2 - 0.5) / 10
    assert got == pytest.approx([0.0, 0.25, 0.0, 0.15])
    assert resolution_error(pred, meas, 0.0) == pytest.approx(np.abs(pred / meas - 1))
    s = [sample(2, 1, 3), sample(2, 1, 3), sample(2)]
    assert inside_repeats(np.array([3e-6, 3.5e-6, 2e-6]), s).tolist() == [True, False, False]


def _write_csv(root, rows, cols=("min", "max", "median", "std")):
    d = root / "vidur" / "compute" / "g" / "org" / "m"
    d.mkdir(parents=True)
    head = ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp", "num_tokens",
            "num_tensor_parallel_workers", *(f"time_stats.add.{c}" for c in cols)]  # fmt: skip
    with (d / "mlp.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(head)
        for r in rows:
            w.writerow([32, 32, 4096, 11008, 32000, "True", 8, 1, *r])
    return d / "mlp.csv"


def test_loader_reads_the_repeats_min_max_and_std(tmp_path):
    _write_csv(tmp_path, [("0.001", "0.003", "0.002", "0.0005")])
    (s,) = load_operator_samples(tmp_path, "g")
    assert (s.time_s, s.min_s, s.max_s, s.std_s) == pytest.approx((2e-6, 1e-6, 3e-6, 5e-7))
    (s,) = load_operator_samples(_only_median(tmp_path), "g")
    assert (s.time_s, s.min_s, s.max_s, s.std_s) == (pytest.approx(2e-6), None, None, None)


def _only_median(tmp_path):
    root = tmp_path / "median_only"
    _write_csv(root, [("0.002",)], cols=("median",))
    return root


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (("x", "0.003", "0.002", "0"), r"^time_stats\.add\.min: not a number \('x'\) in .*mlp\.csv"),
        (("0", "0.003", "0.002", "0"), r"^time_stats\.add\.min: times must be > 0 ms"),
        (("0.0025", "0.003", "0.002", "0"), r"^time_stats\.add\.min: '0\.0025' ms exceeds the median in"),
        (("0.001", "0.0015", "0.002", "0"), r"^time_stats\.add\.max: '0\.0015' ms is below the median in"),
        (("0.001", "0.003", "0.002", "-1"), r"^time_stats\.add\.std: times must be >= 0 ms"),
    ],
)
def test_bad_repeat_values_name_the_column_and_file(tmp_path, row, message):
    _write_csv(tmp_path, [row])
    with pytest.raises(ValueError, match=message):
        load_operator_samples(tmp_path, "g")


def _scoring(name, worst_raw, worst_q):
    rows = [ClassError(c, "all", 10, 0.01, w) for c, w in worst_raw.items()]
    rows += [ClassError(c, "1-16", 2, 0.01, w / 2) for c, w in worst_raw.items()]  # a range's worst: not read
    res = [ClassError(c, "all", 10, 0.0, w) for c, w in worst_q.items()]
    return Scoring(name, name, name, np.zeros(0), rows, res, [])


def test_check_per_scoring_reads_each_class_worst_raw_and_resolution_aware():
    a = _scoring(
        "corrected, training", {"gemm": 0.1, "residual_add": 0.59}, {"gemm": 0.1, "residual_add": 0.2}
    )
    b = _scoring("leave-one-point-out", {"gemm": 0.74, "norm": 0.3}, {"gemm": 0.5, "norm": 0.29})
    assert a.check() == {"raw": {"pass": False, "failing_classes": {"residual_add": 0.59}},
                         "resolution_aware": {"pass": True, "failing_classes": {}}}  # fmt: skip
    lines = check_lines(FitCheck(1e-6, [], [a, b]))
    assert lines[0] == (
        "check (worst < 30% per class) - corrected, training: raw FAIL (residual_add 59%), resolution-aware PASS"
    )
    assert (
        lines[1].lstrip()
        == "leave-one-point-out: raw FAIL (gemm 74%, norm 30%), resolution-aware FAIL (gemm 50%)"
    )
    assert len(lines[1]) - len(lines[1].lstrip()) == len("check (worst < 30% per class) - ")


def test_fit_check_scores_a_fit_raw_and_resolution_aware_beside_its_floor():
    samples = [sample(1, 1, 2), sample(1, 1, 1, model="n"), sample(2, 2, 2, model="o"), sample(10, 9, 12, tokens=4),
               sample(10, 9, 11, tokens=8), sample(12, 11, 13, tokens=8, model="n")]  # fmt: skip
    pred = np.array([1.5e-6, 1.5e-6, 1.5e-6, 20e-6, 20e-6, 20e-6])
    result = SimpleNamespace(samples=samples, correction=None, hardware=get_gpu("h100-sxm"), physical_s=pred,
                             errors=operator_errors(samples, pred))  # fmt: skip
    check = fit_check(result)
    assert check.quantum_s == pytest.approx(1e-6, rel=1e-9)
    (s,) = check.scorings  # no corrections: the physical model's scoring only
    assert s.failing(False) == {"residual_add": pytest.approx(1.0)}  # 20 us for 10 us
    assert s.resolution[0].worst == pytest.approx(0.95)  # (10 - 0.5) / 10; the 1-2 us points: 0
    assert s.resolution[0].median == pytest.approx(0.3125)  # of 0, 0, 0, 0.625, 0.95, 0.95
    assert s.inside == {"residual_add": pytest.approx(1 / 6)}  # 1.5 us lies in [1, 2] only
    got = [(f["num_tokens"], f["model"], f["resolution_aware_error"], f["measured_quanta"], f["inside_repeats"],
            f["group_floor"]) for f in s.failures]  # fmt: skip
    assert got == [(4, "m", pytest.approx(0.95), pytest.approx(10), False, None),
                   (8, "m", pytest.approx(0.95), pytest.approx(10), False, pytest.approx(2 / 22)),
                   (8, "n", pytest.approx(7.5 / 12), pytest.approx(12), False, pytest.approx(2 / 22))]  # fmt: skip
    (floor,) = check.floors
    assert (floor.groups, floor.low_points) == (2, 3) and floor.worst == pytest.approx(1 / 3)
    out = check_summary(check)
    assert out["check"]["physical_training"]["resolution_aware"]["pass"] is False
    assert out["failures"]["physical_training"] == s.failures and out["floor"][0]["groups"] == 2
