"""Token-length distributions for prompts and outputs, with exact pmfs for expectations such as E[g(s, o)].

Each distribution is over positive integers: ``sample(rng, n)`` draws int64 lengths, ``values``/``probs`` give
the exact pmf (what the queueing-theory module sums over), ``mean()`` is exact. ``JointLengths`` and
``PairedLengths`` describe the (input, output) pair of a workload, including a cap on their total.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

_erf = np.vectorize(math.erf, otypes=[np.float64])
MAX_PMF_SUPPORT = 1 << 22  # largest support enumerated for an exact pmf
_EXPECT_CHUNK = 1 << 21  # grid cells evaluated at once by JointLengths.expect


def _check_len(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: must be an int >= {minimum}, got {value!r}")
    return int(value)


class LengthDistribution:
    """Base class: subclasses implement ``sample`` and ``pmf``."""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError

    def pmf(self) -> tuple[np.ndarray, np.ndarray]:
        """(values, probs): sorted int64 support and its probabilities (summing to 1)."""
        raise NotImplementedError

    @property
    def values(self) -> np.ndarray:
        return self.pmf()[0]

    @property
    def probs(self) -> np.ndarray:
        return self.pmf()[1]

    def mean(self) -> float:
        v, p = self.pmf()
        return float(np.dot(v.astype(np.float64), p))

    def median(self) -> int:
        v, p = self.pmf()
        return int(v[np.searchsorted(np.cumsum(p), 0.5)])

    def expect(self, f: Callable[[np.ndarray], np.ndarray]) -> float:
        """E[f(X)] for a vectorised ``f``."""
        v, p = self.pmf()
        return float(np.dot(np.asarray(f(v), dtype=np.float64), p))

    @property
    def max_value(self) -> int:
        return int(self.values[-1])


@dataclass(frozen=True)
class Fixed(LengthDistribution):
    """Always ``value`` tokens."""

    value: int

    def __post_init__(self) -> None:
        _check_len("value", self.value)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)

    def pmf(self) -> tuple[np.ndarray, np.ndarray]:
        return np.array([self.value], dtype=np.int64), np.array([1.0])


@dataclass(frozen=True)
class Uniform(LengthDistribution):
    """Uniform over the integers ``lo..hi`` inclusive."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        _check_len("lo", self.lo)
        _check_len("hi", self.hi)
        if self.hi < self.lo:
            raise ValueError(f"hi: must be >= lo ({self.lo}), got {self.hi}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.lo, self.hi, size=n, endpoint=True, dtype=np.int64)

    def pmf(self) -> tuple[np.ndarray, np.ndarray]:
        v = np.arange(self.lo, self.hi + 1, dtype=np.int64)
        return v, np.full(len(v), 1.0 / len(v))

    def mean(self) -> float:
        return (self.lo + self.hi) / 2.0


@dataclass(frozen=True)
class LogNormal(LengthDistribution):
    """round(exp(N(mu, sigma^2))) clipped to [min_len, max_len] (max_len None = unbounded).

    ``from_mean_median`` fits mu = ln(median), sigma = sqrt(2 ln(mean / median)) (mean = exp(mu + sigma^2/2));
    ``fit_clipped`` instead solves sigma so the *clipped* distribution has the given mean, which matters
    when the data the moments came from were already filtered to a maximum length.
    """

    mu: float
    sigma: float
    min_len: int = 1
    max_len: int | None = None
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not math.isfinite(self.mu):
            raise ValueError(f"mu: must be finite, got {self.mu!r}")
        if not math.isfinite(self.sigma) or self.sigma < 0:
            raise ValueError(f"sigma: must be finite and >= 0, got {self.sigma!r}")
        _check_len("min_len", self.min_len)
        if self.max_len is not None:
            _check_len("max_len", self.max_len)
            if self.max_len < self.min_len:
                raise ValueError(f"max_len: must be >= min_len ({self.min_len}), got {self.max_len}")

    @classmethod
    def from_mean_median(
        cls, mean: float, median: float, min_len: int = 1, max_len: int | None = None
    ) -> LogNormal:
        if not (math.isfinite(median) and median > 0):
            raise ValueError(f"median: must be > 0, got {median!r}")
        if not (math.isfinite(mean) and mean >= median):
            raise ValueError(f"mean: a lognormal needs mean >= median ({median}), got {mean!r}")
        return cls(math.log(median), math.sqrt(2.0 * math.log(mean / median)), min_len, max_len)

    @classmethod
    def fit_clipped(cls, mean: float, median: float, min_len: int, max_len: int) -> LogNormal:
        """mu = ln(median) and the sigma whose clipped, rounded distribution has exactly ``mean``."""
        base = cls.from_mean_median(mean, median, min_len, max_len)
        lo, hi = base.sigma, max(base.sigma, 1e-3)
        while cls(base.mu, hi, min_len, max_len).mean() < mean:
            lo, hi = hi, hi * 2.0
            if hi > 64:
                raise ValueError(
                    f"mean: {mean} is out of reach for median {median} clipped to [{min_len}, {max_len}]"
                )
        for _ in range(60):
            mid = (lo + hi) / 2.0
            if cls(base.mu, mid, min_len, max_len).mean() < mean:
                lo = mid
            else:
                hi = mid
        return cls(base.mu, (lo + hi) / 2.0, min_len, max_len)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = np.rint(rng.lognormal(self.mu, self.sigma, size=n))
        hi = np.inf if self.max_len is None else self.max_len
        return np.clip(x, self.min_len, hi).astype(np.int64)

    def _cdf(self, x: np.ndarray) -> np.ndarray:
        if self.sigma == 0:
            return (x >= math.exp(self.mu)).astype(np.float64)
        z = (np.log(x) - self.mu) / (self.sigma * math.sqrt(2.0))
        return 0.5 * (1.0 + _erf(z))

    def pmf(self) -> tuple[np.ndarray, np.ndarray]:
        if self.max_len is None:
            raise ValueError("max_len: an unbounded LogNormal has no finite pmf; give max_len")
        if "pmf" not in self._cache:
            if self.max_len - self.min_len + 1 > MAX_PMF_SUPPORT:
                raise ValueError(f"max_len: support {self.min_len}..{self.max_len} is too large to enumerate")
            v = np.arange(self.min_len, self.max_len + 1, dtype=np.int64)
            edges = self._cdf(np.arange(self.min_len, self.max_len, dtype=np.float64) + 0.5)
            cdf = np.concatenate([edges, [1.0]])
            p = np.diff(cdf, prepend=0.0)
            keep = (
                p > 0
            )  # drop values whose mass underflows to exactly 0 (exact in float, and keeps expect fast)
            self._cache["pmf"] = (v[keep], p[keep])
        return self._cache["pmf"]

    def mean(self) -> float:
        if self.max_len is None:  # continuous approximation, ignores rounding and the lower clip
            return math.exp(self.mu + self.sigma**2 / 2.0)
        return super().mean()


class Empirical(LengthDistribution):
    """Draws uniformly, with replacement, from observed lengths."""

    def __init__(self, values: np.ndarray | list[int]) -> None:
        arr = np.asarray(values)
        if arr.ndim != 1 or len(arr) == 0:
            raise ValueError("values: need a non-empty 1-D array of lengths")
        if not np.issubdtype(arr.dtype, np.integer) or arr.min() < 1:
            raise ValueError(f"values: lengths must be ints >= 1 (smallest is {arr.min()!r})")
        self.data = arr.astype(np.int64)
        v, counts = np.unique(self.data, return_counts=True)
        self._pmf = (v, counts / counts.sum())

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.data[rng.integers(0, len(self.data), size=n)]

    def pmf(self) -> tuple[np.ndarray, np.ndarray]:
        return self._pmf

    def __repr__(self) -> str:
        return f"Empirical(n={len(self.data)}, mean={self.mean():.1f})"


@dataclass(frozen=True)
class JointLengths:
    """Independent input and output lengths, with an optional cap on input + output.

    When the pair exceeds ``max_total_tokens`` the side named by ``truncate`` gives way
    (``"output"``: o = cap - s; ``"input"``: s = cap - o). ``expect(g)`` is exact over both pmfs.
    """

    input: LengthDistribution
    output: LengthDistribution
    max_total_tokens: int | None = None
    truncate: str = "output"

    def __post_init__(self) -> None:
        if self.truncate not in ("output", "input"):
            raise ValueError(f"truncate: must be 'output' or 'input', got {self.truncate!r}")
        if self.max_total_tokens is not None:
            _check_len("max_total_tokens", self.max_total_tokens, 2)
            keep = self.input if self.truncate == "output" else self.output
            if keep.max_value >= self.max_total_tokens:
                raise ValueError(
                    f"max_total_tokens: {self.max_total_tokens} leaves no room for the {self.truncate} "
                    f"(the other side reaches {keep.max_value})"
                )

    def _apply_cap(self, s: np.ndarray, o: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.max_total_tokens is None:
            return s, o
        if self.truncate == "output":
            return s, np.minimum(o, self.max_total_tokens - s)
        return np.minimum(s, self.max_total_tokens - o), o

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        s = self.input.sample(rng, n)
        o = self.output.sample(rng, n)
        return self._apply_cap(s, o)

    def expect(self, g: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> float:
        """E[g(s, o)] over the capped pair; ``g`` must broadcast (numpy arithmetic does)."""
        sv, sp = self.input.pmf()
        ov, op = self.output.pmf()
        rows = max(1, _EXPECT_CHUNK // len(ov))  # input values per chunk of the (input x output) grid
        total = 0.0
        for i in range(0, len(sv), rows):
            s, o = self._apply_cap(sv[i : i + rows, None], ov[None, :])
            vals = np.broadcast_to(np.asarray(g(s, o), dtype=np.float64), (len(s), len(ov)))
            total += float(sp[i : i + rows] @ vals @ op)
        return total

    def mean_input(self) -> float:
        return self.expect(lambda s, o: s)

    def mean_output(self) -> float:
        return self.expect(lambda s, o: o)


class PairedLengths:
    """Observed (input, output) pairs drawn together, with replacement; ``expect`` averages over the pairs."""

    def __init__(self, inputs: np.ndarray | list[int], outputs: np.ndarray | list[int]) -> None:
        self.inputs = np.asarray(inputs, dtype=np.int64)
        # a trace's zero-token output is served as one token (the prefill always samples one)
        self.outputs = np.maximum(np.asarray(outputs, dtype=np.int64), 1)
        if self.inputs.shape != self.outputs.shape or self.inputs.ndim != 1 or len(self.inputs) == 0:
            raise ValueError("inputs: need non-empty 1-D input and output arrays of the same length")
        self.input = Empirical(self.inputs)
        self.output = Empirical(self.outputs)
        self.max_total_tokens = None

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        idx = rng.integers(0, len(self.inputs), size=n)
        return self.inputs[idx], self.outputs[idx]

    def expect(self, g: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> float:
        return float(np.mean(np.asarray(g(self.inputs, self.outputs), dtype=np.float64)))

    def mean_input(self) -> float:
        return float(self.inputs.mean())

    def mean_output(self) -> float:
        return float(self.outputs.mean())

    def __repr__(self) -> str:
        return f"PairedLengths(n={len(self.inputs)}, mean_input={self.mean_input():.1f}, mean_output={self.mean_output():.1f})"
