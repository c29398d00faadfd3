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

Where one kernel shape was profiled more than once at a token count (in several models, or both RMSNorms of a
layer), its knot is the log mean of the measured ratios, kept within ``KNOT_BAND`` of every one of them, or at
the minimax ratio 2 r_max r_min / (r_max + r_min) where they spread further: the one value whose worst
relative error over the repeats is the data's own floor (:mod:`kvbalance.perf.fit_floor`).

cuBLAS picks a GEMM kernel by the M tile it ends in, so the measured / physical ratio steps where M crosses a
tile boundary (x1.8-2.8 from M = 512 to 520 on the H100). A correction with ``tile_tokens`` > 0 interpolates
only between the knots of M's tile bucket, ceil(M / tile_tokens) (held at the bucket's end knots; a bucket with
one knot holds it); where M's bucket has no knot it falls back to the interpolation over every knot, which is
also the rule of a correction with ``tile_tokens`` = 0 (presets written before the field existed).

Cross-validation (the honest error of the corrected model; an interpolation on its own knots has none):
:func:`loo_point_log_ratio` predicts each profiled token count of a shape from its neighbours,
:func:`loo_group_log_ratio` a whole model's points from corrections learnt on the other models.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence

import numpy as np

from kvbalance.specs import ShapeCorrection

# Decimal places a fitted log ratio is stored with (1e-6 relative: far below the 1 us timer resolution).
LOG_RATIO_DIGITS = 6
# A repeated knot keeps its measurements' log mean while that is within this relative error of every repeat
# (else it moves to the nearest ratio that is, or to the minimax ratio where none is: :func:`knot_log_ratio`).
# Measured on the H100 and A40 profiles against 0 (the minimax ratio everywhere: the log mean's median
# leave-one-point-out error of RMSNorm on the H100, 1.83%, rises to 2.07%) and 2-15%: 10% keeps the log
# mean's medians and reaches the minimax worst case on the training points (residual add 59% -> 33%).
KNOT_BAND = 0.10


def gemm_key(k: int, n: int, bias: bool, dtype_bytes: int) -> str:
    """Key of a weight GEMM [M x k] @ [k x n] (per rank), with or without a bias."""
    return f"gemm:{k}x{n}{'+bias' if bias else ''}:{8 * dtype_bytes}b"


def elementwise_key(curve: str, dims: Sequence[int], dtype_bytes: int) -> str:
    """Key of an element-wise kernel of class ``curve`` over rows of ``dims`` elements (per rank)."""
    return f"{curve}:{'x'.join(str(d) for d in dims)}:{8 * dtype_bytes}b"


def key_class(key: str) -> str:
    """The operator class a kernel key belongs to: "gemm" or the element-wise class (its first field)."""
    return key.split(":", 1)[0]


def tile_bucket(tokens: np.ndarray | float, tile_tokens: int) -> np.ndarray:
    """The M tile bucket ceil(M / ``tile_tokens``) of each token count (M < 1 counts as 1): the buckets are
    (0, t], (t, 2t], ..., so M = 512 ends tile 4 of 128 rows and M = 520 starts tile 5."""
    return np.ceil(np.maximum(np.asarray(tokens, dtype=float), 1.0) / tile_tokens).astype(np.int64)


class _Table:
    """One operator's correction, ready for scalar lookups (the simulator's hot path)."""

    def __init__(self, c: ShapeCorrection) -> None:
        self.log_m = [math.log(t) for t in c.tokens]
        self.log_r = list(c.log_ratio)
        self.tile = c.tile_tokens
        self.buckets = (
            [int(b) for b in tile_bucket(np.array(c.tokens), c.tile_tokens)] if c.tile_tokens else []
        )

    def at(self, tokens: float) -> float:
        """The log ratio over ``tokens`` tokens (:func:`log_ratio_at` within M's tile bucket)."""
        x = math.log(max(tokens, 1.0))
        if self.tile:
            b = int(tile_bucket(tokens, self.tile))
            lo, hi = bisect_left(self.buckets, b), bisect_right(self.buckets, b)
            if hi > lo:
                x = min(max(x, self.log_m[lo]), self.log_m[hi - 1])
        return log_ratio_at(self.log_m, self.log_r, x)


class ShapeCorrections:
    """The corrections of one cost model's operators (resolved once per operator: the simulator's hot path
    asks :meth:`factor` for every operator of every step; answers are cached per token count)."""

    def __init__(self, corrections: Mapping[str, ShapeCorrection], keys: Mapping[str, str | None]) -> None:
        self._tables: dict[str, _Table] = {}
        for name, key in keys.items():
            c = corrections.get(key) if key is not None else None
            if c is not None:
                self._tables[name] = _Table(c)
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
            f = 1.0 if table is None else math.exp(table.at(tokens))
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


def knot_log_ratio(lo: np.ndarray, hi: np.ndarray, mean: np.ndarray, band: float = KNOT_BAND) -> np.ndarray:
    """One knot's log ratio from its repeated measurements: their log mean ``mean``, clipped into the band of
    ratios p whose worst relative error over them is at most b = max(floor, ``band``), [r_max (1 - b),
    r_min (1 + b)] (``lo`` = log r_min, ``hi`` = log r_max; floor = (r_max - r_min) / (r_max + r_min) =
    tanh((hi - lo) / 2), :func:`kvbalance.perf.fit_floor.minimax_floor`). Where the floor exceeds ``band`` the
    band is the single minimax ratio 2 r_max r_min / (r_max + r_min); ``band`` = 0 gives it everywhere."""
    b = np.maximum(np.tanh((hi - lo) / 2.0), band)
    a, z = hi + np.log1p(-b), lo + np.log1p(b)
    return np.clip(mean, np.minimum(a, z), np.maximum(a, z))


