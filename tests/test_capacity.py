"""`kvbalance capacity`: the stability check and capacity plan from the command line."""

from __future__ import annotations

import json

import pytest

from kvbalance.cli import main
from kvbalance.theory import representative_batch_time

SMALL = [
    "capacity",
    "--model",
    "llama-2-7b",
    "--gpu",
    "a100-80gb",
    "--workload",
    "uniform:16-128:16-128",
    "--kv-tokens",
    "8000",
    "--b-requests",
    "200",
]


def test_capacity_reports_formula_inputs_as_json(capsys, tmp_path):
    assert main([*SMALL, "--rate", "50", "--json", "--out", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in (
        "mu_rps",
        "delta",
        "b_s",
        "stable",
        "instances_needed",
        "kv_capacity_tokens",
        "expected_area",
        "max_total_tokens",
        "stable_bound_rps",
        "binding",
        "b_measurement",
    ):
        assert key in report
    assert report["kv_capacity_tokens"] == 8000
    assert report["delta"] == pytest.approx(256 / 8000)
    assert report["mu_rps"] == pytest.approx(
        report["kv_capacity_tokens"] / (report["b_s"] * report["expected_area"]), rel=1e-4
    )  # JSON values are rounded to 6 decimals
    assert report["stable"] in (True, False, "margin")
    assert report["instances_needed"] >= 1
    assert 50 / report["instances_needed"] < report["stable_bound_rps"]
    assert json.loads((tmp_path / "capacity.json").read_text()) == report


def test_verdict_follows_the_rate(capsys):
    base = [*SMALL, "--batch-time", "0.01", "--json"]
    assert main([*base, "--rate", "1"]) == 0
    low = json.loads(capsys.readouterr().out)
    assert low["stable"] is True and low["instances_needed"] == 1
    assert low["b_method"] == "given" and low["b_measurement"] is None
    assert main([*base, "--rate", str(2 * low["mu_rps"])]) == 0
    high = json.loads(capsys.readouterr().out)
    assert high["stable"] is False and high["instances_needed"] >= 2


def test_slo_check_simulates_the_rate(capsys):
    args = [*SMALL, "--batch-time", "0.01", "--rate", "5", "--ttft-slo", "5", "--tpot-slo", "1", "--json"]
    assert main([*args, "--slo-requests", "60"]) == 0
    slo = json.loads(capsys.readouterr().out)["slo"]
    assert slo["meets_p90_slo"] is True
    assert slo["p90_ttft_s"] <= 5 and 0 < slo["goodput_rps"]
    assert slo["completed"] == 60


def test_table_output(capsys):
    assert main([*SMALL, "--batch-time", "0.01", "--rate", "1"]) == 0
    out = capsys.readouterr().out
    assert "E[g]" in out and "mu(1-delta)" in out


@pytest.mark.parametrize(
    "args, field",
    [
        (["--rate", "-1"], "rate"),
        (["--rate", "inf"], "rate"),
        (["--rate", "fast"], "rate"),
        (["--rate", "1", "--kv-tokens", "100"], "kv_tokens"),
        (["--rate", "1", "--chunk-size", "0"], "chunk_size"),
        (["--rate", "1", "--batch-time", "-0.1"], "batch_time"),
    ],
)
def test_bad_input_names_the_field(capsys, args, field):
    assert main([*SMALL, *args]) != 0
    err = capsys.readouterr().err
    assert field in err and len(err.strip().splitlines()) == 1


def test_unknown_model_and_gpu_are_named(capsys):
    argv = ["capacity", "--gpu", "a100-80gb", "--workload", "fixed:10:10", "--rate", "1"]
    assert main([*argv, "--model", "no-such-model"]) != 0
    err = capsys.readouterr().err
    assert "model" in err and "no-such-model" in err
    argv = ["capacity", "--model", "llama-2-7b", "--workload", "fixed:10:10", "--rate", "1"]
    assert main([*argv, "--gpu", "no-such-gpu"]) != 0
    assert "gpu" in capsys.readouterr().err


def test_unknown_workload_is_named(capsys):
    assert main([*SMALL[:6], "bogus", *SMALL[7:], "--rate", "1"]) != 0
    assert "workload" in capsys.readouterr().err


def test_auto_b_takes_trimmed_mean_for_skewed_steps():
    decode_heavy = [0.01] * 70 + [0.03] * 30  # mean 0.016 > 1.1 x median 0.01
    b, method = representative_batch_time(decode_heavy)
    assert method == "trimmed_mean" and b == pytest.approx((0.01 * 60 + 0.03 * 20) / 80)
    b, method = representative_batch_time([0.01, 0.0101, 0.0099, 0.0102])
    assert method == "median" and b == pytest.approx(0.01005)
