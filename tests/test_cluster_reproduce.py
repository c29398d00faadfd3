"""`kvbalance reproduce banaserve --quick` end to end (slow: minutes), and its row schema."""

from __future__ import annotations

import json

import pytest

from kvbalance.cli import main

pytestmark = pytest.mark.slow

ROW_KEYS = {"model", "workload", "arrival", "system", "max_rate_at_slo_rps", "throughput_rps", "total_time_s",
            "mean_latency_s", "p99_latency_s", "hot_spot_ratio", "migrations"}  # fmt: skip


def test_reproduce_banaserve_quick(tmp_path):
    assert main(["reproduce", "banaserve", "--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())
    ran = [r for r in rows if "not_run" not in r]
    assert ran and all(ROW_KEYS <= r.keys() for r in ran)
    settings = {(r["model"], r["workload"], r["arrival"]) for r in ran}
    assert {s[2] for s in settings} == {"poisson", "bursty"}
    assert {s[1] for s in settings} >= {"alpaca", "longbench", "docqa-zipf", "chat", "phases-15"}
    for s in settings:
        by = {r["system"]: r for r in ran if (r["model"], r["workload"], r["arrival"]) == s}
        assert {"vllm", "vllm-v0", "distserve", "banaserve", "banaserve-paper", "kvbalance"} <= by.keys()
        if s[1] in ("alpaca", "longbench"):
            assert {"banaserve-no-store", "banaserve-cache-aware", "vllm-v0-round-robin"} <= by.keys()
        assert all(r["config"] and r["config_detail"]["instances"] for r in by.values())
        for r in by.values():
            for k in ("prefix_hit_rate", "store_hit_rate", "decode_local_hit_rate"):
                assert r[k] is None or 0 <= r[k] <= 1
        # same requests, same rate: one overload rate and one latency rate for every system of a setting
        assert len({r["overload_rate_rps"] for r in by.values()}) == 1
        assert all(r["max_rate_at_slo_rps"] > 0 and r["hot_spot_ratio"] >= 1 for r in by.values())
    assert {r["system"] for r in rows if "not_run" in r} <= {"llumnix"}
    text = (tmp_path / "README.md").read_text()
    assert "1.2-3.9x" in text and "migration_share_max_rate" in text
    phases = [r for r in ran if r["workload"] == "phases-15"]
    assert all(len(r["per_phase_max_rate_rps"] or []) == 2 for r in phases if r["system"] == "banaserve")
    assert any(r["controller_trace"] and r["controller_trace"]["reason"] for r in phases)
    for png in ("slo_attainment.png", "utilization.png", "migrations.png", "max_rate.png", "curves.png",
                "controller.png", "hot_spot.png"):  # fmt: skip
        assert (tmp_path / png).stat().st_size > 0