def _knots(tokens: np.ndarray, log_ratio: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct token counts, the knot's log ratio at each (:func:`knot_log_ratio` of the measurements there)
    and each sample's knot index."""
    m, inv = np.unique(tokens, return_inverse=True)
    mean = np.bincount(inv, weights=log_ratio) / np.bincount(inv)
    lo = np.full(len(m), np.inf)
    hi = np.full(len(m), -np.inf)
    np.minimum.at(lo, inv, log_ratio)
    np.maximum.at(hi, inv, log_ratio)
    return m, knot_log_ratio(lo, hi, mean), inv


def _groups(keys: Sequence[str | None]) -> dict[str, np.ndarray]:
    out: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        if k is not None:
            out.setdefault(k, []).append(i)
    return {k: np.array(v) for k, v in out.items()}


def build_corrections(
    keys: Sequence[str | None],
    tokens: np.ndarray,
    log_ratio: np.ndarray,
    tiles: Mapping[str, int] | None = None,
) -> dict[str, ShapeCorrection]:
    """One :class:`ShapeCorrection` per key from per-sample ``log(measured / physical)`` (samples keyed None
    have no profiled shape and are left to the physical model); ``tiles`` maps a :func:`key_class` to its
    corrections' ``tile_tokens`` (a class left out: 0, one interpolation over every knot)."""
    tokens, log_ratio = np.asarray(tokens, dtype=float), np.asarray(log_ratio, dtype=float)
    tiles = tiles or {}
    out = {}
    for key, idx in sorted(_groups(keys).items()):
        m, r, _ = _knots(tokens[idx], log_ratio[idx])
        out[key] = ShapeCorrection(
            tuple(m), tuple(round(float(v), LOG_RATIO_DIGITS) for v in r), tiles.get(key_class(key), 0)
        )
    return out


def evaluate_one(c: ShapeCorrection, tokens: np.ndarray) -> np.ndarray:
    """``c``'s log ratio at each token count (vectorised :class:`ShapeCorrections` lookup): the log M of a
    query is clipped to the range of its tile bucket's knots where the bucket has any, then interpolated."""
    tokens = np.maximum(np.asarray(tokens, dtype=float), 1.0)
    x, xm = np.log(tokens), np.log(c.tokens)
    if c.tile_tokens:
        kb = tile_bucket(np.array(c.tokens), c.tile_tokens)
        qb = tile_bucket(tokens, c.tile_tokens)
        lo, hi = np.searchsorted(kb, qb, "left"), np.searchsorted(kb, qb, "right")
        inside = np.clip(x, xm[np.minimum(lo, len(xm) - 1)], xm[np.maximum(hi - 1, 0)])
        x = np.where(hi > lo, inside, x)
    return np.interp(x, xm, c.log_ratio)


def evaluate(
    corrections: Mapping[str, ShapeCorrection], keys: Sequence[str | None], tokens: np.ndarray
) -> np.ndarray:
    """The correction's log ratio at every sample (0 where its key has none): vectorised
    :meth:`ShapeCorrections.factor`, in logs."""
    tokens = np.asarray(tokens, dtype=float)
    out = np.zeros(len(tokens))
    for key, idx in _groups(keys).items():
        c = corrections.get(key)
        if c is not None:
            out[idx] = evaluate_one(c, tokens[idx])
    return out


def _loo_knots(m: np.ndarray, r: np.ndarray, tile_tokens: int) -> np.ndarray:
    """Each knot's log ratio predicted from the others by the rule of :func:`evaluate_one`: from its
    neighbours in its tile bucket (interpolated between two, held from one), else across the buckets (between
    its two neighbours, or the one neighbour of an end knot)."""
    x = np.log(m)
    pred = np.empty_like(r)
    pred[0], pred[-1] = r[1], r[-2]
    if len(m) > 2:
        w = (x[1:-1] - x[:-2]) / (x[2:] - x[:-2])
        pred[1:-1] = r[:-2] + (r[2:] - r[:-2]) * w
    if not tile_tokens:
        return pred
    b = tile_bucket(m, tile_tokens)
    left = np.r_[False, b[1:] == b[:-1]]  # the knot's left neighbour is in its bucket
    right = np.r_[b[:-1] == b[1:], False]
    pred = np.where(left & ~right, np.r_[np.nan, r[:-1]], pred)
    return np.where(right & ~left, np.r_[r[1:], np.nan], pred)


def loo_point_log_ratio(
    keys: Sequence[str | None],
    tokens: np.ndarray,
    log_ratio: np.ndarray,
    tiles: Mapping[str, int] | None = None,
) -> np.ndarray:
    """Leave-one-point-out along M: each sample's correction predicted from its shape's other token counts
    (every sample at its own token count left out; ``tiles`` as in :func:`build_corrections`, the rule of
    :func:`_loo_knots`), a shape profiled at one token count gets 0 (the physical model)."""
    tokens, log_ratio = np.asarray(tokens, dtype=float), np.asarray(log_ratio, dtype=float)
    tiles = tiles or {}
    out = np.zeros(len(tokens))
    for key, idx in _groups(keys).items():
        m, r, inv = _knots(tokens[idx], log_ratio[idx])
        if len(m) >= 2:
            out[idx] = _loo_knots(m, r, tiles.get(key_class(key), 0))[inv]
    return out


def loo_group_log_ratio(
    keys: Sequence[str | None],
    tokens: np.ndarray,
    log_ratio: np.ndarray,
    groups: Sequence[str],
    tiles: Mapping[str, int] | None = None,
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
        table = build_corrections(
            [k or None for k in keys_arr[train]], tokens[train], log_ratio[train], tiles
        )
        out[held] = evaluate(table, [k or None for k in keys_arr[held]], tokens[held])
    return out
