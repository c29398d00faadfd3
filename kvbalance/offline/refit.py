"""Output-length estimates refined while the job runs: every finished request is one more sample.

The warm-up (``estimate.py``) samples about 1% of the requests, so a rare, long kind of request (a video
among chats: 0.2% of BlendServe's trace #1) is estimated from one or two of its own. The live admission leans
on those estimates for the memory-heavy requests (how many decode at once, how long the compute side must
last), and one sample may be far off: trace #1's videos are all estimated at 24,574 tokens (the one sampled)
where they average 17,006. As the job runs, the memory-heavy requests that finish tell their true lengths,
and the ones still decoding tell that theirs are longer than what they have produced so far.

:class:`LengthRefit` pools them as ratios x = true length / prior estimate (estimates are off by a factor
that is shared within a kind of request) and fits the Kaplan-Meier product-limit estimator: finished
requests are events, running ones are censored at x = tokens so far / prior (they are known to be longer).
Survival mass left past the last observation sits at ``max(largest observation, 1)``: a running request that
has outlived every finished one is expected to end at its prior estimate, or now if past it. Then

* a request not started yet is estimated at prior x E[X];
* a running one that has produced g tokens at prior x E[X | X > g / prior] (at least g + 1).

Until ``min_events`` requests have finished (the warm-up samples count: their ratio is 1) the priors stand.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def km_survival(events: Sequence[float], censored: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Kaplan-Meier survival of X from ``events`` (observed values) and ``censored`` (values known to be
    exceeded): (distinct event values t, S just after each), S(x) = S[k] for t[k] <= x < t[k + 1], 1 below
    t[0]. A censored value equal to an event value counts as still at risk at it."""
    ev = np.sort(np.asarray(events, dtype=np.float64))
    ce = np.sort(np.asarray(censored, dtype=np.float64))
    if len(ev) == 0:
        return np.zeros(0), np.zeros(0)
    t, deaths = np.unique(ev, return_counts=True)
    # at risk at t: events >= t plus censored >= t
    at_risk = (len(ev) - np.searchsorted(ev, t, side="left")) + (
        len(ce) - np.searchsorted(ce, t, side="left")
    )
    return t, np.cumprod(1.0 - deaths / at_risk)


class LengthRefit:
    """Pooled ratio x = true / prior output length of one class of requests (module docstring)."""

    def __init__(self, min_events: int = 3) -> None:
        if min_events < 1:
            raise ValueError(f"min_events: must be >= 1, got {min_events}")
        self.min_events = min_events
        self.events: list[float] = []
        self._t = np.zeros(0)
        self._s = np.zeros(0)
        self._tail = 1.0
        self._mean = 1.0

    @property
    def active(self) -> bool:
        """Whether enough requests have finished for the fit to replace the priors."""
        return len(self.events) >= self.min_events

    def add(self, true_len: float, prior_len: float) -> None:
        """A request of this class finished with ``true_len`` output tokens, estimated ``prior_len``."""
        self.events.append(float(true_len) / max(float(prior_len), 1.0))

    def fit(self, censored: Sequence[float]) -> None:
        """Refit with the running requests' ratios (tokens so far / prior) as censored observations."""
        self._t, self._s = km_survival(self.events, censored)
        top = max(max(self.events, default=1.0), max(censored, default=0.0))
        self._tail = max(top, 1.0)
        self._mean = self.mean_above(0.0)

    @property
    def mean_ratio(self) -> float:
        """E[X]: the factor on a prior for a request not started yet (1 until ``active``)."""
        return self._mean if self.active else 1.0

    def mean_above(self, y: float) -> float:
        """E[X | X > y] under the fit (integral of the survival curve above y over S(y), plus y)."""
        t, s = self._t, self._s
        # S on the pieces [t_k, t_{k+1}); the leftover mass S_last sits at the tail point
        k = int(np.searchsorted(t, y, side="right"))  # pieces at or below y end before index k
        s_y = 1.0 if k == 0 else float(s[k - 1])
        if s_y <= 0.0:
            return max(y, self._tail)
        edges = np.concatenate([[y], t[k:]])
        surv = np.concatenate([[s_y], s[k:]])
        area = float(np.sum(surv[:-1] * np.diff(edges)))
        last = float(surv[-1])
        if last > 0:
            area += last * max(self._tail - float(edges[-1]), 0.0)
        return y + area / s_y

    def estimate(self, prior_len: float, produced: int = 0) -> float:
        """The refined output length of a request estimated ``prior_len`` that has produced ``produced``."""
        if not self.active:
            return max(float(prior_len), produced + 1.0)
        prior = max(float(prior_len), 1.0)
        x = self.mean_above(produced / prior) if produced > 0 else self._mean
        return max(prior * x, produced + 1.0)
