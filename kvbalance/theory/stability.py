"""Queueing stability of LLM inference under a KV memory limit, and the capacity planner built on it.

Implements the queueing-theory stability paper: a request (s prompt tokens, o output tokens, prefill in
chunks of s_hat) occupies KV memory whose integral over batch steps is g(s, o); with KV capacity M tokens
and batch time b seconds per step the largest stable arrival rate is mu = M / (b * E[g(s, o)]). The system
is unstable for lambda > mu and stable for lambda < mu * (1 - delta), delta = ess sup(s + o) / M.
g(s, o) and E[g] are computed in ``area.py`` (re-exported here); this module holds mu, delta, the verdict,
the batch time estimators, the instance count and the capacity report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from kvbalance.theory.area import AreaStats as AreaStats
from kvbalance.theory.area import area_stats
from kvbalance.theory.area import decode_area as decode_area
from kvbalance.theory.area import expected_area as expected_area
from kvbalance.theory.area import memory_time_area as memory_time_area
from kvbalance.theory.area import prefill_area as prefill_area

Verdict = bool | Literal["margin"]

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
