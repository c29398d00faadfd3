"""Cluster core: one clock for many instances, P/D hand-off through the connector, utilisation figures."""

from __future__ import annotations

import math

import pytest

from kvbalance.cluster.core import Cluster, Member, sim_member
from kvbalance.cluster.topology import Topology
from kvbalance.cluster.utilization import busy_fraction_series, hot_spot_ratio
from kvbalance.request import RequestState
from kvbalance.sim.loop import simulate_instance
from kvbalance.sim.run import SimulateConfig, build_sim_instance
from kvbalance.specs import get_link, get_model
from kvbalance.workloads.presets import build_requests

WORKLOAD = "uniform:16-300:8-120"


def _cfg(**kw) -> SimulateConfig:
    base = dict(model="llama-2-7b", gpu="a100-80gb", workload=WORKLOAD, rate=40.0, num_requests=120, seed=3)
    return SimulateConfig(**{**base, **kw})


def _members(cfg: SimulateConfig, roles: list[str], decode_kv_tokens: int | None = None) -> list[Member]:
    out = []
    for i, role in enumerate(roles):
        small = role == "decode" and decode_kv_tokens is not None
        out.append(
            sim_member(
                i, role, (i,), cfg.model_copy(update={"kv_tokens": decode_kv_tokens}) if small else cfg
            )
        )
    return out


def _requests(cfg: SimulateConfig, n: int | None = None):
    return build_requests(cfg.workload, n or cfg.num_requests, cfg.rate, cfg.seed, 4096)


def test_one_colocated_member_is_exactly_simulate_instance():
    cfg = _cfg()
    inst, _ = build_sim_instance(cfg)
    ref = simulate_instance(inst, _requests(cfg))
    run = Cluster(_members(cfg, ["colocated"]), Topology.build(cfg.gpu, 1)).run(_requests(cfg))
    assert [r.finish_s for r in run.requests] == [r.finish_s for r in ref.requests]
    assert [r.output_token_ids for r in run.requests] == [r.output_token_ids for r in ref.requests]


def test_topology_links_nvlink_inside_a_node_network_between():
    topo = Topology.build("a100-80gb", 16, gpus_per_node=8)
    assert topo.link(0, 7).name == "nvlink" and topo.link(7, 8).name == "net-200g"
    nv = get_link("nvlink")
    assert topo.transfer_s(3e9, (0,), (1,)) == pytest.approx(nv.latency_s + 3e9 / nv.bandwidth_bytes_s)
    net = get_link("net-200g")  # TP 2 -> 2 across nodes: two shards in parallel on the slower link
    assert topo.transfer_s(4e9, (6, 7), (8, 9)) == pytest.approx(net.latency_s + 2e9 / net.bandwidth_bytes_s)
    with pytest.raises(ValueError, match="gpu: index 16"):
        topo.node_of(16)


def test_pd_conserves_blocks_and_never_decodes_before_kv_arrives():
    # small decode pools force preemptions there while transfers land
    cfg = _cfg(num_requests=150, rate=60.0)
    members = _members(cfg, ["prefill", "prefill", "decode", "decode"], decode_kv_tokens=3000)
    cluster = Cluster(members, Topology.build(cfg.gpu, 4), router="load_aware", check_invariants=True)
    run = cluster.run(_requests(cfg))
    assert all(r.state is RequestState.FINISHED for r in run.requests)
    assert sum(m.instance.scheduler.num_preemptions for m in members[2:]) > 0
    by_id = {h.req.request_id: h for h in cluster.pd.handoffs}
    assert len(by_id) == sum(1 for r in run.requests if r.max_tokens > 1)
    for r in run.requests:
        assert len(r.output_token_ids) == r.max_tokens
        h = by_id.get(r.request_id)
        if h is not None:
            assert r.token_times_s[0] == h.ready_s  # the prefill member sampled the first token
            assert r.token_times_s[1] > h.done_s  # the second only after the KV landed
    for m in members:  # nothing leaked: only idle cached blocks remain, nothing locked
        cache = m.instance.cache
        assert m.instance.pool.num_used == cache.num_cached_blocks and cache.protected_blocks == 0
        cluster.check_member(m)


def test_pd_transfer_time_is_bytes_over_link_bandwidth_plus_latency():
    cfg = _cfg(num_requests=1, rate=1.0)
    members = _members(cfg, ["prefill", "decode"])
    topo = Topology.build(cfg.gpu, 16)
    members[1].gpus = (9,)  # the decode GPU sits on the other node: the network link
    cluster = Cluster(members, topo, pd_options={"layerwise_transfer": False})
    run = cluster.run(_requests(cfg, 1))
    (h,) = cluster.pd.handoffs
    kv = run.requests[0].num_prompt_tokens * get_model(cfg.model).kv_bytes_per_token
    net = get_link("net-200g")
    assert h.done_s - h.start_s == pytest.approx(net.latency_s + kv / net.bandwidth_bytes_s)
    assert h.start_s == h.ready_s


