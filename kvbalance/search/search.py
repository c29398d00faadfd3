"""``kvbalance search``: the cheapest deployment that meets TTFT/TPOT SLOs at a target rate, and the Pareto
front of cost against goodput.

1. Enumerate (``space.py``): GPU type and count, TP, colocated or each prefill:decode split, scheduler,
   chunk size, batch cap. A deployment whose instance cannot be built (weights do not fit) is infeasible.
2. Prune by the queueing model (``prune.py``): drop any deployment whose upper bound mu <= the target rate.
3. The survivors go in order of cost ($/h from ``prices.py``; ties: larger bound first) in waves of ``wave``
   candidates (a fixed size, so the result does not depend on the backend or its worker count). Before each
   wave, the incumbent — the best goodput found so far, by cheaper or equally cheap candidates — prunes every
   candidate whose bound cannot beat it (DistServe's placement search shares its incumbent the same way);
   the rest search their max SLO rate from ``max(target, incumbent)`` (``bisect.py``) on the backend, each
   candidate one task, probes cached on disk by config hash and rate (a rerun or a wider grid reuses them).
4. Goodput = the max SLO rate. The answer is the cheapest candidate whose goodput reaches the target (more
   goodput breaks a cost tie); the front is the Pareto front of the candidates that reach it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvbalance.search.bisect import Probe, ProbeCache, ProbeSettings, config_key, max_slo_rate, run_probe
from kvbalance.search.pareto import pareto_front
from kvbalance.search.prices import gpu_price
from kvbalance.search.prune import deployment_bound
from kvbalance.search.space import Deployment

STATUSES = ("infeasible", "pruned_by_model", "pruned_by_incumbent", "misses_slo", "dominated", "searched",
            "at_ceiling", "probe_budget")  # fmt: skip


@dataclass(frozen=True)
class SearchSettings:
    model: str
    workload: str
    rate: float  # target requests/s
    probe: ProbeSettings
    seed: int = 0
    arrival: str = "poisson"
    cv: float = 1.0
    router: str = "least_loaded"
    factor: float = 2.0
    resolution: float = 0.05
    wave: int = 8
    extra_sim: dict[str, Any] = field(default_factory=dict)  # other SimulateConfig fields (block_size, ...)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(
                f"rate: the target must be a positive finite number of requests/s, got {self.rate}"
            )
        if self.wave < 1:
            raise ValueError(f"wave: must be >= 1, got {self.wave}")

    def base_sim(self) -> dict[str, Any]:
        return {"model": self.model, "workload": self.workload, "seed": self.seed, "arrival": self.arrival,
                "cv": self.cv, **self.extra_sim}  # fmt: skip


@dataclass
class Candidate:
    deployment: Deployment
    usd_per_hour: float
    status: str = "pending"
    mu_rps: float | None = None
    binding: str | None = None
    goodput_rps: float | None = None  # max SLO rate found (None: below the floor it was probed at)
    floor_rps: float | None = None
    probes: list[Probe] = field(default_factory=list)
    cached_probes: int = 0
    reason: str | None = None

    @property
    def meets_target(self) -> bool:
        return self.goodput_rps is not None and self.status in ("searched", "at_ceiling", "probe_budget")

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("deployment", "probes")}
        return self.deployment.to_dict() | d | {"probes": [p.to_dict() for p in self.probes]}


@dataclass
class SearchResult:
    settings: SearchSettings
    candidates: list[Candidate]
    best: Candidate | None
    front: list[Candidate]
    counts: dict[str, int]
    simulations: int  # probes run (not from the cache)
    cached: int  # probes read from the cache

    def to_dict(self) -> dict[str, Any]:
        s = asdict(self.settings)
        return {
            "settings": s,
            "best": self.best.to_dict() if self.best else None,
            "front": [c.deployment.name for c in self.front],
            "counts": self.counts,
            "simulated_probes": self.simulations,
            "cached_probes": self.cached,
            "candidates": [c.to_dict() for c in self.candidates],
        }


def _task(item: dict[str, Any]) -> dict[str, Any]:
    """One candidate's max-rate search (runs on a worker): probes it already has come in ``known``."""
    settings = ProbeSettings(**item["settings"])
    known = {p["rate"]: Probe(**p) for p in item["known"]}
    new: list[Probe] = []

    def probe(rate: float) -> Probe:
        if rate in known:
            return known[rate]
        p = run_probe(item["sim"], item["cluster"], rate, settings)
        new.append(p)
        return p

    rate, status, probes = max_slo_rate(
        probe, floor=item["floor"], ceiling=item["ceiling"], target_rate=item["target"], factor=item["factor"],
        resolution=item["resolution"],
    )  # fmt: skip
    return {"rate": rate, "status": status, "probes": [p.to_dict() for p in probes],
            "new": [p.to_dict() for p in new]}  # fmt: skip


