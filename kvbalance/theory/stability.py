"""Queueing stability of LLM inference under a KV memory limit, and the capacity planner built on it.

Implements the queueing-theory stability paper: a request (s prompt tokens, o output tokens, prefill in
chunks of s_hat) occupies KV memory whose integral over batch steps is g(s, o); with KV capacity M tokens
and batch time b seconds per step the largest stable arrival rate is mu = M / (b * E[g(s, o)]). The system
is unstable for lambda > mu and stable for lambda < mu * (1 - delta), delta = ess sup(s + o) / M.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

Verdict = bool | Literal["margin"]

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


# ---------------------------------------------------------------------------------------------------------
# Service rate, margin, verdict
# ---------------------------------------------------------------------------------------------------------


def _positive(value: float, name: str) -> float:
    if not (isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def stable_service_rate(kv_capacity_tokens: float, batch_time_s: float, expected_area: float) -> float:
    """mu = M / (b * E[g(s, o)]) in requests per second: the paper's maximum stable service rate."""
    m = _positive(kv_capacity_tokens, "kv_capacity_tokens")
    b = _positive(batch_time_s, "batch_time_s")
    eg = _positive(expected_area, "expected_area")
    return m / (b * eg)


def stability_margin(max_total_tokens: float, kv_capacity_tokens: float) -> float:
    """delta = ess sup(s + o) / M: the share of memory one request can hold at its largest."""
    m = _positive(kv_capacity_tokens, "kv_capacity_tokens")
    if not (math.isfinite(max_total_tokens) and max_total_tokens >= 0):
        raise ValueError(f"max_total_tokens must be a non-negative finite number, got {max_total_tokens!r}")
    if max_total_tokens > m:
        raise ValueError(
            f"max_total_tokens={max_total_tokens} exceeds kv_capacity_tokens={m}: "
            "the largest request can never fit in KV memory"
        )
    return max_total_tokens / m


def stability_verdict(rate: float, mu: float, delta: float) -> Verdict:
    """True if lambda < mu(1 - delta) (stable), False if lambda >= mu, "margin" in between.

    The paper proves instability for lambda > mu; at lambda = mu (critical load) the queue is not positive
    recurrent either, so it counts as not stable.
    """
    if not (math.isfinite(rate) and rate >= 0):
        raise ValueError(f"rate must be a non-negative finite number of requests/s, got {rate!r}")
    _positive(mu, "mu")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must lie in [0, 1], got {delta!r}")
    if rate >= mu:
        return False
    if rate < mu * (1 - delta):
        return True
    return "margin"


def batch_time_estimate(
    step_times: Sequence[float] | np.ndarray,
    method: Literal["median", "trimmed_mean"] = "median",
    trim: float = 0.1,
) -> float:
    """Representative batch time b from measured step durations (seconds).

    The paper uses the median measured batch time; a trimmed mean (drop `trim` of the samples at each
    end, 10% by default) is the alternative for heavy-tailed step times.
    """
    t = np.asarray(step_times, dtype=np.float64).ravel()
    if t.size == 0:
        raise ValueError("step_times is empty")
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError("step_times must be non-negative finite durations in seconds")
    if method == "median":
        return float(np.median(t))
    if method == "trimmed_mean":
        if not 0 <= trim < 0.5:
            raise ValueError(f"trim must lie in [0, 0.5), got {trim!r}")
        k = int(trim * t.size)
        return float(np.sort(t)[k : t.size - k].mean())
    raise ValueError(f"method must be 'median' or 'trimmed_mean', got {method!r}")


def representative_batch_time(
    step_times: Sequence[float] | np.ndarray,
    method: Literal["auto", "median", "trimmed_mean", "mean"] = "auto",
    skew_tolerance: float = 0.1,
) -> tuple[float, str]:
    """b and the estimator that produced it, following the paper's rule for choosing one.

    The paper takes the median batch time, and a 10%-trimmed mean when step times are heavy-tailed.
    ``auto`` applies that rule with a fixed test: right skew, i.e. the mean exceeding the median by more
    than ``skew_tolerance`` (10%), selects the trimmed mean, otherwise the median. ``mean`` (the plain
    average, which converts a count of batch steps into seconds exactly) is offered for comparison.
    """
    t = np.asarray(step_times, dtype=np.float64).ravel()
    if method == "mean":
        batch_time_estimate(t)  # validates
        return float(t.mean()), "mean"
    if method in ("median", "trimmed_mean"):
        return batch_time_estimate(t, method), method
    if method != "auto":
        raise ValueError(f"method must be 'auto', 'median', 'trimmed_mean' or 'mean', got {method!r}")
    if not skew_tolerance >= 0:
        raise ValueError(f"skew_tolerance must be >= 0, got {skew_tolerance!r}")
    median = batch_time_estimate(t, "median")
    if float(t.mean()) > (1 + skew_tolerance) * median:
        return batch_time_estimate(t, "trimmed_mean"), "trimmed_mean"
    return median, "median"


