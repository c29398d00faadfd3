"""Per-request and aggregate serving metrics, per-step utilisation timelines, reports and plots."""

from kvbalance.metrics.report import (
    plot_lines,
    print_summary_table,
    summary_table,
    write_report_png,
    write_table_csv,
)
from kvbalance.metrics.summary import (
    REQUEST_CSV_COLUMNS,
    latency_stats,
    meets_slo,
    request_rows,
    steady_throughput,
    summarize,
    to_json_value,
    write_requests_csv,
    write_summary_json,
)
from kvbalance.metrics.timeline import Timeline, downsample_indices, kv_usage_mean

__all__ = [
    "REQUEST_CSV_COLUMNS",
    "Timeline",
    "downsample_indices",
    "kv_usage_mean",
    "latency_stats",
    "meets_slo",
    "plot_lines",
    "print_summary_table",
    "request_rows",
    "steady_throughput",
    "summarize",
    "summary_table",
    "to_json_value",
    "write_report_png",
    "write_requests_csv",
    "write_summary_json",
    "write_table_csv",
]
