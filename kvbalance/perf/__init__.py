"""Cost model: per-operator FLOPs and bytes -> step time on a HardwareSpec, TP communication, calibration."""

from kvbalance.perf.calibrate import CalibrationResult, cpu_base_spec, fit_hardware, predict_samples
from kvbalance.perf.cost import (
    CostModel,
    OpCount,
    OpTime,
    allreduce_time,
    breakdown_total_s,
    transfer_time,
)
from kvbalance.perf.memory import activation_reserve_bytes, kv_bytes_per_token, kv_capacity_tokens
from kvbalance.perf.report import step_cost_report

__all__ = [
    "CalibrationResult",
    "CostModel",
    "OpCount",
    "OpTime",
    "activation_reserve_bytes",
    "allreduce_time",
    "breakdown_total_s",
    "cpu_base_spec",
    "fit_hardware",
    "kv_bytes_per_token",
    "kv_capacity_tokens",
    "predict_samples",
    "step_cost_report",
    "transfer_time",
]