def instances_needed(rate: float, mu: float, delta: float, headroom: float = 0.0) -> int:
    """Smallest n >= 1 with rate / n < mu (1 - delta)(1 - headroom).

    Load balancing gives each of n instances rate / n; the stable region of one instance is
    lambda < mu (1 - delta), shrunk by an optional `headroom` fraction for safety.
    """
    if not (math.isfinite(rate) and rate >= 0):
        raise ValueError(f"rate must be a non-negative finite number of requests/s, got {rate!r}")
    _positive(mu, "mu")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must lie in [0, 1], got {delta!r}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must lie in [0, 1), got {headroom!r}")
    bound = mu * (1 - delta) * (1 - headroom)
    if bound <= 0:
        raise ValueError("delta = 1: one request can fill KV memory, no instance count guarantees stability")
    n = max(1, math.floor(rate / bound) + 1)
    # Guard the floating-point edge: make n the smallest integer satisfying the strict inequality.
    while n > 1 and rate / (n - 1) < bound:
        n -= 1
    while not rate / n < bound:
        n += 1
    return n


# ---------------------------------------------------------------------------------------------------------
# Capacity report
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CapacityReport:
    """The stability check for one instance configuration, with every formula input."""

    kv_capacity_tokens: int  # M
    chunk_size: int  # s_hat
    b_s: float  # representative batch time b, seconds per step
    expected_area: float  # E[g(s, o)], token x batch-steps
    mean_input_tokens: float  # E[s]
    mean_output_tokens: float  # E[o]
    max_total_tokens: int  # ess sup(s + o)
    mu_rps: float  # M / (b E[g])
    delta: float  # ess sup(s + o) / M
    stable_bound_rps: float  # mu (1 - delta): below this, guaranteed stable
    rate_rps: float | None  # offered lambda, if given
    stable: Verdict | None  # verdict for rate_rps on one instance
    instances_needed: int | None  # smallest n with rate / n < mu (1 - delta)(1 - headroom)
    headroom: float
    area_exact: bool  # False when E[g] came from Monte Carlo

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def capacity_report(
    input_dist: Any,
    output_dist: Any,
    *,
    kv_capacity_tokens: int,
    chunk_size: int,
    batch_time_s: float,
    rate_rps: float | None = None,
    max_total_tokens: int | None = None,
    headroom: float = 0.0,
    paired: bool = False,
    n_samples: int = 200_000,
    seed: int = 0,
) -> CapacityReport:
    """Compute E[g], mu, delta and the verdict for one instance.

    `max_total_tokens` overrides ess sup(s + o) (e.g. the model's max context), which is otherwise exact
    for discrete distributions and the sample maximum for Monte Carlo ones.
    """
    stats = area_stats(input_dist, output_dist, chunk_size, paired=paired, n_samples=n_samples, seed=seed)
    ess_sup = stats.max_total_tokens if max_total_tokens is None else int(max_total_tokens)
    mu = stable_service_rate(kv_capacity_tokens, batch_time_s, stats.expected_area)
    delta = stability_margin(ess_sup, kv_capacity_tokens)
    stable = n = None
    if rate_rps is not None:
        stable = stability_verdict(rate_rps, mu, delta)
        n = instances_needed(rate_rps, mu, delta, headroom)
    return CapacityReport(
        kv_capacity_tokens=int(kv_capacity_tokens),
        chunk_size=int(chunk_size),
        b_s=float(batch_time_s),
        expected_area=stats.expected_area,
        mean_input_tokens=stats.mean_input_tokens,
        mean_output_tokens=stats.mean_output_tokens,
        max_total_tokens=ess_sup,
        mu_rps=mu,
        delta=delta,
        stable_bound_rps=mu * (1 - delta),
        rate_rps=None if rate_rps is None else float(rate_rps),
        stable=stable,
        instances_needed=n,
        headroom=headroom,
        area_exact=stats.exact,
    )
