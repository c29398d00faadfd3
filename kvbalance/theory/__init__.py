"""Queueing stability of LLM inference under a KV memory limit, and capacity planning built on it."""

from kvbalance.theory.stability import (
    AreaStats,
    CapacityReport,
    area_stats,
    batch_time_estimate,
    capacity_report,
    decode_area,
    expected_area,
    instances_needed,
    memory_time_area,
    prefill_area,
    representative_batch_time,
    stability_margin,
    stability_verdict,
    stable_service_rate,
)

__all__ = [
    "AreaStats",
    "CapacityReport",
    "area_stats",
    "batch_time_estimate",
    "capacity_report",
    "decode_area",
    "expected_area",
    "instances_needed",
    "memory_time_area",
    "prefill_area",
    "representative_batch_time",
    "stability_margin",
    "stability_verdict",
    "stable_service_rate",
]
