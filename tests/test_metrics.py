"""Tests for kvbalance.metrics: summary statistics, timeline, CSV/JSON output and the PNG report."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
from rich.console import Console

from kvbalance.metrics import (
    REQUEST_CSV_COLUMNS,
    Timeline,
    latency_stats,
    plot_lines,
    print_summary_table,
    steady_throughput,
    summarize,
    write_report_png,
    write_requests_csv,
    write_summary_json,
    write_table_csv,
)
from kvbalance.request import Request, RequestState


def finished(rid, arrival, scheduled, token_times, prompt_len=10, preemptions=0, hits=0):
    r = Request(rid, list(range(prompt_len)), arrival_s=arrival, max_tokens=max(len(token_times), 1))
    r.first_scheduled_s = scheduled
    r.output_token_ids = [1] * len(token_times)
    r.token_times_s = list(token_times)
    r.first_token_s = token_times[0]
    r.finish_s = token_times[-1]
    r.state = RequestState.FINISHED
    r.num_preemptions = preemptions
    r.prefix_hit_tokens = hits
    return r


def rejected(rid, arrival, reason):
    r = Request(rid, [1, 2, 3], arrival_s=arrival)
    r.state = RequestState.REJECTED
    r.reject_reason = reason
    return r


def four_requests():
    # TTFT 0.1, 0.2, 0.3, 0.4; TPOT 0.01, 0.02, 0.03, 0.04 (3 output tokens each); queue delay 0.05 each.
    reqs = []
    for i in range(4):
        a = float(i)
        ttft = 0.1 * (i + 1)
        tpot = 0.01 * (i + 1)
        reqs.append(finished(f"r{i}", a, a + 0.05, [a + ttft, a + ttft + tpot, a + ttft + 2 * tpot]))
    return reqs


def test_latency_percentiles_and_means_are_exact():
    s = summarize(four_requests(), kv_capacity_tokens=1000)
    assert s["ttft_s"] == {"mean": 0.25, "p50": 0.25, "p90": 0.37, "p99": 0.397, "count": 4}
    assert s["tpot_s"]["mean"] == 0.025
    assert s["tpot_s"]["p90"] == 0.037
    assert s["queue_delay_s"]["p99"] == 0.05
    # e2e = ttft + 2 * tpot = 0.12, 0.24, 0.36, 0.48
    assert s["e2e_s"]["mean"] == 0.3
    assert s["e2e_s"]["p50"] == 0.3


def test_counts_rates_and_makespan():
    reqs = four_requests() + [rejected("x", 0.5, "prompt_too_long"), rejected("y", 0.6, "prompt_too_long")]
    waiting = Request("w", [1, 2], arrival_s=1.0)
    s = summarize([*reqs, waiting], kv_capacity_tokens=1000)
    assert (s["num_requests"], s["completed"], s["rejected"], s["aborted"], s["unfinished"]) == (
        7,
        4,
        2,
        0,
        1,
    )
    assert s["rejected_reasons"] == {"prompt_too_long": 2}
    # last finish 3 + 0.4 + 0.08 = 3.48, first arrival 0
    assert s["makespan_s"] == 3.48
    assert s["throughput_rps"] == round(4 / 3.48, 6)
    assert s["input_tokens_per_s"] == round(40 / 3.48, 6)
    assert s["output_tokens_per_s"] == round(12 / 3.48, 6)
    assert s["total_tokens_per_s"] == round(52 / 3.48, 6)


def test_steady_throughput_ignores_warmup_and_drain():
    # completions every second from t=1 to t=11, plus a slow straggler tail: the middle rate is 1/s.
    assert steady_throughput([float(t) for t in range(1, 12)]) == 1.0
    # 21 completions: with linear percentiles t10 = times[2] and t90 = times[18] exactly.
    warmup, steady, drain = [0.1, 0.2], [10.0 + 2 * k for k in range(17)], [100.0, 200.0]
    times = warmup + steady + drain
    assert steady_throughput(times) == 16 / (42.0 - 10.0) == 0.5  # one completion every 2 s
    assert len(times) / max(times) < 0.11  # the plain average is dragged down by the stragglers
    assert steady_throughput([]) is None
    assert steady_throughput([3.0, 3.0]) is None


def test_goodput_counts_requests_meeting_both_slos():
    reqs = four_requests()
    s = summarize(reqs, kv_capacity_tokens=1000, ttft_slo_s=0.35, tpot_slo_s=0.025)
    # ttft ok: r0, r1, r2; tpot ok: r0, r1 -> 2 good
    assert s["goodput_rps"] == round(2 / s["makespan_s"], 6)
    assert s["slo_attainment"] == 0.5
    only_ttft = summarize(reqs, kv_capacity_tokens=1000, ttft_slo_s=0.35)
    assert only_ttft["slo_attainment"] == 0.75
    no_slo = summarize(reqs, kv_capacity_tokens=1000)
    assert no_slo["goodput_rps"] == no_slo["throughput_rps"]


def test_single_token_output_passes_tpot_slo():
    r = finished("one", 0.0, 0.0, [0.1])
    assert r.tpot_s is None
    s = summarize([r], kv_capacity_tokens=10, tpot_slo_s=0.001)
    assert s["slo_attainment"] == 1.0
    assert s["tpot_s"]["mean"] is None


def test_nothing_completed_gives_none_not_nan(tmp_path):
    s = summarize([rejected("x", 0.0, None)], kv_capacity_tokens=100, ttft_slo_s=1.0)
    assert s["rejected_reasons"] == {"unknown": 1}
    assert s["ttft_s"]["p99"] is None and s["makespan_s"] is None
    assert s["throughput_rps"] == 0.0 and s["steady_throughput_rps"] is None
    path = tmp_path / "summary.json"
    write_summary_json(path, {**s, "weird": float("nan")})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    loaded = json.loads(text)
    assert loaded["weird"] is None
    assert list(loaded) == sorted(loaded)


def test_summary_json_round_trip_is_identical(tmp_path):
    tl = Timeline()
    tl.record(0.0, 1, 0, 100, 1000, 10, 1.0)
    reqs = four_requests()
    s = summarize(reqs, kv_capacity_tokens=1000, timeline=tl, extra={"config": {"gpu": "H100"}})
    path = tmp_path / "s.json"
    write_summary_json(path, s)
    assert json.loads(path.read_text()) == s
    assert s["config"] == {"gpu": "H100"}
    with pytest.raises(ValueError, match="completed"):
        summarize(reqs, kv_capacity_tokens=1000, extra={"completed": 1})


def test_prefix_hit_rate_and_preemptions():
    reqs = [
        finished("a", 0.0, 0.0, [1.0, 2.0], prompt_len=100, hits=50),
        finished("b", 0.0, 0.0, [1.0, 2.0], prompt_len=100, hits=0, preemptions=1),
    ]
    s = summarize(reqs, kv_capacity_tokens=1000)
    assert s["prefix_hit_rate"] == round(50 / 300, 6)  # b admitted twice
    assert s["preemptions"] == 1
    s = summarize(reqs, kv_capacity_tokens=1000, prefix_hit_tokens=30, prompt_tokens_total=60, preemptions=7)
    assert (s["prefix_hit_rate"], s["preemptions"]) == (0.5, 7)


def test_timeline_time_weighted_kv_usage_and_batch_times():
    tl = Timeline()
    tl.record(0.0, 2, 5, 100, 1000, 64, 1.0)
    tl.record(1.0, 0, 0, 0, 1000, 0, 0.5)  # idle gap until t=4
    tl.record(4.0, 3, 1, 500, 1000, 128, 2.0)
    # used token-seconds: 100*1 + 0*3 + 500*2 = 1100 over 6 s of 1000 tokens
    assert tl.kv_usage_mean() == pytest.approx(1100 / 6000)
    assert tl.time_weighted_mean("waiting") == pytest.approx((5 * 1 + 0 * 3 + 1 * 2) / 6)
    assert tl.batch_times().tolist() == [1.0, 2.0]
    assert tl.batch_times(nonempty=False).tolist() == [1.0, 0.5, 2.0]
    t, q = tl.queue_length()
    assert t.tolist() == [0.0, 1.0, 4.0] and q.tolist() == [5, 0, 1]
    s = summarize([], kv_capacity_tokens=1000, timeline=tl)
    assert s["kv_usage_mean"] == round(1100 / 6000, 6)


def test_timeline_extra_columns_and_csv(tmp_path):
    tl = Timeline()
    tl.record(0.0, 1, 0, 10, 100, 5, 0.1)
    tl.record(0.1, 1, 0, 20, 100, 5, 0.1, lent_tokens=40)
    tl.record(0.2, 1, 0, 30, 100, 5, 0.1)
    assert [r["lent_tokens"] for r in tl.rows()] == [None, 40, None]
    path = tmp_path / "tl.csv"
    tl.to_csv(path)
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == 3 and rows[1]["lent_tokens"] == "40" and rows[0]["lent_tokens"] == ""
    with pytest.raises(ValueError, match="time_s"):
        bad = Timeline()
        bad.record(1.0, 0, 0, 0, 1, 0, 0.1)
        bad.record(0.5, 0, 0, 0, 1, 0, 0.1)
        bad.kv_usage_mean()


def test_timeline_records_100k_steps_and_downsamples(tmp_path):
    # no wall-clock bound here (timed tests flake on a shared machine): the simulator's speed is
    # benchmarks/bench_simulator.py's figure
    tl = Timeline()
    for i in range(100_000):
        tl.record(i * 0.01, 8, 2, 1000 + i % 50, 4096, 512, 0.01)
    assert tl.kv_usage_mean() == pytest.approx(sum(1000 + i % 50 for i in range(100_000)) / 100_000 / 4096)
    path = tmp_path / "tl.csv"
    tl.to_csv(path, max_rows=1000)
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == 1000
    assert float(rows[0]["time_s"]) == 0.0 and float(rows[-1]["time_s"]) == pytest.approx(999.99)


def test_requests_csv_round_trip(tmp_path):
    reqs = [*four_requests(), rejected("x", 0.25, "kv_never_fits")]
    path = tmp_path / "requests.csv"
    write_requests_csv(path, reqs)
    rows = list(csv.DictReader(path.open()))
    assert tuple(rows[0]) == REQUEST_CSV_COLUMNS
    assert [r["request_id"] for r in rows] == ["r0", "r1", "r2", "r3", "x"]
    for row, req in zip(rows, reqs):
        assert float(row["arrival_s"]) == req.arrival_s
        assert int(row["num_prompt_tokens"]) == req.num_prompt_tokens
        assert row["state"] == req.state.value
        for key in ("queue_delay_s", "ttft_s", "tpot_s", "e2e_s"):
            value = getattr(req, key)
            assert (row[key] == "") if value is None else float(row[key]) == value
    assert rows[4]["reject_reason"] == "kv_never_fits" and rows[0]["reject_reason"] == ""


def test_write_table_csv_unions_columns(tmp_path):
    path = tmp_path / "t.csv"
    write_table_csv(path, [{"a": 1, "b": 2.5}, {"a": 3, "c": None, "d": "x"}])
    assert list(csv.reader(path.open())) == [["a", "b", "c", "d"], ["1", "2.5", "", ""], ["3", "", "", "x"]]


def test_report_png_and_line_plot_are_written(tmp_path):
    tl = Timeline()
    for i in range(50):
        tl.record(i * 0.1, 2, 50 - i, 10 * i, 1000, 32, 0.1)
    png = tmp_path / "report.png"
    write_report_png(png, four_requests(), tl, "test run")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    empty = tmp_path / "empty.png"
    write_report_png(empty, [], None, "")
    assert empty.stat().st_size > 0
    lines = tmp_path / "lines.png"
    plot_lines(lines, {"a": ([1, 2, 3], [1, 4, 9]), "b": ([1, 2], [2, 3])}, "x", "y", "t", logy=True)
    assert lines.stat().st_size > 0
    with pytest.raises(ValueError, match="series"):
        plot_lines(tmp_path / "bad.png", {"a": ([1, 2], [1])}, "x", "y")


def test_print_summary_table_shows_headline_numbers():
    s = summarize(four_requests(), kv_capacity_tokens=4096, ttft_slo_s=1.0)
    buf = io.StringIO()
    print_summary_table(s, console=Console(file=buf, width=100))
    out = buf.getvalue()
    assert "4 / 0" in out and "4,096 tokens" in out and "250.0 ms" in out and "goodput" in out


def test_latency_stats_ignores_none():
    assert latency_stats([None, 2.0, None, 4.0])["mean"] == 3.0
    assert all(v is None for k, v in latency_stats([None]).items() if k != "count")
    assert not any(isinstance(v, float) and math.isnan(v) for v in latency_stats([]).values())
