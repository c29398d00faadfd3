"""Data-parallel replicas of one simulated instance behind a router (moved here from ``theory/measure.py``).

``simulate_replicas`` serves a request set on ``num_instances`` copies of a ``SimulateConfig``'s instance,
all colocated, on one clock (a ``Cluster``); ``measure_saturation`` runs it overloaded and hands the run to
``theory.measure.saturation_from_run`` for the steady throughput and batch-time estimates. With one instance
the result is exactly ``sim.loop.simulate_instance``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvbalance.cluster.core import Cluster, Member
from kvbalance.cluster.topology import Topology
from kvbalance.metrics.summary import summarize
from kvbalance.metrics.timeline import Timeline
from kvbalance.request import Request, RequestState
from kvbalance.sim.run import SimulateConfig, build_sim_instance, config_requests
from kvbalance.theory.measure import Saturation, saturation_from_run


@dataclass
class ReplicaRun:
    """Result of ``simulate_replicas``: requests, one timeline per instance, and the pooled summary."""

    config: SimulateConfig
    requests: list[Request]
    timelines: list[Timeline]
    instances: list
    summary: dict
    assignment: dict[str, int] = field(default_factory=dict)  # request id -> instance index

    def finish_times(self) -> np.ndarray:
        return np.array(
            [r.finish_s for r in self.requests if r.state is RequestState.FINISHED], dtype=np.float64
        )

    def waiting(self) -> tuple[np.ndarray, np.ndarray]:
        """(time_s, waiting requests summed over instances), on the union of step start times."""
        if len(self.timelines) == 1:
            return self.timelines[0].queue_length()
        times = np.unique(np.concatenate([tl.column("time_s") for tl in self.timelines]))
        total = np.zeros_like(times)
        for tl in self.timelines:
            t, w = tl.queue_length()
            if len(t) == 0:
                continue
            idx = np.searchsorted(t, times, side="right") - 1
            total += np.where(idx >= 0, w[np.maximum(idx, 0)], 0.0)
        return times, total


def replica_members(cfg: SimulateConfig, num_instances: int) -> list[Member]:
    """``num_instances`` colocated copies of ``cfg``'s instance, each on its own ``cfg.tp`` GPUs."""
    members = []
    for i in range(num_instances):
        inst, _ = build_sim_instance(cfg)
        inst.name = f"instance-{i}"
        members.append(Member(i, "colocated", tuple(range(i * cfg.tp, (i + 1) * cfg.tp)), inst))
    return members


def simulate_replicas(
    cfg: SimulateConfig,
    requests: list[Request] | None = None,
    *,
    num_instances: int = 1,
    router: str = "least_loaded",
) -> ReplicaRun:
    """Serve ``requests`` (default: built from ``cfg``) on ``num_instances`` copies of ``cfg``'s instance.

    ``router`` is any name in ``cluster.routers.ROUTERS`` (``least_loaded`` is vLLM's waiting x 4 + running;
    ties go to the lowest index), so the result is deterministic.
    """
    if num_instances < 1:
        raise ValueError(f"num_instances: must be >= 1, got {num_instances}")
    members = replica_members(cfg, num_instances)
    instances = [m.instance for m in members]
    if requests is None:
        requests = config_requests(cfg, instances[0].max_context)
    topo = Topology.build(cfg.gpu, num_instances * cfg.tp)
    cluster = Cluster(members, topo, router=router)
    run = cluster.run(requests)
    timelines = run.timelines
    summary = summarize(
        requests,
        kv_capacity_tokens=sum(inst.kv_capacity_tokens for inst in instances),
        timeline=timelines,
        ttft_slo_s=cfg.ttft_slo_s,
        tpot_slo_s=cfg.tpot_slo_s,
        preemptions=sum(inst.scheduler.num_preemptions for inst in instances),
        extra={
            "num_instances": num_instances,
            "router": router,
            "num_steps": sum(i.num_steps for i in instances),
        },
    )
    return ReplicaRun(cfg, list(requests), timelines, instances, summary, run.assignment)


def measure_saturation(
    cfg: SimulateConfig,
    requests: list[Request] | None = None,
    *,
    num_instances: int = 1,
    router: str = "round_robin",
) -> Saturation:
    """Run ``cfg`` (use rate inf or well above mu) and measure throughput and b in the steady window.

    Warm-up (the batch filling up) and drain (the last requests finishing on an emptying batch) are left out
    by keeping only completions and steps between the 10th and 90th percentile completion times.
    """
    run = simulate_replicas(cfg, requests, num_instances=num_instances, router=router)
    return saturation_from_run(run, num_instances)
