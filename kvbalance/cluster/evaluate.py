"""Measuring serving systems on one workload the way the BanaServe and DistServe papers do.

``Workbench`` fixes a model, GPU budget, workload, arrival process, SLOs, request count and seed, and runs
cluster configs on the same requests (rebuilt from the seed for every run, so every system sees the same
lengths and, at a given rate, the same arrival times). The request count grows with the rate so that arrivals
span about ``duration_s`` (a fixed small set at a high rate is a burst the cluster drains, not a load it
sustains), between ``min_requests`` and ``max_requests``. It answers:

* ``max_rate_at_slo(cfg)``: the highest rate at which 90% of requests meet both the TTFT and the TPOT SLO
  (DistServe's SLO attainment), found by ``search_max_rate``: bracket (exponential steps from a start
  rate), then geometric bisection until the bracket is within ``resolution`` (relative);
* ``best_of(cfgs)``: the config with the highest such rate — DistServe's split search and vLLM's best router
  — pruning a candidate after one probe when it misses the SLO at the best rate found so far (it cannot win);
* ``run(cfg, rate)``: one full run (cached by config and rate), for latency, throughput and utilisation.

A probe of the search only needs to know whether attainment reaches the target, and stops as soon as that
is decided (``SloVerdict``): when ``ceil(target x n)`` requests have met both SLOs (it passes whatever the
rest do) or more than ``n - ceil(target x n)`` have missed (it fails). A request's verdict is final when it
finishes, so the early exit is exact: the search probes the same rates and reaches the same rate as full
runs would. A stopped probe records a bound on its attainment (``probes``: >= for a pass, <= for a fail).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvbalance.cluster.config import ClusterConfig, ClusterResult, build_cluster, run_cluster
from kvbalance.metrics.summary import meets_slo
from kvbalance.request import Request
from kvbalance.sim.run import SimulateConfig
from kvbalance.specs import get_model
from kvbalance.workloads.presets import TRACES, build_requests, parse_workload

SLO_TARGET = 0.9  # DistServe: the rate at which 90% of requests meet both SLOs


def search_max_rate(
    ok: Callable[[float], bool], start_rps: float, *, resolution: float = 0.05, factor: float = 2.0,
    max_brackets: int = 8,
) -> float:  # fmt: skip
    """Highest rate with ``ok(rate)``, assuming ``ok`` is monotone (true below a threshold, false above).

    Bracket: from ``start_rps``, step up (on a pass) or down (on a fail) by ``factor``, squaring the factor
    after each step in the same direction, until one rate passes and one fails (at most ``max_brackets``
    probes). Bisect: probe ``sqrt(lo * hi)`` until ``hi / lo <= 1 + resolution``. Returns ``lo`` (0.0 if even
    the lowest rate probed fails); the true threshold lies in ``[lo, lo * (1 + resolution)]``, or above
    ``lo`` if no failing rate was found within the bracket budget.
    """
    if not start_rps > 0 or not resolution > 0 or not factor > 1:
        raise ValueError(f"start_rps / resolution / factor: need > 0 / > 0 / > 1, got {start_rps}, "
                         f"{resolution}, {factor}")  # fmt: skip
    lo, hi = 0.0, math.inf
    r, f = start_rps, factor
    for i in range(max_brackets):
        passed = ok(r)
        if passed:
            lo = r
        else:
            hi = r
        if lo > 0 and hi < math.inf:
            break
        if i:
            f *= f
        r = r * f if passed else r / f
    if lo == 0.0 or hi == math.inf:
        return lo
    while hi / lo > 1 + resolution:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


class SloVerdict(Exception):
    """Raised inside a probe run once its attainment is decided (``passed``), to stop the simulation."""

    def __init__(self, passed: bool, good: int, missed: int) -> None:
        super().__init__("passed" if passed else "failed")
        self.passed, self.good, self.missed = passed, good, missed


@dataclass
class SloCounter:
    """A cluster's ``on_finish`` that raises ``SloVerdict`` as soon as ``good / n >= target`` is decided
    (over the requests ``counts`` accepts, all by default)."""

    num_requests: int
    target: float
    ttft_slo_s: float
    tpot_slo_s: float
    good: int = 0
    missed: int = 0
    counts: Callable[[Request], bool] | None = None

    def __post_init__(self) -> None:
        n = self.num_requests
        need = math.ceil(self.target * n)  # the fewest good requests with good / n >= target, exactly
        while need > 0 and (need - 1) / n >= self.target:
            need -= 1
        while need <= n and need / n < self.target:
            need += 1
        self.need = need

    def __call__(self, req: Request) -> None:
        if self.counts is not None and not self.counts(req):
            return
        if meets_slo(req, self.ttft_slo_s, self.tpot_slo_s):
            self.good += 1
        else:
            self.missed += 1
        if self.good >= self.need:
            raise SloVerdict(True, self.good, self.missed)
        if self.num_requests - self.missed < self.need:
            raise SloVerdict(False, self.good, self.missed)


@dataclass
class Workbench:
    model: str
    gpu: str
    workload: str
    arrival: str  # "poisson" or "gamma"
    cv: float
    ttft_slo_s: float
    tpot_slo_s: float
    duration_s: float  # arrivals span about this long at any rate: SLO attainment is a steady-state figure
    min_requests: int
    max_requests: int  # cost cap; past it the arrival span shrinks (``requests_for`` says how many)
    seed: int = 0
    resolution: float = 0.05  # of the max-rate search, relative (hi / lo - 1)
    early_exit: bool = True  # stop a probe once its verdict is decided (exact; False: full runs)
    on_run: Callable[[], None] | None = None  # progress callback, once per simulated run (probes included)
    # SLO attainment over the requests whose ``meta[key] == value`` only (e.g. ("phase", 0): one phase of a
    # phase-shifting load); None: all of them
    slo_meta: tuple[str, object] | None = None
    _trace_rate: float | None = None  # a trace workload's own mean arrival rate (requests/s)
    _cache: dict = field(default_factory=dict)
    _verdicts: dict = field(default_factory=dict)  # (config key, rate) -> passed
    # config key -> [(rate, attainment, exact)]; exact False: a stopped probe's bound (>= for a pass, <= a fail)
    probes: dict[str, list[tuple[float, float, bool]]] = field(default_factory=dict)
    max_rates: dict[str, float] = field(default_factory=dict)  # config key -> max rate at SLO found
    stopped_probes: int = 0  # probes decided before their run ended

    def requests_for(self, rate: float) -> int:
        return int(min(max(self.min_requests, round(rate * self.duration_s)), self.max_requests))

    def time_scale(self, rate: float) -> float:
        """A trace replays at ``rate``: its own arrival times scaled by (its mean rate / rate); 1 otherwise."""
        if parse_workload(self.workload).kind not in TRACES:
            return 1.0
        if self._trace_rate is None:
            reqs = build_requests(self.workload, None, 1.0, self.seed, get_model(self.model).max_context)
            span = reqs[-1].arrival_s - reqs[0].arrival_s if len(reqs) > 1 else 0.0
            if not span > 0:
                raise ValueError(f"workload: trace {self.workload!r} has no arrival times to scale to a rate")
            self._trace_rate = (len(reqs) - 1) / span
        return self._trace_rate / rate

    def sim_config(self, rate: float) -> SimulateConfig:
        return SimulateConfig(
            model=self.model, gpu=self.gpu, workload=self.workload, rate=rate, num_requests=self.requests_for(rate),
            arrival=self.arrival, cv=self.cv, seed=self.seed, ttft_slo_s=self.ttft_slo_s,
            tpot_slo_s=self.tpot_slo_s, time_scale=self.time_scale(rate),
        )  # fmt: skip

    def requests(self, rate: float) -> list[Request]:
        return build_requests(
            self.workload, self.requests_for(rate), rate, self.seed, get_model(self.model).max_context,
            arrival=self.arrival, cv=self.cv, time_scale=self.time_scale(rate),
        )  # fmt: skip

    @staticmethod
    def key(cfg: ClusterConfig) -> str:
        return json.dumps(cfg.model_dump(), sort_keys=True)

    def run(self, cfg: ClusterConfig, rate: float) -> ClusterResult:
        k = (self.key(cfg), rate)
        if k not in self._cache:
            self._cache[k] = run_cluster(self.sim_config(rate), cfg, self.requests(rate))
            if self.on_run:
                self.on_run()
        return self._cache[k]

    def counted(self, req: Request) -> bool:
        return self.slo_meta is None or req.meta.get(self.slo_meta[0]) == self.slo_meta[1]

    def attainment_of(self, reqs: Sequence[Request]) -> float:
        mine = [r for r in reqs if self.counted(r)]  # none: the run cannot tell (a capped burst) -> a miss
        return sum(meets_slo(r, self.ttft_slo_s, self.tpot_slo_s) for r in mine) / len(mine) if mine else 0.0

    def attainment(self, cfg: ClusterConfig, rate: float) -> float:
        """SLO attainment at ``rate`` (a full run's; a stopped probe's bound: the verdict is exact)."""
        k = (self.key(cfg), rate)
        if k in self._cache or not self.early_exit:
            a, exact = self.attainment_of(self.run(cfg, rate).run.requests), True
        else:
            a, exact = self._probe(cfg, rate)
        self._verdicts[k] = a >= SLO_TARGET
        self.probes.setdefault(k[0], []).append((rate, a, exact))
        return a

    def _probe(self, cfg: ClusterConfig, rate: float) -> tuple[float, bool]:
        reqs = self.requests(rate)
        n = sum(1 for r in reqs if self.counted(r))
        if n == 0:
            return 0.0, True  # no request of the scope at this rate: no evidence it is met
        counter = SloCounter(n, SLO_TARGET, self.ttft_slo_s, self.tpot_slo_s, counts=self.counted)
        cluster = build_cluster(self.sim_config(rate), cfg)
        cluster.on_finish = counter
        try:
            cluster.run(reqs)
            a, exact = self.attainment_of(reqs), True
        except SloVerdict as v:
            self.stopped_probes += 1
            a, exact = (v.good / n if v.passed else 1 - v.missed / n), False  # a bound on the verdict's side
        if self.on_run:
            self.on_run()
        return a, exact

    def passes(self, cfg: ClusterConfig, rate: float) -> bool:
        k = (self.key(cfg), rate)
        if k not in self._verdicts:
            self.attainment(cfg, rate)
        return self._verdicts[k]

    def max_rate_at_slo(self, cfg: ClusterConfig, start_rps: float, factor: float = 2.0) -> float:
        """Cached per config: a config searched once (e.g. in ``best_of``) is not searched again.
        ``factor``: the bracket's first step (smaller when ``start_rps`` is a good guess)."""
        k = self.key(cfg)
        if k not in self.max_rates:
            self.max_rates[k] = search_max_rate(
                lambda r: self.passes(cfg, r), start_rps, resolution=self.resolution, factor=factor
            )
        return self.max_rates[k]

    def best_of(self, cfgs: Sequence[ClusterConfig], start_rps: float) -> tuple[int, float, list[float]]:
        """(index of the best config, its max rate at SLO, every candidate's rate; pruned ones get 0).

        The first config is searched from ``start_rps``; each later one is probed at the best rate so far
        and pruned if it misses the SLO there (it cannot win), else searched upward from that rate with a
        first step of ``1 + resolution`` (one more probe settles a tie within the resolution). Put the
        likely winner first: the rest then cost one or two probes each."""
        best_i, best = 0, 0.0
        rates = []
        for i, cfg in enumerate(cfgs):
            if best > 0 and not self.passes(cfg, best):
                rates.append(0.0)  # misses the SLO where the best so far meets it: cannot win
                continue
            if best > 0:
                r = self.max_rate_at_slo(cfg, best, 1 + self.resolution)
            else:
                r = self.max_rate_at_slo(cfg, start_rps)
            rates.append(r)
            if r > best:
                best_i, best = i, r
        return best_i, best, rates
