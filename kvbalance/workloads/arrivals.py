"""Seeded arrival-time generators: Poisson, Gamma (bursty by coefficient of variation), constant, all at zero.

Every generator returns ``n`` non-decreasing arrival times in seconds, the first at 0, so ``n`` requests span
``n - 1`` inter-arrival gaps. ``rate == inf`` puts every request at time 0 (an offline batch).
"""

from __future__ import annotations

import math

import numpy as np

ARRIVAL_KINDS = ("poisson", "gamma", "constant")


def as_rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    """A numpy Generator from a Generator, an int seed, or None (seed 0, so runs stay reproducible)."""
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(0 if rng is None else rng)


def _check(rate: float, n: int) -> None:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or math.isnan(rate) or rate <= 0:
        raise ValueError(f"rate: must be > 0 requests/s (inf = all at time 0), got {rate!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n: must be an int >= 0, got {n!r}")


def _from_gaps(gaps: np.ndarray) -> np.ndarray:
    out = np.zeros(len(gaps) + 1, dtype=np.float64)
    np.cumsum(gaps, out=out[1:])
    return out


def all_at_zero(n: int) -> np.ndarray:
    """``n`` requests all arriving at time 0."""
    _check(math.inf, n)
    return np.zeros(n, dtype=np.float64)


def poisson(rate: float, n: int, rng: np.random.Generator | int | None = None) -> np.ndarray:
    """Poisson process: exponential gaps with mean ``1 / rate`` seconds."""
    _check(rate, n)
    if math.isinf(rate) or n == 0:
        return np.zeros(n, dtype=np.float64)
    return _from_gaps(as_rng(rng).exponential(1.0 / rate, size=n - 1))


def gamma(rate: float, cv: float, n: int, rng: np.random.Generator | int | None = None) -> np.ndarray:
    """Gamma renewal process with mean gap ``1 / rate`` and gap coefficient of variation ``cv``.

    shape = 1 / cv^2, scale = 1 / (rate * shape); cv = 1 is Poisson, cv > 1 is burstier, cv < 1 smoother.
    """
    _check(rate, n)
    if isinstance(cv, bool) or not isinstance(cv, (int, float)) or not math.isfinite(cv) or cv <= 0:
        raise ValueError(f"cv: must be a finite number > 0, got {cv!r}")
    if math.isinf(rate) or n == 0:
        return np.zeros(n, dtype=np.float64)
    shape = 1.0 / cv**2
    scale = 1.0 / (rate * shape)
    return _from_gaps(as_rng(rng).gamma(shape, scale, size=n - 1))


def constant(rate: float, n: int) -> np.ndarray:
    """Evenly spaced arrivals ``1 / rate`` seconds apart (a deterministic load, cv = 0)."""
    _check(rate, n)
    if math.isinf(rate):
        return np.zeros(n, dtype=np.float64)
    return np.arange(n, dtype=np.float64) / rate


def arrival_times(
    kind: str, rate: float, n: int, rng: np.random.Generator | int | None = None, cv: float = 1.0
) -> np.ndarray:
    """Dispatch by name: ``poisson``, ``gamma`` (uses ``cv``) or ``constant``."""
    if kind == "poisson":
        return poisson(rate, n, rng)
    if kind == "gamma":
        return gamma(rate, cv, n, rng)
    if kind == "constant":
        return constant(rate, n)
    raise ValueError(f"arrival: unknown arrival process {kind!r}; expected one of {', '.join(ARRIVAL_KINDS)}")