def test_layerwise_transfer_hides_under_the_prefill_step():
    cfg = _cfg(num_requests=1, rate=1.0)
    members = _members(cfg, ["prefill", "decode"])
    cluster = Cluster(members, Topology.build(cfg.gpu, 2))  # NVLink: the transfer is shorter than the step
    cluster.run(_requests(cfg, 1))
    (h,) = cluster.pd.handoffs
    assert h.done_s == h.ready_s


def test_busy_fraction_series_is_exact_overlap_per_window():
    t, f = busy_fraction_series([0.0, 1.5, 3.9], [1.0, 1.0, 0.2], 4.1, 1.0)
    assert t.tolist() == [0, 1, 2, 3, 4]
    assert f.tolist() == pytest.approx([1.0, 0.5, 0.5, 0.1, 0.1])


def test_hot_spot_ratio_is_max_over_min_busy_fraction_per_role():
    busy = {"p0": 0.2, "p1": 0.8, "d0": 0.5, "d1": 0.5, "c0": 0.0, "c1": 0.3}
    roles = {
        "p0": "prefill",
        "p1": "prefill",
        "d0": "decode",
        "d1": "decode",
        "c0": "colocated",
        "c1": "colocated",
    }
    assert hot_spot_ratio(busy, roles) == {"prefill": 4.0, "decode": 1.0, "colocated": math.inf}


def test_cluster_rows_and_hot_spot_from_a_run():
    cfg = _cfg()
    run = Cluster(_members(cfg, ["colocated"] * 3), Topology.build(cfg.gpu, 3), router="round_robin").run(
        _requests(cfg)
    )
    rows = run.instance_rows()
    assert [r["requests"] for r in rows] == [40, 40, 40]
    busy = run.busy_fractions()
    ratio = run.hot_spot_ratio()["colocated"]
    assert ratio == pytest.approx(max(busy.values()) / min(busy.values()))
    assert all(0 < b <= 1 for b in busy.values())


def test_cluster_rejects_bad_layouts():
    cfg = _cfg()
    with pytest.raises(ValueError, match="prefill instances need decode"):
        Cluster(_members(cfg, ["prefill"]), Topology.build(cfg.gpu, 1))
    with pytest.raises(ValueError, match="role"):
        _members(cfg, ["both"])


@pytest.mark.parametrize("seed", [1, 2])
def test_aborts_crossing_transfers_and_preemptions_lose_nothing(seed):
    cfg = _cfg(num_requests=120, rate=80.0, seed=seed)
    members = _members(cfg, ["prefill", "prefill", "decode", "decode"], decode_kv_tokens=2500)
    cluster = Cluster(members, Topology.build(cfg.gpu, 4), router="round_robin", check_invariants=True)
    reqs = _requests(cfg)
    states = []
    # abort every 7th request at staggered times: some still prefilling, some queued or loading on the
    # decode side, some decoding (preemptions happen there too: small decode pools)
    for i, r in enumerate(reqs[::7]):
        t = r.arrival_s + 0.002 * (i % 5) + 0.01 * i

        def abort(r=r):
            states.append(r.state)
            cluster.abort(r)

        cluster.loop.at(t, abort)
    run = cluster.run(reqs)
    aborted = {r.request_id for r in run.requests if r.state is RequestState.ABORTED}
    assert aborted and len({s for s in states}) >= 2  # aborts hit requests in different states
    assert all(r.state is RequestState.FINISHED for r in run.requests if r.request_id not in aborted)
    for m in members:
        cache = m.instance.cache
        assert m.instance.pool.num_used == cache.num_cached_blocks and cache.protected_blocks == 0
        assert not m.instance.scheduler._held  # every hold released once its transfer landed
        cluster.check_member(m)


def test_monitor_samples_every_gpu_on_the_control_interval_and_stops_with_the_run():
    from kvbalance.cluster.monitor import UtilizationMonitor

    cfg = _cfg(num_requests=80)
    mon = UtilizationMonitor(window_s=0.5)
    ticks = []
    cluster = Cluster(_members(cfg, ["prefill", "decode", "decode"]), Topology.build(cfg.gpu, 3), monitor=mon,
                      control_interval_s=0.25, on_tick=lambda c, now, snap: ticks.append((now, snap)))  # fmt: skip
    run = cluster.run(_requests(cfg))
    times = [t for t, _ in ticks]
    assert times == [pytest.approx(0.25 * i) for i in range(len(times))]
    end = max(r.finish_s for r in run.requests)
    assert end <= times[-1] < end + 0.25 + 1e-9  # no tick long after the last event: the loop ends
    assert set(ticks[-1][1]) == {"gpu0", "gpu1", "gpu2"} and len(mon.history) == len(ticks)
    busy = [snap["gpu1"].busy_util for _, snap in ticks[2:-2]]
    assert all(0 <= u <= 1 + 1e-9 for u in busy) and max(busy) > 0