def sim_fields(settings: SearchSettings, dep: Deployment) -> dict[str, Any]:
    """The SimulateConfig fields of ``dep``'s probes (rate and count are set per probe)."""
    return settings.base_sim() | dep.sim_fields()


def run_search(
    deployments: Sequence[Deployment],
    settings: SearchSettings,
    prices: dict[str, float],
    backend,
    *,
    cache_dir: str | Path | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> SearchResult:
    """Search ``deployments`` (see the module docstring); ``cache_dir`` None: no cache."""
    cands = [Candidate(d, d.num_gpus * gpu_price(prices, d.gpu)) for d in deployments]
    base = settings.base_sim()
    for c in cands:  # 1-2: feasibility and the queueing model's bound
        try:
            b = deployment_bound(c.deployment, base, settings.workload)
        except ValueError as e:
            c.status, c.reason = "infeasible", str(e)
            continue
        c.mu_rps, c.binding = b.mu_rps, b.binding
        if settings.rate >= b.mu_rps:
            c.status = "pruned_by_model"
    survivors = sorted((c for c in cands if c.status == "pending"),
                       key=lambda c: (c.usd_per_hour, -c.mu_rps, c.deployment.name))  # fmt: skip
    cache = ProbeCache(cache_dir)
    incumbent = 0.0
    simulations = cached = 0
    for start in range(0, len(survivors), settings.wave):  # 3: waves in cost order
        wave = []
        for c in survivors[start : start + settings.wave]:
            if c.mu_rps <= incumbent:
                c.status = "pruned_by_incumbent"
            else:
                wave.append(c)
        items = []
        for c in wave:
            sf = sim_fields(settings, c.deployment)
            cf = c.deployment.cluster_config(settings.router).model_dump()
            key = config_key(sf, cf, settings.probe)
            known = cache.load(key)
            c.floor_rps = max(settings.rate, incumbent)
            items.append({"sim": sf, "cluster": cf, "settings": asdict(settings.probe), "key": key,
                          "known": [p.to_dict() for p in known.values()], "floor": c.floor_rps,
                          "ceiling": c.mu_rps, "target": settings.rate, "factor": settings.factor,
                          "resolution": settings.resolution})  # fmt: skip
        for i, out in backend.imap(_task, items):
            c = wave[i]
            c.probes = [Probe(**p) for p in out["probes"]]
            new = [Probe(**p) for p in out["new"]]
            cache.store(items[i]["key"], new)
            simulations += len(new)
            c.cached_probes = len(c.probes) - len(new)
            cached += c.cached_probes
            c.status, c.goodput_rps = out["status"], out["rate"]
            if on_progress is not None:
                on_progress(c.deployment.name)
        for c in wave:
            if c.meets_target:
                incumbent = max(incumbent, c.goodput_rps)
    ok = [c for c in cands if c.meets_target]
    best = min(ok, key=lambda c: (c.usd_per_hour, -c.goodput_rps, c.deployment.name)) if ok else None
    front_dicts = pareto_front([{"usd_per_hour": c.usd_per_hour, "goodput_rps": c.goodput_rps, "i": i}
                                for i, c in enumerate(ok)])  # fmt: skip
    front = [ok[p["i"]] for p in front_dicts]
    counts = {s: sum(c.status == s for c in cands) for s in STATUSES}
    counts["candidates"] = len(cands)
    counts["simulated_candidates"] = sum(bool(c.probes) for c in cands)
    return SearchResult(settings, cands, best, front, counts, simulations, cached)


def confirm(result: SearchResult, candidate: Candidate | None = None) -> Probe | None:
    """A full (no early exit) simulation of the answer at the target rate: the simulator's own verdict."""
    c = candidate or result.best
    if c is None:
        return None
    s = result.settings
    full = ProbeSettings(**(asdict(s.probe) | {"early_exit": False}))
    return run_probe(
        sim_fields(s, c.deployment), c.deployment.cluster_config(s.router).model_dump(), s.rate, full
    )
