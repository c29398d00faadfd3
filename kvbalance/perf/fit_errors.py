"""Errors of a GPU fit: the fitted class of each profiled operator and the relative error |pred / meas - 1|
per class and size range (tokens, batch size or message bytes), median and worst (``kvbalance calibrate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbalance.perf.kernels import elementwise_class
from kvbalance.perf.profiles import OperatorSample

GEMM_OPS = ("qkv_proj", "o_proj", "mlp_up", "mlp_down")
# Token ranges the error report splits each class into (inclusive upper bounds).
TOKEN_RANGES = ((1, 16), (17, 128), (129, 1024), (1025, 1 << 40))
BATCH_RANGES = ((1, 16), (17, 64), (65, 1 << 40))
BYTE_RANGES = ((1, 1 << 16), ((1 << 16) + 1, 1 << 20), ((1 << 20) + 1, 16 << 20), ((16 << 20) + 1, 1 << 40))


def op_class(sample: OperatorSample) -> str:
    """The fitted class of a profiled operator: "gemm" or its element-wise class."""
    if sample.op in GEMM_OPS:
        return "gemm"
    return elementwise_class(sample.op, sample.shape.model_spec().arch)


def point_record(sample: OperatorSample, measured_s: float, predicted_s: float) -> dict:
    """One scored point as the reports list it: what was measured, where, and what was predicted."""
    return {
        "class": op_class(sample),
        "model": sample.shape.model,
        "op": sample.profile_op,
        "tp": sample.tp,
        "num_tokens": sample.num_tokens,
        "measured_s": float(measured_s),
        "predicted_s": float(predicted_s),
        "rel_error": float(predicted_s / measured_s - 1.0),
    }


@dataclass
class ClassError:
    """Relative error |pred / meas - 1| of one operator class over one token range."""

    op_class: str
    tokens: str
    count: int
    median: float
    worst: float

    def to_dict(self) -> dict:
        return {"class": self.op_class, "tokens": self.tokens, "count": self.count,
                "median_rel_error": self.median, "worst_rel_error": self.worst}  # fmt: skip


def error_rows(
    label_of: Sequence[str], size: np.ndarray, pred: np.ndarray, meas: np.ndarray, ranges=TOKEN_RANGES
) -> list[ClassError]:
    """|pred / meas - 1| per class of ``label_of`` and range of ``size``, median and worst."""
    return rel_error_rows(label_of, size, np.abs(pred / meas - 1.0), ranges)


def rel_error_rows(label_of: Sequence[str], size: np.ndarray, rel: np.ndarray, ranges=TOKEN_RANGES):
    """Median and worst of per-point errors ``rel`` per class of ``label_of`` and range of ``size``."""
    labels = np.array(label_of)
    rows = []
    for cls in dict.fromkeys(label_of):
        in_cls = labels == cls
        rows.append(
            ClassError(cls, "all", int(in_cls.sum()), float(np.median(rel[in_cls])), float(rel[in_cls].max()))
        )
        for lo, hi in ranges:
            sel = in_cls & (size >= lo) & (size <= hi)
            if sel.any():
                span = f"{lo}-{hi}" if hi < 1 << 40 else f">={lo}"
                rows.append(
                    ClassError(cls, span, int(sel.sum()), float(np.median(rel[sel])), float(rel[sel].max()))
                )
    return rows


def operator_errors(samples: Sequence[OperatorSample], pred: np.ndarray) -> list[ClassError]:
    meas = np.array([s.time_s for s in samples])
    tokens = np.array([s.num_tokens for s in samples])
    return error_rows([op_class(s) for s in samples], tokens, pred, meas)
