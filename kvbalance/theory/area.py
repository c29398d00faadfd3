"""The memory-time area of the queueing-stability paper: g(s, o), the KV memory a request (s prompt tokens,
o output tokens, prefill in chunks of s_hat) holds integrated over batch steps, and its expectation E[g(s, o)]
over prompt and output length distributions (exact for known pmfs, Monte Carlo otherwise, or the exact mean
over paired per-request lengths). ``stability.py`` turns E[g] into the stable service rate mu.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------------------------------------
# g(s, o): the memory-time area of one request
# ---------------------------------------------------------------------------------------------------------


def _as_int_array(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or np.any(arr != np.rint(arr)):
            raise ValueError(f"{name} must hold whole token counts, got non-integer values")
        arr = arr.astype(np.int64)
    elif arr.dtype.kind not in "iub":
        raise ValueError(f"{name} must be integer token counts, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if np.any(arr < 0):
        raise ValueError(f"{name} must be non-negative token counts")
    return arr


def prefill_area(s: Any, chunk_size: int) -> np.ndarray:
    """Prefill part of g: sum_{k=1}^{ceil(s/s_hat)} min(k * s_hat, s), in token x batch-steps.

    The paper writes sum_{k=1}^{s/s_hat} k * s_hat, which assumes s_hat divides s. With n = ceil(s/s_hat)
    every chunk but the last is full (k * s_hat < s for k < n) and the last one brings the total to s, so
    the sum is s_hat * n(n-1)/2 + s; when s_hat divides s this equals the paper's s_hat * n(n+1)/2.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    s = _as_int_array(s, "s")
    n = -(-s // chunk_size)  # ceil(s / s_hat), exact in integers
    return chunk_size * (n * (n - 1) // 2) + s


def decode_area(s: Any, o: Any) -> np.ndarray:
    """Decode part of g: sum_{j=1}^{o} (s + j) = o*s + o(o+1)/2 (closed form, exact in integers)."""
    s = _as_int_array(s, "s")
    o = _as_int_array(o, "o")
    return o * s + o * (o + 1) // 2


def memory_time_area(s: Any, o: Any, chunk_size: int) -> np.ndarray | int:
    """g(s, o) = sum_{k=1}^{ceil(s/s_hat)} min(k s_hat, s) + sum_{j=1}^{o} (s + j), vectorised.

    Exact int64 arithmetic (valid while g < 2^63, i.e. lengths up to ~10^9 tokens). Scalars in, int out;
    arrays in, an int64 array of the broadcast shape out.
    """
    g = prefill_area(s, chunk_size) + decode_area(s, o)
    return int(g) if g.ndim == 0 else g


# ---------------------------------------------------------------------------------------------------------
# Length distributions (duck-typed)
# ---------------------------------------------------------------------------------------------------------


def _exact_pmf(dist: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """(values, probs) when the distribution is discrete and fully known, else None.

    Accepted: an int (point mass), a 1-D array/list of samples (empirical), a (values, probs) tuple, an
    object with `values` and `probs`, or an object with only `values` (equally likely samples).
    """
    if isinstance(dist, tuple) and len(dist) == 2:
        values, probs = dist
    elif isinstance(dist, (int, np.integer)):
        values, probs = np.array([dist]), np.array([1.0])
    elif isinstance(dist, (list, np.ndarray)):
        values, counts = np.unique(_as_int_array(dist, "samples").ravel(), return_counts=True)
        probs = counts / counts.sum()
    elif hasattr(dist, "values") and not callable(dist.values):
        values = dist.values
        probs = getattr(dist, "probs", None)
        if probs is None:
            probs = np.full(len(values), 1.0 / len(values))
    else:
        return None
    values = _as_int_array(values, "values").ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if values.shape != probs.shape or values.size == 0:
        raise ValueError("a (values, probs) distribution needs two non-empty arrays of equal length")
    if np.any(probs < 0) or not math.isclose(float(probs.sum()), 1.0, rel_tol=1e-9):
        raise ValueError("probs must be non-negative and sum to 1")
    return values, probs


def _draw(dist: Any, rng: np.random.Generator, n: int) -> np.ndarray:
    pmf = _exact_pmf(dist)
    if pmf is not None:
        return rng.choice(pmf[0], size=n, p=pmf[1])
    if not hasattr(dist, "sample"):
        raise TypeError(f"length distribution {dist!r} has neither values/probs nor .sample(rng, n)")
    x = np.asarray(dist.sample(rng, n))
    # Continuous samplers (e.g. a log-normal) may return floats: round to whole tokens.
    return np.maximum(np.rint(x), 0).astype(np.int64) if x.dtype.kind == "f" else x.astype(np.int64)


@dataclass(frozen=True)
class _Moments:
    """The marginal moments E[g] needs when s and o are independent, plus the largest value seen."""

    mean: float  # E[x]
    mean_sq: float  # E[x^2]
    mean_prefill: float  # E[f(x)], f = prefill_area (only meaningful for the input length)
    max: int  # ess sup for exact pmfs, sample max for Monte Carlo
    exact: bool


def _moments(dist: Any, chunk_size: int, rng: np.random.Generator, n_samples: int, exact: bool) -> _Moments:
    pmf = _exact_pmf(dist) if exact else None
    if pmf is not None:
        values, probs = pmf
        x = values.astype(np.float64)
        f = prefill_area(values, chunk_size).astype(np.float64)
        return _Moments(
            float(probs @ x), float(probs @ (x * x)), float(probs @ f), int(values[probs > 0].max()), True
        )
    x_int = _draw(dist, rng, n_samples)
    x = x_int.astype(np.float64)
    f = prefill_area(x_int, chunk_size).astype(np.float64)
    return _Moments(float(x.mean()), float((x * x).mean()), float(f.mean()), int(x_int.max()), False)


@dataclass(frozen=True)
class AreaStats:
    """E[g(s, o)] with the inputs that produced it."""

    expected_area: float  # E[g(s, o)], token x batch-steps
    mean_input_tokens: float  # E[s]
    mean_output_tokens: float  # E[o]
    max_total_tokens: int  # ess sup(s + o): exact for known pmfs, the sample max under Monte Carlo
    exact: bool  # True when no Monte Carlo was involved


def area_stats(
    input_dist: Any,
    output_dist: Any,
    chunk_size: int,
    *,
    exact: bool = True,
    paired: bool = False,
    n_samples: int = 200_000,
    seed: int = 0,
) -> AreaStats:
    """E[g(s, o)] and the length statistics the stability check needs; see `expected_area`."""
    if paired:
        s = _as_int_array(input_dist, "input lengths").ravel()
        o = _as_int_array(output_dist, "output lengths").ravel()
        if s.shape != o.shape or s.size == 0:
            raise ValueError("paired (s_i, o_i) samples need two non-empty arrays of equal length")
        g = memory_time_area(s, o, chunk_size)
        # Exact mean over the pairs: integer sum, one division.
        return AreaStats(int(np.sum(g)) / s.size, float(s.mean()), float(o.mean()), int((s + o).max()), True)
    if n_samples <= 0:
        raise ValueError(f"n_samples must be positive, got {n_samples}")
    rng = np.random.default_rng(seed)
    if not exact:
        s, o = _draw(input_dist, rng, n_samples), _draw(output_dist, rng, n_samples)
        g = memory_time_area(s, o, chunk_size)
        return AreaStats(float(np.mean(g)), float(s.mean()), float(o.mean()), int((s + o).max()), False)
    ms = _moments(input_dist, chunk_size, rng, n_samples, exact=True)
    mo = _moments(output_dist, chunk_size, rng, n_samples, exact=True)
    # s and o independent: E[g] = E[f(s)] + E[s]E[o] + (E[o^2] + E[o]) / 2, from
    # g = f(s) + o*s + o(o+1)/2 with f the prefill sum. Exact pmfs give exact moments; any marginal without
    # one is estimated by Monte Carlo, which is still lower variance than sampling g itself.
    eg = ms.mean_prefill + ms.mean * mo.mean + (mo.mean_sq + mo.mean) / 2
    return AreaStats(eg, ms.mean, mo.mean, ms.max + mo.max, ms.exact and mo.exact)


def expected_area(
    input_dist: Any,
    output_dist: Any,
    chunk_size: int,
    *,
    exact: bool = True,
    paired: bool = False,
    n_samples: int = 200_000,
    seed: int = 0,
) -> float:
    """E[g(s, o)] for independent prompt and output length distributions.

    A distribution is an int, an array of observed lengths, a (values, probs) tuple, an object with
    `values`/`probs` (e.g. `workloads.lengths.Uniform`, `Empirical`), or anything with `.sample(rng, n)`. With
    `exact=True` discrete marginals are used exactly and the rest by Monte Carlo (`n_samples`, `seed`);
    `exact=False` samples g directly. `paired=True` takes two equal-length arrays of per-request
    (s_i, o_i) lengths (a trace) and returns the exact mean of g over the pairs, with no independence
    assumption.
    """
    return area_stats(
        input_dist, output_dist, chunk_size, exact=exact, paired=paired, n_samples=n_samples, seed=seed
    ).expected_area
