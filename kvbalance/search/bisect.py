"""A deployment's highest SLO-meeting rate: probe (one simulation at a rate), bracket, then bisect, with every
probe cached on disk by config hash and rate.

A probe passes when at least ``target`` (0.9: DistServe's attainment) of its requests finish meeting both
the TTFT and the TPOT SLO. It runs ``clamp(rate x duration_s, min_requests, max_requests)`` requests (arrivals
span about ``duration_s`` at any rate: attainment is a steady-state figure) and stops as soon as the
verdict is decided (``cluster.evaluate.SloCounter``: exact, the verdict is the full run's).

``max_slo_rate`` starts at ``floor`` (the target rate, or the incumbent's goodput when that is higher: below
it a candidate cannot matter). A miss there ends the search (``misses_slo`` at the target, ``dominated``
above it). Otherwise it brackets upward by ``factor`` until a probe misses — never past ``ceiling`` (the
queueing bound), which is probed last — and bisects geometrically until ``hi / lo <= 1 + resolution``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CACHE_VERSION = 1  # bump when what a probe computes changes (it invalidates every cached probe)


@dataclass(frozen=True)
class ProbeSettings:
    """Everything a probe depends on besides the deployment and the rate."""

    ttft_slo_s: float
    tpot_slo_s: float
    target: float = 0.9
    duration_s: float = 60.0
    min_requests: int = 200
    max_requests: int = 2000
    early_exit: bool = True

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "tpot_slo_s", "duration_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}: must be a positive number, got {v!r}")
        if not 0 < self.target <= 1:
            raise ValueError(f"attainment: must lie in (0, 1], got {self.target}")
        if not 1 <= self.min_requests <= self.max_requests:
            raise ValueError(
                f"min_requests / max_requests: need 1 <= {self.min_requests} <= {self.max_requests}"
            )

    def requests_for(self, rate: float) -> int:
        return int(min(max(self.min_requests, round(rate * self.duration_s)), self.max_requests))


@dataclass(frozen=True)
class Probe:
    rate: float
    passed: bool
    attainment: float  # exact for a full run; a bound on the verdict's side for a stopped one
    exact: bool
    num_requests: int
    goodput_rps: float | None = None  # full runs only
    p90_ttft_s: float | None = None
    p90_tpot_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def config_key(sim_fields: dict[str, Any], cluster_fields: dict[str, Any], settings: ProbeSettings) -> str:
    """Hash of what a probe of this deployment depends on, the rate excepted (the cache's folder name)."""
    from kvbalance import __version__

    sim = {k: v for k, v in sim_fields.items() if k not in ("rate", "num_requests")}
    blob = json.dumps(
        {"v": CACHE_VERSION, "kvbalance": __version__, "sim": sim, "cluster": cluster_fields,
         "probe": asdict(settings)}, sort_keys=True, default=str,
    )  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


class ProbeCache:
    """``<root>/<config key>/<rate>.json``: one file per probe, written atomically (a rerun reuses them)."""

    def __init__(self, root: str | Path | None) -> None:
        self.root = Path(root) if root is not None else None

    def load(self, key: str) -> dict[float, Probe]:
        if self.root is None or not (self.root / key).is_dir():
            return {}
        out = {}
        for f in (self.root / key).glob("*.json"):
            try:
                p = Probe(**json.loads(f.read_text()))
            except (ValueError, TypeError):
                continue  # a torn or foreign file: probed again
            out[p.rate] = p
        return out

    def store(self, key: str, probes: list[Probe]) -> None:
        if self.root is None:
            return
        folder = self.root / key
        folder.mkdir(parents=True, exist_ok=True)
        for p in probes:
            dest = folder / f"{p.rate!r}.json"
            if dest.exists():
                continue
            tmp = dest.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(p.to_dict(), sort_keys=True) + "\n")
            os.replace(tmp, dest)


def run_probe(sim_fields: dict[str, Any], cluster_fields: dict[str, Any], rate: float,
              settings: ProbeSettings) -> Probe:  # fmt: skip
    """One simulation of the deployment at ``rate`` (its own seed from ``sim_fields``)."""
    from kvbalance.cluster.config import ClusterConfig, build_cluster
    from kvbalance.cluster.evaluate import SloCounter, SloVerdict
    from kvbalance.metrics.summary import latency_stats, meets_slo
    from kvbalance.sim.run import SimulateConfig
    from kvbalance.specs import get_model
    from kvbalance.workloads.presets import build_requests

    n = settings.requests_for(rate)
    sim = SimulateConfig(**(sim_fields | {"rate": rate, "num_requests": n, "ttft_slo_s": settings.ttft_slo_s,
                                          "tpot_slo_s": settings.tpot_slo_s}))  # fmt: skip
    max_context = min(sim.max_context or 1 << 30, get_model(sim.model).max_context)
    reqs = build_requests(sim.workload, n, rate, sim.seed, max_context, arrival=sim.arrival, cv=sim.cv)
    cluster = build_cluster(sim, ClusterConfig(**cluster_fields))
    if settings.early_exit:
        cluster.on_finish = SloCounter(n, settings.target, settings.ttft_slo_s, settings.tpot_slo_s)
    try:
        cluster.run(reqs)
    except SloVerdict as v:
        a = v.good / n if v.passed else 1 - v.missed / n
        return Probe(rate, v.passed, a, False, n)
    good = sum(meets_slo(r, settings.ttft_slo_s, settings.tpot_slo_s) for r in reqs)
    a = good / n
    finish = [r.finish_s for r in reqs if r.finish_s is not None]
    span = max(finish) - min(r.arrival_s for r in reqs) if finish else 0.0
    ttft = latency_stats([r.ttft_s for r in reqs])["p90"]
    tpot = latency_stats([r.tpot_s for r in reqs])["p90"]
    return Probe(rate, a >= settings.target, a, True, n, good / span if span > 0 else 0.0, ttft, tpot)


def max_slo_rate(
    probe: Callable[[float], Probe], *, floor: float, ceiling: float = math.inf, target_rate: float | None = None,
    factor: float = 2.0, resolution: float = 0.05, max_probes: int = 24,
) -> tuple[float | None, str, list[Probe]]:  # fmt: skip
    """(highest passing rate found or None, status, probes in order). Status: ``searched``, ``misses_slo``
    (fails at the target rate), ``dominated`` (fails at a floor above it), ``at_ceiling`` (passes at the
    bound itself: a short run can, above the stable rate) or ``probe_budget`` (stopped after max_probes)."""
    if not floor > 0 or not factor > 1 or not resolution > 0:
        raise ValueError(
            f"floor / factor / resolution: need > 0 / > 1 / > 0, got {floor}, {factor}, {resolution}"
        )
    probes: list[Probe] = []

    def ok(r: float) -> bool:
        p = probe(r)
        probes.append(p)
        return p.passed

    if not ok(floor):
        status = "misses_slo" if target_rate is None or floor <= target_rate else "dominated"
        return None, status, probes
    lo, hi = floor, math.inf
    while hi == math.inf:
        if len(probes) >= max_probes:
            return lo, "probe_budget", probes
        r = min(lo * factor, ceiling)
        if r <= lo:
            return lo, "at_ceiling", probes
        if ok(r):
            lo = r
        else:
            hi = r
    while hi / lo > 1 + resolution and len(probes) < max_probes:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, "searched" if hi / lo <= 1 + resolution else "probe_budget", probes
