"""``kvbalance offline plan|run --simulate`` on an OpenAI Batch file with bad lines, and the Batch reader."""

import json

import pytest

from kvbalance.cli import main
from kvbalance.workloads.offline import hash_tokenize, parse_batch_line, read_openai_batch


def _line(i, content, max_tokens=8, url="/v1/chat/completions"):
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body})


@pytest.fixture
def batch_file(tmp_path):
    shared = "You are a careful grader. Answer with one letter. " * 6
    lines = [
        _line(i, shared + f"question {i} " * (3 + i % 5), max_tokens=2 + 40 * (i % 3)) for i in range(12)
    ]
    lines.insert(3, "{broken")
    lines.insert(6, json.dumps({"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}))
    lines.append(
        json.dumps({"custom_id": "p", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}})
    )
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reader_keeps_every_line_in_place_with_errors_naming_the_field(batch_file):
    batch = read_openai_batch(batch_file)
    assert len(batch.lines) == 15
    assert [ln.line_no for ln in batch.lines] == list(range(1, 16))
    errors = {ln.line_no: ln.error for ln in batch.errors}
    assert set(errors) == {4, 7}
    assert "not valid JSON" in errors[4] and "method" in errors[7]
    assert len(batch.requests) == 13
    assert batch.lines[-1].request.max_tokens == 256  # default budget when a line has none


@pytest.mark.parametrize(
    "body,field",
    [
        ({"messages": []}, "body.messages"),
        ({"messages": [{"role": "user", "content": 3}]}, "body.messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "body.max_tokens"),
    ],
)
def test_bad_bodies_name_the_field(body, field):
    obj = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    ln = parse_batch_line(json.dumps(obj), 1)
    assert ln.request is None and field in ln.error and ln.custom_id == "a"


def test_hash_tokenizer_shares_equal_text_prefixes():
    a, b = hash_tokenize("You are a grader. Q1"), hash_tokenize("You are a grader. Q2")
    assert a[:-1] == b[:-1] and a[-1] != b[-1]


def test_plan_prints_every_planner_and_skips_bad_lines(batch_file, capsys):
    assert main(["offline", "plan", str(batch_file), "--json"]) == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)
    assert {r["planner"] for r in rows} >= {"blendserve", "fcfs", "sglang-lpm", "nanoflow-dfs"}
    assert all(r["makespan_s"] > 0 for r in rows)
    assert "line 4" in out.err and "line 7" in out.err


def test_run_simulate_predicts_makespan_and_throughput(batch_file, capsys):
    # a 128-token budget admits the requests one after another, so later ones find the shared prompt cached
    argv = ["offline", "run", str(batch_file), "--simulate", "--planner", "vllm-dfs", "--chunk-tokens", "128"]
    assert main([*argv, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["num_requests"] == 13 and row["throughput_tokens_per_s"] > 0 and row["sharing_ratio"] > 0.3


def test_run_rejects_unknown_planner_and_gpu(batch_file, capsys):
    assert main(["offline", "run", str(batch_file), "--simulate", "--planner", "magic"]) == 2
    assert "planner: unknown 'magic'" in capsys.readouterr().err
    assert main(["offline", "run", str(batch_file), "--simulate", "--gpu", "tpu9"]) == 2
    assert "gpu" in capsys.readouterr().err


def test_run_simulate_without_host_time_counts_gpu_time_only(batch_file, capsys):
    argv = ["offline", "run", str(batch_file), "--simulate", "--planner", "nanoflow-dfs", "--json"]
    assert main(argv) == 0
    with_host = json.loads(capsys.readouterr().out)
    assert main([*argv, "--no-host-time"]) == 0
    gpu_only = json.loads(capsys.readouterr().out)
    assert gpu_only["makespan_s"] < with_host["makespan_s"]  # the default engine's host time is gone
    assert gpu_only["num_steps"] == with_host["num_steps"]  # same schedule, shorter steps
    assert main([*argv, "--interference-factor", "1.3"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan_s"] >= with_host["makespan_s"]  # never faster
    assert main([*argv, "--interference-factor", "0.9"]) == 2
    assert "interference_factor: must be >= 1" in capsys.readouterr().err
