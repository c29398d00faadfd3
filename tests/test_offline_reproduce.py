"""``kvbalance reproduce blendserve --quick`` end to end (slow: minutes)."""

import json

import pytest

from kvbalance.reproduce import blendserve

pytestmark = pytest.mark.slow

REQUIRED = (
    "trace",
    "model",
    "planner",
    "throughput_tokens_per_s",
    "makespan_s",
    "sharing_ratio",
    "optimal_fraction",
)


def test_quick_reproduction_writes_rows_tables_and_plots(tmp_path):
    blendserve.run(tmp_path, quick=True)
    rows = json.loads((tmp_path / "results.json").read_text())
    assert all(all(k in r for k in REQUIRED) for r in rows)
    main = [r for r in rows if r["experiment"] == "main"]
    assert {r["trace"] for r in main} == {"trace1", "trace2", "trace3", "trace4"}
    assert all(0 < r["optimal_fraction"] <= 1 for r in rows)
    dp = {r["data_parallel"]: r for r in rows if r["experiment"] == "data-parallel"}
    assert dp[4]["throughput_tokens_per_s"] > dp[1]["throughput_tokens_per_s"]
    for name in ("README.md", "grid_heatmap.png", "utilisation.png"):
        assert (tmp_path / name).stat().st_size > 0
