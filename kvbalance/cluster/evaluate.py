"""Measuring serving systems on one workload the way the BanaServe and DistServe papers do.

``Workbench`` fixes a model, GPU budget, workload, arrival process, SLOs, request count and seed, and runs
cluster configs on the same requests (rebuilt from the seed for every run, so every system sees the same
lengths and, at a given rate, the same arrival times). The request count grows with the rate so that arrivals
span about ``duration_s`` (a fixed small set at a high rate is a burst the cluster drains, not a load it
sustains), between ``min_requests`` and ``max_requests``. It answers:

* ``max_rate_at_slo(cfg)``: the highest rate at which 90% of requests meet both the TTFT and the TPOT SLO
  (DistServe's SLO attainment), by doubling then bisection (``systems.max_rate_at_slo``);
* ``best_of(cfgs)``: the config with the highest such rate — DistServe's split search and vLLM's best router
  — pruning a candidate after one probe when it misses the SLO at the best rate found so far (it cannot win);
* ``run(cfg, rate)``: one run (cached by config and rate), for latency, throughput and utilisation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvbalance.cluster.config import ClusterConfig, ClusterResult, run_cluster
from kvbalance.cluster.systems import max_rate_at_slo
from kvbalance.sim.run import SimulateConfig
from kvbalance.specs import get_model
from kvbalance.workloads.presets import build_requests

SLO_TARGET = 0.9  # DistServe: the rate at which 90% of requests meet both SLOs


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
    iters: int = 4
    on_run: Callable[[], None] | None = None  # progress callback, once per simulated run
    _cache: dict = field(default_factory=dict)
    probes: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # key -> [(rate, attainment)]
    max_rates: dict[str, float] = field(default_factory=dict)  # config key -> max rate at SLO found

    def requests_for(self, rate: float) -> int:
        return int(min(max(self.min_requests, round(rate * self.duration_s)), self.max_requests))

    def sim_config(self, rate: float) -> SimulateConfig:
        return SimulateConfig(
            model=self.model, gpu=self.gpu, workload=self.workload, rate=rate, num_requests=self.requests_for(rate),
            arrival=self.arrival, cv=self.cv, seed=self.seed, ttft_slo_s=self.ttft_slo_s,
            tpot_slo_s=self.tpot_slo_s,
        )  # fmt: skip

    @staticmethod
    def key(cfg: ClusterConfig) -> str:
        return json.dumps(cfg.model_dump(), sort_keys=True)

    def run(self, cfg: ClusterConfig, rate: float) -> ClusterResult:
        k = (self.key(cfg), rate)
        if k not in self._cache:
            sim = self.sim_config(rate)
            reqs = build_requests(
                self.workload, self.requests_for(rate), rate, self.seed, get_model(self.model).max_context,
                arrival=self.arrival, cv=self.cv,
            )  # fmt: skip
            self._cache[k] = run_cluster(sim, cfg, reqs)
            if self.on_run:
                self.on_run()
        return self._cache[k]

    def attainment(self, cfg: ClusterConfig, rate: float) -> float:
        a = float(self.run(cfg, rate).summary["slo_attainment"])
        self.probes.setdefault(self.key(cfg), []).append((rate, a))
        return a

    def max_rate_at_slo(self, cfg: ClusterConfig, start_rps: float) -> float:
        """Cached per config: a config searched once (e.g. in ``best_of``) is not searched again."""
        k = self.key(cfg)
        if k not in self.max_rates:
            rate, _ = max_rate_at_slo(
                lambda r: self.attainment(cfg, r), start_rps, target=SLO_TARGET, iters=self.iters
            )
            self.max_rates[k] = rate
        return self.max_rates[k]

    def best_of(self, cfgs: Sequence[ClusterConfig], start_rps: float) -> tuple[int, float, list[float]]:
        """(index of the best config, its max rate at SLO, every candidate's rate; pruned ones get 0)."""
        best_i, best = 0, 0.0
        rates = []
        for i, cfg in enumerate(cfgs):
            if best > 0 and self.attainment(cfg, best) < SLO_TARGET:
                rates.append(0.0)  # misses the SLO where the best so far meets it: cannot win
                continue
            r = self.max_rate_at_slo(cfg, best if best > 0 else start_rps)
            rates.append(r)
            if r > best:
                best_i, best = i, r
        return best_i, best, rates
