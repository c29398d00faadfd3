"""The load generator against a live server: every request completes and the summary has simulate's keys."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from server_support import live_server, make_engine  # noqa: E402

from kvbalance.bench import run_bench, wire_token_ids  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::Warning")

SUMMARY_KEYS = (
    "num_requests",
    "completed",
    "throughput_rps",
    "steady_throughput_rps",
    "input_tokens_per_s",
    "output_tokens_per_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "prefix_hit_rate",
    "kv_capacity_tokens",
)


@pytest.fixture(scope="module")
def server():
    engine = make_engine()
    with live_server(engine) as url:
        yield url, engine


def test_wire_token_ids_stay_in_the_vocab_and_keep_shared_prefixes():
    a = wire_token_ids([1 << 32, (1 << 32) + 1, (1 << 40) + 5], seed=3, vocab_size=256, low=2)
    b = wire_token_ids([1 << 32, (1 << 32) + 1, (1 << 40) + 9], seed=3, vocab_size=256, low=2)
    assert a[:2] == b[:2] and all(2 <= t < 256 for t in a + b)
    assert wire_token_ids([7, 8], seed=4, vocab_size=256) != wire_token_ids([7, 8], seed=5, vocab_size=256)


def test_bench_completes_every_request_and_reports_simulate_keys(server, tmp_path):
    url, engine = server
    summary = run_bench(url, 6, 50.0, "uniform:8-40:4-8", seed=1, out_dir=tmp_path, show_progress=False)
    for key in SUMMARY_KEYS:
        assert key in summary, key
    assert summary["num_requests"] == 6 and summary["completed"] == 6
    assert summary["rejected"] == 0 and summary["aborted"] == 0
    assert summary["ttft_s"]["count"] == 6 and summary["ttft_s"]["p50"] > 0
    assert summary["output_tokens_per_s"] > 0
    assert summary["kv_capacity_tokens"] == 4096
    assert summary["model"] == "tiny-llama"
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["completed"] == 6
    assert len((tmp_path / "requests.csv").read_text().splitlines()) == 7


def test_bench_all_at_once_shares_prefixes_and_counts_tokens(server):
    url, engine = server
    workload = "prefix:1:64:8-8:3-3"  # one 64-token system prompt (one full 64-token block) + 8 own tokens
    warm = run_bench(url, 4, math.inf, workload, seed=2, show_progress=False)  # caches the shared block
    assert warm["completed"] == 4
    summary = run_bench(url, 4, math.inf, workload, seed=2, show_progress=False)
    assert summary["completed"] == 4
    # 4 requests x 3 output tokens, 72-token prompts, over the makespan
    assert summary["output_tokens_per_s"] * summary["makespan_s"] == pytest.approx(12, rel=1e-3)
    assert summary["input_tokens_per_s"] * summary["makespan_s"] == pytest.approx(4 * 72, rel=1e-3)
    # every request of the second run finds the cached block, whatever the arrival race: 64 of 72 tokens
    assert summary["prefix_hit_rate"] == pytest.approx(64 / 72)


def test_bench_counts_rejections_instead_of_crashing(server):
    url, _ = server
    summary = run_bench(url, 2, math.inf, "fixed:8:4", seed=0, vocab_size=100_000, show_progress=False)
    assert summary["completed"] == 0 and summary["rejected"] == 2
    assert any("http 400" in f for f in summary["failures"])


def test_bench_retries_429_after_retry_after_and_completes_every_request():
    engine = make_engine(step_delay_s=0.01)  # each request holds the one queue slot for >= 40 ms
    with live_server(engine, max_queue=1) as url:
        summary = run_bench(
            url,
            3,
            math.inf,
            "fixed:8:4",
            seed=0,
            show_progress=False,
            max_retries_429=50,
            max_retry_wait_s=0.02,
        )
    assert summary["completed"] == 3 and summary["rejected"] == 0
    assert summary["retries_429"] >= 1


def test_bench_without_retries_counts_429_as_rejected():
    engine = make_engine(step_delay_s=0.01)
    with live_server(engine, max_queue=1) as url:
        summary = run_bench(url, 3, math.inf, "fixed:8:4", seed=0, show_progress=False, max_retries_429=0)
    assert summary["completed"] + summary["rejected"] == 3 and summary["rejected"] >= 1
    assert any(f.startswith("http 429") for f in summary["failures"])


def test_bench_sends_the_api_key_a_keyed_server_needs():
    engine = make_engine()
    with live_server(engine, api_key="s3cret") as url:
        keyed = run_bench(url, 2, math.inf, "fixed:8:4", seed=0, show_progress=False, api_key="s3cret")
        keyless = run_bench(url, 2, math.inf, "fixed:8:4", seed=0, show_progress=False, model="m")
    assert keyed["completed"] == 2 and keyed["rejected"] == 0
    assert keyless["completed"] == 0 and any("401" in f for f in keyless["failures"])
