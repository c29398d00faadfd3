"""Routing ahead (cluster/route_ahead.py) is exact: members of a cluster behind a router of counts that run past
arrivals they prove go to others give bit for bit the run where every member stops at every arrival
(KVBALANCE_SIM_FAST=0: no cohort, no run ahead): the same requests (tokens, token times, blocks), step times,
timelines and routing, on near-tied light loads, with preemptions (the guard), with a client abort and an
outside preemption mid-run. A router that picks a member that ran past the arrival is caught."""

from __future__ import annotations

import json
import random

import pytest

from kvbalance.cluster.routers import build_router
from kvbalance.cluster.routers.base import Router, argmin
from kvbalance.cluster.routers.least_loaded import LeastLoadedRouter
from kvbalance.engine import InstanceLoad

# (router, members, rate, requests, kv_tokens per member or None, least passes with it on)
CASES = [
    ("least_loaded", 8, 30.0, 400, None, 1000),  # light load: scores near-tied, index tie-breaks
    ("least_requests", 8, 30.0, 400, None, 1000),
    ("least_loaded", 16, 100.0, 800, None, 3000),  # cluster16's shape
    ("least_loaded", 4, 100.0, 400, 15000, 20),  # preemptions: the guard decides the bounds
    ("least_requests", 4, 100.0, 400, 8000, 300),  # preemptions (they do not raise this score)
]


def _rows(reqs) -> str:
    return json.dumps([(r.request_id, r.state.value, r.first_scheduled_s, r.first_token_s, r.finish_s,
                        r.finish_reason, r.token_times_s, r.output_token_ids, r.block_ids, r.num_preemptions,
                        r.prefix_hit_tokens, r.num_computed_tokens) for r in reqs])  # fmt: skip


def _preempt_if_running(cluster, req) -> None:
    for m in cluster.members:
        if req in m.instance.scheduler.running:
            m.instance.scheduler.preempt(req)


def _abort_newest(cluster, i: int) -> None:
    running = cluster.members[i].instance.scheduler.running
    if running:
        cluster.abort(running[-1])


def _run(monkeypatch, fast: str, router, count, rate, n, kv, *, loud=False) -> tuple[list[str], int]:
    from kvbalance.cluster.config import ClusterConfig, InstanceGroup, build_cluster
    from kvbalance.sim.run import SimulateConfig
    from kvbalance.workloads.presets import build_requests

    monkeypatch.setenv("KVBALANCE_SIM_FAST", fast)
    monkeypatch.setenv("KVBALANCE_SIM_DECODE_RUNS", "0")
    update = {} if kv is None else {"kv_tokens": kv}
    sim = SimulateConfig(model="llama-2-7b", workload="sharegpt", rate=rate, num_requests=n, **update)
    cluster = build_cluster(sim, ClusterConfig(instances=[InstanceGroup(role="colocated", count=count)],
                                               router=router))  # fmt: skip
    reqs = build_requests("sharegpt", n, rate, 0, 4096)
    if loud:
        cluster.loop.at(2.0, cluster.abort, reqs[40])  # a client abort, mid-run
        cluster.loop.at(3.5, _preempt_if_running, cluster, reqs[70])  # a preemption from outside
        for x in range(60):  # aborts, often inside steps that span an arrival: nothing runs past them
            cluster.loop.at(1.0 + 0.0637 * x, _abort_newest, cluster, x % count)
    run = cluster.run(reqs)
    out = [_rows(reqs), json.dumps(run.assignment, sort_keys=True),
           json.dumps([(m.step_starts_s, m.step_durations_s, m.instance.num_steps, m.instance.busy_s,
                        m.instance.scheduler.num_preemptions) for m in run.members]),
           json.dumps([[t.column(c).tolist() for c in t.columns] for t in run.timelines])]  # fmt: skip
    ra = cluster.route_ahead
    return out, (ra.passes if ra is not None else 0)


@pytest.mark.parametrize("router, count, rate, n, kv, least", CASES)
def test_routing_ahead_gives_the_stop_at_every_arrival_run_bit_for_bit(monkeypatch, router, count, rate, n, kv,
                                                                        least):  # fmt: skip
    on, passes = _run(monkeypatch, "1", router, count, rate, n, kv)
    off, off_passes = _run(monkeypatch, "0", router, count, rate, n, kv)
    assert passes > least and off_passes == 0  # arrivals run past (only with the fast paths on)
    for i, (a, b) in enumerate(zip(on, off)):
        assert a == b, f"output {i} differs"


def test_routing_ahead_stops_at_loud_events(monkeypatch):
    on, passes = _run(monkeypatch, "1", "least_loaded", 6, 60.0, 300, None, loud=True)
    off, _ = _run(monkeypatch, "0", "least_loaded", 6, 60.0, 300, None, loud=True)
    assert passes > 500
    for i, (a, b) in enumerate(zip(on, off)):
        assert a == b, f"output {i} differs"


class _Contrary(LeastLoadedRouter):
    """Says it picks the least loaded, picks the most loaded."""

    def choose(self, req, loads):
        return argmin([-self.score(ld) for ld in loads])


def test_a_router_that_picks_a_member_run_past_is_caught(monkeypatch):
    from kvbalance.cluster.config import ClusterConfig, InstanceGroup, build_cluster
    from kvbalance.cluster.core import Cluster
    from kvbalance.sim.run import SimulateConfig
    from kvbalance.workloads.presets import build_requests

    monkeypatch.setenv("KVBALANCE_SIM_FAST", "1")
    monkeypatch.setenv("KVBALANCE_SIM_DECODE_RUNS", "0")
    sim = SimulateConfig(model="llama-2-7b", workload="sharegpt", rate=60.0, num_requests=200)
    built = build_cluster(sim, ClusterConfig(instances=[InstanceGroup(role="colocated", count=4)]))
    cluster = Cluster(built.members, built.topology, router=_Contrary(built.block_size))
    assert cluster.route_ahead is not None
    with pytest.raises(RuntimeError, match="ran past arrival"):
        cluster.run(build_requests("sharegpt", 200, 60.0, 0, 4096))


@pytest.mark.parametrize("name", ["least_loaded", "least_requests"])
def test_a_router_of_counts_picks_the_lowest_score_first_on_ties(name):
    router = build_router(name)
    assert router.count_weights is not None
    rng = random.Random(3)
    for _ in range(300):
        loads = [
            _load(rng.randint(0, 3), rng.randint(0, 1), rng.randint(0, 6)) for _ in range(rng.randint(1, 6))
        ]
        assert router.choose(None, loads) == argmin([router.score(ld) for ld in loads])


def test_other_routers_do_not_pick_by_counts():
    assert Router.count_weights is None
    for name in ("round_robin", "cache_aware", "kv_aware", "load_aware"):
        assert build_router(name).count_weights is None
    with pytest.raises(NotImplementedError):
        build_router("round_robin").score(_load(0, 0, 0))


def _load(waiting: int, loading: int, running: int) -> InstanceLoad:
    return InstanceLoad(
        name="i", num_waiting=waiting, num_running=running, num_loading=loading, queued_prefill_tokens=0,
        decode_tokens=0, remaining_output_tokens=0, kv_used_tokens=0, kv_cached_tokens=0,
        kv_capacity_tokens=1 << 20, busy_s=0.0, num_steps=0, num_preemptions=0, admitted_tokens=0,
        prefix_hit_tokens=0, external_hit_tokens=0,
    )  # fmt: skip
