"""Measured-time corrections of profiled kernel shapes: the second level of the GPU cost model.

Vidur predicts each operator from its profiled points (a random forest per operator over the shape). kvbalance
keeps its physical model (fitted curves that generalise to unseen GPUs, models and shapes) and adds, for each
kernel shape profiled on a GPU, ``log(measured / physical)`` at every profiled M, interpolated linearly in
log M between the profiled token counts and held at the end values beyond them
(:class:`~kvbalance.specs.ShapeCorrection`, stored in the GPU's preset file). A shape is keyed by what the
kernel sees on one rank (:func:`gemm_key`, :func:`elementwise_key`) and the TP degree (the profiles time the
same kernel a few percent apart at different degrees: keyed by shape alone, the median leave-one-point-out
error of RMSNorm on the H100 is 3.5%, with the degree 1.8%), not by model, so two models that run the same
kernel at the same degree share its correction. Everything else (other GPUs, unprofiled shapes, attention, the
KV write) is the physical model exactly.

Cross-validation (the honest error of the corrected model; an interpolation on its own knots has none):
:func:`loo_point_log_ratio` predicts each profiled token count of a shape from its neighbours,
:func:`loo_group_log_ratio` a whole model's points from corrections learnt on the other models.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence

import numpy as np

from kvbalance.specs import ShapeCorrection

# Decimal places a fitted log ratio is stored with (1e-6 relative: far below the 1 us timer resolution).
LOG_RATIO_DIGITS = 6


def gemm_key(k: int, n: int, bias: bool, dtype_bytes: int) -> str:
    """Key of a weight GEMM [M x k] @ [k x n] (per rank), with or without a bias."""
    return f"gemm:{k}x{n}{'+bias' if bias else ''}:{8 * dtype_bytes}b"


def elementwise_key(curve: str, dims: Sequence[int], dtype_bytes: int) -> str:
    """Key of an element-wise kernel of class ``curve`` over rows of ``dims`` elements (per rank)."""
    return f"{curve}:{'x'.join(str(d) for d in dims)}:{8 * dtype_bytes}b"


class ShapeCorrections:
    """The corrections of one cost model's operators (resolved once per operator: the simulator's hot path
    asks :meth:`factor` for every operator of every step; answers are cached per token count)."""

    def __init__(self, corrections: Mapping[str, ShapeCorrection], keys: Mapping[str, str | None]) -> None:
        self._tables: dict[str, tuple[list[float], list[float]]] = {}
        for name, key in keys.items():
            c = corrections.get(key) if key is not None else None
            if c is not None:
                self._tables[name] = ([math.log(t) for t in c.tokens], list(c.log_ratio))
        self._cache: dict[tuple[str, float], float] = {}
        self._at: dict[float, dict[str, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._tables)

    def has(self, name: str) -> bool:
        return name in self._tables

    def at(self, tokens: float) -> dict[str, float]:
        """measured / physical of every corrected operator over ``tokens`` tokens (cached per token count)."""
        fs = self._at.get(tokens)
        if fs is None:
            fs = self._at[tokens] = {name: self.factor(name, tokens) for name in self._tables}
        return fs

    def factor(self, name: str, tokens: float) -> float:
        """measured / physical for operator ``name`` over ``tokens`` tokens (1 without a correction)."""
        key = (name, tokens)
        f = self._cache.get(key)
        if f is None:
            table = self._tables.get(name)
            f = 1.0 if table is None else math.exp(log_ratio_at(*table, math.log(max(tokens, 1.0))))
            self._cache[key] = f
        return f


def log_ratio_at(log_m: Sequence[float], log_r: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation of (``log_m``, ``log_r``) at ``x``, held at the end values outside."""
    if x <= log_m[0]:
        return log_r[0]
    if x >= log_m[-1]:
        return log_r[-1]
    i = bisect_right(log_m, x)
    x0, x1 = log_m[i - 1], log_m[i]
    return log_r[i - 1] + (log_r[i] - log_r[i - 1]) * (x - x0) / (x1 - x0)


