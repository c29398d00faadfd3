"""The `kvbalance simulate` / `cost` commands: outputs, determinism and clear errors on bad input."""

from __future__ import annotations

import json

import pytest

from kvbalance.cli import main

SUMMARY_KEYS = {
    "num_requests",
    "completed",
    "rejected",
    "throughput_rps",
    "steady_throughput_rps",
    "input_tokens_per_s",
    "output_tokens_per_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "queue_delay_s",
    "makespan_s",
    "kv_capacity_tokens",
    "prefix_hit_rate",
    "preemptions",
}


def _simulate(tmp_path, name, *extra):
    out = tmp_path / name
    code = main(
        ["simulate", "--num-requests", "150", "--rate", "20", "--no-progress", "--out", str(out), *extra]
    )
    return code, out


def test_simulate_writes_summary_and_reports(tmp_path):
    code, out = _simulate(tmp_path, "a")
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["completed"] == 150 and summary["rejected"] == 0
    for key in ("ttft_s", "tpot_s", "e2e_s", "queue_delay_s"):
        assert {"mean", "p50", "p90", "p99"} <= summary[key].keys()
    assert summary["ttft_s"]["p50"] <= summary["ttft_s"]["p99"]
    for f in ("requests.csv", "timeline.csv", "report.png"):
        assert (out / f).stat().st_size > 0


def test_same_seed_gives_identical_summary(tmp_path):
    _, a = _simulate(tmp_path, "a", "--seed", "3")
    _, b = _simulate(tmp_path, "b", "--seed", "3")
    _, c = _simulate(tmp_path, "c", "--seed", "4")
    sa, sb, sc = ((d / "summary.json").read_text() for d in (a, b, c))
    assert sa == sb
    assert sa != sc
    assert (a / "requests.csv").read_text() == (b / "requests.csv").read_text()


def test_yaml_config_and_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "model: llama-3-8b\ngpu: h100-sxm\nworkload: uniform:100-200:10-20\nnum_requests: 40\nrate: inf\n"
    )
    out = tmp_path / "o"
    assert main(["simulate", str(cfg), "--no-progress", "--policy", "vllm", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["model"] == "llama-3-8b" and s["policy"] == "vllm" and s["completed"] == 40


@pytest.mark.parametrize(
    "args, field",
    [
        (["--model", "gpt-17"], "model"),
        (["--gpu", "tpu-v9"], "gpu"),
        (["--tp", "0"], "tp"),
        (["--workload", "nonsense"], "workload"),
        (["--chunk-size", "0"], "chunk_size"),
    ],
)
def test_bad_input_names_the_field(tmp_path, capsys, args, field):
    code, _ = _simulate(tmp_path, "x", *args)
    assert code != 0
    err = capsys.readouterr().err
    assert field in err and len(err.strip().splitlines()) == 1


def test_negative_rate_is_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--rate", "-3"])
    assert e.value.code != 0
    assert "rate" in capsys.readouterr().err


def test_unknown_config_key_is_named(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("modle: llama-2-7b\n")
    assert main(["simulate", str(cfg), "--no-progress", "--out", str(tmp_path / "o")]) != 0
    assert "modle" in capsys.readouterr().err


def test_malformed_trace_line_is_named(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
        '{"timestamp": 5, "input_length": "ten", "output_length": 5, "hash_ids": [2]}\n'
    )
    code, _ = _simulate(tmp_path, "x", "--workload", f"mooncake:{trace}")
    assert code != 0
    err = capsys.readouterr().err
    assert "t.jsonl:2" in err and "input_length" in err


def test_request_that_never_fits_is_counted_rejected(tmp_path):
    code, out = _simulate(tmp_path, "x", "--workload", "fixed:3000:100", "--kv-tokens", "2048")
    assert code == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["rejected"] == 150 and s["completed"] == 0
    assert "kv_capacity" in next(iter(s["rejected_reasons"]))


def test_cost_json(capsys):
    assert (
        main(
            [
                "cost",
                "--model",
                "llama-2-7b",
                "--gpu",
                "a100-80gb",
                "--decode-batch",
                "1",
                "--context",
                "128",
                "--json",
            ]
        )
        == 0
    )
    r = json.loads(capsys.readouterr().out)
    assert {"step_time_s", "compute_time_s", "memory_time_s"} <= r.keys()
    assert 0.006 < r["step_time_s"] < 0.012
