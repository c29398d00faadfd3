"""The global KV store inside a cluster: a prefix computed on one instance is fetched by another."""

from __future__ import annotations

import pytest

from kvbalance.batch import BatchPlan, ScheduledSeq
from kvbalance.cluster.connector import prompt_hashes
from kvbalance.cluster.core import Cluster, Member, sim_member
from kvbalance.cluster.topology import Topology
from kvbalance.kvcache.store import GlobalKVStore, StoreConfig, layerwise_pipeline_s
from kvbalance.request import Request, RequestState, SamplingParams
from kvbalance.sim.run import SimulateConfig
from kvbalance.specs import get_model

MODEL = "llama-2-7b"
BS = 16


def _members(roles: list[str]) -> list[Member]:
    cfg = SimulateConfig(model=MODEL, gpu="a100-80gb", kv_tokens=20_000)
    return [sim_member(i, role, (i,), cfg) for i, role in enumerate(roles)]


def _store(**kw) -> GlobalKVStore:
    return GlobalKVStore(StoreConfig(**kw), bytes_per_block=BS * get_model(MODEL).kv_bytes_per_token)


def _shared_prefix_requests(n: int, prefix_blocks: int = 40, gap_s: float = 2.0) -> list[Request]:
    prefix = list(range(1, prefix_blocks * BS + 1))
    return [
        Request(f"r{i}", prefix + list(range(10_000 * (i + 1), 10_000 * (i + 1) + 37)),
                SamplingParams(max_tokens=6, ignore_eos=True), arrival_s=i * gap_s)
        for i in range(n)
    ]  # fmt: skip


def test_second_instance_fetches_the_prefix_the_first_computed():
    members = _members(["colocated", "colocated"])
    store = _store()
    cluster = Cluster(
        members, Topology.build("a100-80gb", 2), router="round_robin", store=store, check_invariants=True
    )
    run = cluster.run(_shared_prefix_requests(4))
    assert all(r.state is RequestState.FINISHED for r in run.requests)
    r0, r1, r2, r3 = run.requests
    # r1 lands on instance 1 and loads the prefix from the store (external tokens, not a local hit)
    assert [m.instance.load().external_hit_tokens for m in members] == [0, 40 * BS]
    assert r0.prefix_hit_tokens == r1.prefix_hit_tokens == 0
    fetched = {f.req.request_id for f in cluster.store.fetches}
    assert fetched == {"r1"}  # r2, r3 find the prefix in their own instance's cache
    assert r2.prefix_hit_tokens == r3.prefix_hit_tokens == 40 * BS
    assert cluster.store.fetched_blocks == 40
    assert all(store.pinned(h) == 0 for h in prompt_hashes(r0, BS, r0.num_prompt_tokens))
    for m in members:
        assert m.instance.cache.protected_blocks == 0
        assert m.instance.pool.num_used == m.instance.cache.num_cached_blocks
        cluster.check_member(m)


@pytest.mark.parametrize("overlap", [True, False])
def test_fetch_delay_is_what_the_layerwise_pipeline_adds_over_compute(overlap):
    members = _members(["colocated", "colocated"])
    store = _store(layerwise_overlap=overlap)
    cluster = Cluster(members, Topology.build("a100-80gb", 2), router="round_robin", store=store)
    cluster.run(_shared_prefix_requests(2))
    (f,) = cluster.store.fetches
    fetch = store.fetch_s(40)
    compute = members[1].instance.executor.cost_model.step_time(
        BatchPlan([ScheduledSeq(f.req, 40 * BS, 37, False)])
    )
    L = get_model(MODEL).num_layers
    if overlap:
        expect = layerwise_pipeline_s([compute / L] * L, [fetch / L] * L) - compute
        assert expect == pytest.approx(max(fetch, compute) + min(fetch, compute) / L - compute)
    else:
        expect = fetch
    assert f.done_s - f.start_s == pytest.approx(expect)
    assert f.req.first_scheduled_s == f.start_s  # admitted holding its blocks, waiting for its KV
    assert f.req.token_times_s[0] > f.done_s  # its prompt is computed only after the fetch landed


def test_pd_with_store_conserves_blocks_on_every_instance():
    members = _members(["prefill", "prefill", "decode", "decode"])
    cluster = Cluster(members, Topology.build("a100-80gb", 4), router="round_robin", store=_store(),
                      check_invariants=True)  # fmt: skip
    run = cluster.run(_shared_prefix_requests(12, gap_s=0.3))
    assert all(r.state is RequestState.FINISHED and len(r.output_token_ids) == 6 for r in run.requests)
    assert cluster.store.fetches  # the second prefill instance fetched instead of recomputing
    for m in members:
        assert m.instance.cache.protected_blocks == 0
        cluster.check_member(m)