def _knots(tokens: np.ndarray, log_ratio: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct token counts, the mean log ratio at each (geometric mean of repeated measurements) and each
    sample's knot index."""
    m, inv = np.unique(tokens, return_inverse=True)
    r = np.bincount(inv, weights=log_ratio) / np.bincount(inv)
    return m, r, inv


def _groups(keys: Sequence[str | None]) -> dict[str, np.ndarray]:
    out: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        if k is not None:
            out.setdefault(k, []).append(i)
    return {k: np.array(v) for k, v in out.items()}


def build_corrections(
    keys: Sequence[str | None], tokens: np.ndarray, log_ratio: np.ndarray
) -> dict[str, ShapeCorrection]:
    """One :class:`ShapeCorrection` per key from per-sample ``log(measured / physical)`` (samples keyed None
    have no profiled shape and are left to the physical model)."""
    tokens, log_ratio = np.asarray(tokens, dtype=float), np.asarray(log_ratio, dtype=float)
    out = {}
    for key, idx in sorted(_groups(keys).items()):
        m, r, _ = _knots(tokens[idx], log_ratio[idx])
        out[key] = ShapeCorrection(tuple(m), tuple(round(float(v), LOG_RATIO_DIGITS) for v in r))
    return out


def evaluate(
    corrections: Mapping[str, ShapeCorrection], keys: Sequence[str | None], tokens: np.ndarray
) -> np.ndarray:
    """The correction's log ratio at every sample (0 where its key has none): vectorised
    :meth:`ShapeCorrections.factor`, in logs."""
    tokens = np.maximum(np.asarray(tokens, dtype=float), 1.0)
    out = np.zeros(len(tokens))
    for key, idx in _groups(keys).items():
        c = corrections.get(key)
        if c is not None:
            out[idx] = np.interp(np.log(tokens[idx]), np.log(c.tokens), c.log_ratio)
    return out


def loo_point_log_ratio(keys: Sequence[str | None], tokens: np.ndarray, log_ratio: np.ndarray) -> np.ndarray:
    """Leave-one-point-out along M: each sample's correction interpolated from its shape's other token counts
    (every sample at its own token count left out); the ends take their neighbour's value (the hold beyond the
    profiled range), a shape profiled at one token count gets 0 (the physical model)."""
    tokens, log_ratio = np.asarray(tokens, dtype=float), np.asarray(log_ratio, dtype=float)
    out = np.zeros(len(tokens))
    for idx in _groups(keys).values():
        m, r, inv = _knots(tokens[idx], log_ratio[idx])
        if len(m) < 2:
            continue
        x = np.log(m)
        pred = np.empty_like(r)
        pred[0], pred[-1] = r[1], r[-2]
        if len(m) > 2:
            w = (x[1:-1] - x[:-2]) / (x[2:] - x[:-2])
            pred[1:-1] = r[:-2] + (r[2:] - r[:-2]) * w
        out[idx] = pred[inv]
    return out


def loo_group_log_ratio(
    keys: Sequence[str | None], tokens: np.ndarray, log_ratio: np.ndarray, groups: Sequence[str]
) -> np.ndarray:
    """Leave-one-group-out (groups: e.g. the model each sample was profiled on): each group's samples get the
    corrections learnt on the other groups' samples, where those share the shape, else 0 (physical)."""
    tokens, log_ratio = np.asarray(tokens, dtype=float), np.asarray(log_ratio, dtype=float)
    g = np.array(groups)
    keys_arr = np.array([k if k is not None else "" for k in keys], dtype=object)
    out = np.zeros(len(tokens))
    for name in dict.fromkeys(groups):
        held = g == name
        train = ~held
        table = build_corrections([k or None for k in keys_arr[train]], tokens[train], log_ratio[train])
        out[held] = evaluate(table, [k or None for k in keys_arr[held]], tokens[held])
    return out
