"""The elastic KV reserve experiment's files (``reproduce/elastic.py`` computes the rows): CSV tables of
the TTFT scenario, decode pressure, decode-only share and reserve share, and the three figures (TTFT of the
long prompts, KV capacity and use over time, the reserve's share of KV memory)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbalance.metrics.report import plot_lines, write_table_csv
from kvbalance.metrics.summary import to_json_value

TTFT_COLUMNS = (
    "mode",
    "ttft_median_s",
    "ttft_max_s",
    "kv_capacity_tokens",
    "kv_capacity_lent_tokens",
    "failed",
    "oom_at_s",
    "completed",
    "preemptions",
    "decode_only_share",
    "lends",
    "reclaims",
    "drain_preemptions",
    "switch_s",
)


def write_tables(
    out: Path,
    ttft_rows: list[dict[str, Any]],
    pressure: list[dict[str, Any]],
    pressure_columns: Sequence[str],
    share_rows: list[dict[str, Any]],
    reserve_rows: list[dict[str, Any]],
) -> None:
    """ttft.csv, decode_pressure.csv, decode_only_share.csv and reserve_share.csv under ``out``."""
    write_table_csv(out / "ttft.csv", to_json_value(ttft_rows), list(TTFT_COLUMNS))
    write_table_csv(out / "decode_pressure.csv", to_json_value(pressure), list(pressure_columns))
    write_table_csv(out / "decode_only_share.csv", to_json_value(share_rows))
    write_table_csv(out / "reserve_share.csv", to_json_value(reserve_rows))


def plot_long_prompt_ttft(path: Path, ttft_rows: list[dict[str, Any]], title: str) -> None:
    """TTFT of each long prompt in arrival order, one line per mode (modes with no TTFTs left out)."""
    plot_lines(
        path,
        {
            r["mode"]: (list(range(1, len(r["long_ttfts_s"]) + 1)), r["long_ttfts_s"])
            for r in ttft_rows
            if r["long_ttfts_s"]
        },
        "long prompt (arrival order)",
        "TTFT (s)",
        title,
    )


def plot_kv_capacity(
    path: Path, traces: dict[str, dict[str, list]], pressure_traces: dict[str, dict[str, list]]
) -> None:
    """KV pool capacity (base + lent reserve) of the elastic mode and tokens in use, both scenarios."""
    cap_series = {}
    for label, tr in (
        ("burst: elastic-32768 capacity", traces["elastic-32768"]),
        ("pressure: elastic-32768 capacity", pressure_traces["elastic-32768"]),
    ):
        cap_series[label] = (tr["t"], tr["capacity"])
    for label, tr in (
        ("burst: static-32768 in use", traces["static-32768"]),
        ("pressure: elastic-32768 in use", pressure_traces["elastic-32768"]),
        ("pressure: chunk-32768 in use", pressure_traces["chunk-32768"]),
    ):
        cap_series[label] = (tr["t"], tr["used"])
    plot_lines(
        path,
        cap_series,
        "time (s)",
        "KV tokens",
        "KV pool: capacity (base + lent reserve) and blocks in use (live + cached)",
        markers=False,
    )


def plot_reserve_share(path: Path, reserve_rows: list[dict[str, Any]], gpu: str) -> None:
    """The activation reserve's share of KV memory against the prefill chunk, one line per model / TP case."""
    plot_lines(
        path,
        {
            case: (
                [r["chunk_size"] for r in reserve_rows if r["case"] == case],
                [r["reserve_share_of_kv"] for r in reserve_rows if r["case"] == case],
            )
            for case in dict.fromkeys(r["case"] for r in reserve_rows)
        },
        "prefill chunk (tokens)",
        "reserve / (reserve + KV pool)",
        f"Activation reserve's share of KV memory on {gpu}",
        logx=True,
    )
