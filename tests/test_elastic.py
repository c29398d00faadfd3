"""Elastic KV reserve: attach/detach accounting, lend on decode-only, reclaim (drain) before prefill,
modelled switch latency, and static overcommit failing with OOM instead of crashing."""

from __future__ import annotations

import random

import pytest
from conftest import EchoExecutor, make_request

from kvbalance.engine import Instance
from kvbalance.kvcache.blocks import BlockPool, ElasticBlockPool, OutOfBlocks
from kvbalance.kvcache.elastic import ElasticConfig, ElasticReserve, evict_cached_blocks
from kvbalance.kvcache.prefix import RadixCache, prefix_block_hashes
from kvbalance.request import RequestState
from kvbalance.scheduler import SchedulerConfig
from kvbalance.sim import simulate_instance
from kvbalance.specs import get_model

BS = 4
MIB = 1 << 20


def elastic_instance(base_blocks: int, reserve_blocks: int, mode: str = "elastic", budget: int = 64, **kw):
    cfg = ElasticConfig(reserve_blocks=reserve_blocks, block_bytes=MIB, mode=mode, **kw)
    ex = EchoExecutor(step_s=0.01)
    sched = SchedulerConfig(max_num_batched_tokens=budget, watermark=0.0)
    return Instance(ex, num_blocks=base_blocks, block_size=BS, scheduler_config=sched, elastic=cfg), ex


def run_steps(inst: Instance, now: float = 0.0, max_steps: int = 10_000, arrivals=()):
    """Step to completion; ``arrivals`` = [(step_index, request)]; invariants after every step."""
    pending = sorted(arrivals, key=lambda a: a[0])
    outcomes = []
    for i in range(max_steps):
        while pending and pending[0][0] <= i:
            inst.add_request(pending.pop(0)[1], now)
        out = inst.step(now)
        if out is None:
            if not pending:
                break
            continue
        now += out.result.duration_s
        inst.complete(out, now)
        inst.check_invariants()
        outcomes.append(out)
    return outcomes, now


# -- BlockPool: detached blocks -----------------------------------------------------------------


def test_detached_blocks_are_outside_the_pool_until_attached():
    pool = ElasticBlockPool(6, BS, 4)
    pool.check_invariants()
    assert (pool.num_blocks, pool.num_total_blocks, pool.num_free, pool.num_lent) == (6, 10, 6, 0)
    assert sorted(pool.allocate(6)) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.attach([6, 7, 8, 9])
    pool.check_invariants()
    assert (pool.num_blocks, pool.num_free, pool.capacity_tokens) == (10, 4, 40)
    lent = pool.allocate(2)
    assert set(lent) <= {6, 7, 8, 9}
    with pytest.raises(RuntimeError, match="in use"):
        pool.detach([6, 7, 8, 9])
    pool.free(lent)
    pool.detach([6, 7, 8, 9])
    pool.check_invariants()
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (6, 0, 6)
    with pytest.raises(RuntimeError, match="detached"):
        pool.detach([6])
    with pytest.raises(ValueError, match="elastic region"):
        pool.attach([2])


def test_base_blocks_are_handed_out_before_lent_ones():
    pool = ElasticBlockPool(4, BS, 4)
    pool.attach(pool.elastic_block_ids())
    first = pool.allocate(3)
    assert max(first) < 4
    mixed = pool.allocate(3)
    assert sorted(b < 4 for b in mixed) == [False, False, True]
    pool.free(first)
    assert max(pool.allocate(3)) < 4  # freed base blocks come back before the lent ones
    pool.check_invariants()


def test_random_attach_detach_keeps_accounting_exact():
    rng = random.Random(1)
    pool = ElasticBlockPool(20, BS, 12)
    held: list[int] = []
    attached = False
    for _ in range(3000):
        op = rng.random()
        if op < 0.4 and pool.num_free:
            held += pool.allocate(rng.randint(1, pool.num_free))
        elif op < 0.8 and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            pool.free(held[:k])
            del held[:k]
        elif not attached:
            pool.attach(pool.elastic_block_ids())
            attached = True
        elif not any(b >= 20 for b in held):
            pool.detach(pool.elastic_block_ids())
            attached = False
        pool.check_invariants()
        assert pool.num_used == len(held)


def test_plain_pool_has_no_detached_region():
    pool = BlockPool(8, BS)
    assert pool.num_total_blocks == pool.num_blocks == 8
    inst = Instance(EchoExecutor(), num_blocks=8, block_size=BS)
    assert inst.elastic is None and type(inst.pool) is BlockPool


# -- prefix cache: targeted eviction -------------------------------------------------------------


def test_evicting_a_cached_block_drops_its_descendants_only():
    pool = BlockPool(32, BS)
    cache = RadixCache(pool)
    shared = list(range(100, 108))  # 2 blocks
    seqs = [shared + list(range(200, 212)), shared + list(range(300, 308)), list(range(400, 412))]
    tables = []
    for toks in seqs:
        ids = pool.allocate(len(toks) // BS)
        _, cached = cache.insert(prefix_block_hashes(toks, BS), ids)
        pool.free(ids)  # the cache keeps its own reference
        tables.append(cached)
    cache.check_invariants()
    before = cache.num_cached_blocks
    # the second block of seq 0: its own tail (3 blocks) goes, seq 1 shares it, so its tail (2) goes too
    freed = evict_cached_blocks(cache, [tables[0][1]])
    cache.check_invariants()
    pool.check_invariants()
    assert freed == 1 + 3 + 2
    assert cache.num_cached_blocks == before - freed
    assert tables[0][0] in cache.all_block_ids() and set(tables[2]) <= cache.all_block_ids()
    assert cache.evict(100) == 1 + 3  # what is left still evicts normally


def test_evicting_a_locked_block_is_refused():
    pool = BlockPool(8, BS)
    cache = RadixCache(pool)
    ids = pool.allocate(2)
    node, _ = cache.extend(cache.root, 0, prefix_block_hashes(list(range(8)), BS), ids)
    with pytest.raises(RuntimeError, match="running request"):
        evict_cached_blocks(cache, [ids[1]])
    cache.unlock(node)
    pool.free(ids)
    assert evict_cached_blocks(cache, [ids[1]]) == 1


# -- policy: lend on decode-only, reclaim before prefill -----------------------------------------


def test_lends_when_decode_only_and_reclaims_before_prefill():
    inst, _ = elastic_instance(base_blocks=32, reserve_blocks=8)
    inst.add_request(make_request("a", 10, max_tokens=20), 0.0)
    out = inst.step(0.0)  # the prompt: no lending
    assert out.plan.num_prefill_tokens == 10 and not inst.elastic.lent
    inst.complete(out, 0.01)
    out = inst.step(0.01)  # decode-only from here: the region joins the pool
    assert inst.elastic.lent and inst.pool.num_blocks == 40 and not inst.scheduler.admission_open
    assert out.plan.num_prefill_tokens == 0
    inst.complete(out, 0.02)
    inst.add_request(make_request("b", 10, max_tokens=4), 0.02)
    out = inst.step(0.02)  # a prompt waits: reclaim first, then it is admitted
    assert not inst.elastic.lent and inst.pool.num_blocks == 32 and inst.scheduler.admission_open
    assert out.plan.num_prefill_tokens == 10
    inst.complete(out, 0.03)
    run_steps(inst, 0.03)
    assert inst.elastic.num_lends >= 2 and inst.elastic.num_reclaims >= 1


def test_switch_latency_is_added_to_the_step():
    inst, ex = elastic_instance(
        base_blocks=32, reserve_blocks=1024, map_s_per_gib=0.004, unmap_s_per_gib=0.004, map_fixed_s=0.0
    )
    assert inst.elastic.config.map_s() == pytest.approx(0.004)  # 1 GiB region
    inst.add_request(make_request("a", 10, max_tokens=5), 0.0)
    outcomes, _ = run_steps(inst, arrivals=[(3, make_request("b", 10, max_tokens=3))])
    el = inst.elastic
    assert el.num_lends == 2 and el.num_reclaims == 1
    assert el.switch_s == pytest.approx(3 * 0.004)
    durations = [o.result.duration_s for o in outcomes]
    assert sum(durations) == pytest.approx(len(durations) * ex.step_s + el.switch_s)
    assert outcomes[1].result.breakdown.overhead_s == pytest.approx(0.004)  # the first decode-only step lends
    assert outcomes[0].result.duration_s == pytest.approx(ex.step_s)


def test_reclaim_drains_lent_blocks_by_preempting_holders_and_evicting_cache():
    # base: 12 blocks of 4 tokens; three requests grow to 8 + 15 = 23 tokens (6 blocks) each: 18 blocks
    def workload():
        reqs = [make_request(f"r{i}", 8, max_tokens=16) for i in range(3)]
        return reqs, [(13, make_request("late", 8, max_tokens=4))]

    ref_reqs, ref_late = workload()
    ref, _ = elastic_instance(base_blocks=64, reserve_blocks=0)
    for r in ref_reqs:
        ref.add_request(r, 0.0)
    run_steps(ref, arrivals=ref_late)

    reqs, late = workload()
    inst, _ = elastic_instance(base_blocks=12, reserve_blocks=8)
    for r in reqs:
        inst.add_request(r, 0.0)
    run_steps(inst, arrivals=late)
    el = inst.elastic
    assert el.num_lends >= 1 and el.num_reclaims >= 1
    assert el.drain_preemptions >= 1  # requests held lent blocks when the late prompt arrived
    assert el.drain_evicted_blocks >= 1  # their full lent blocks were cached: dropped from the cache
    assert sum(r.num_preemptions for r in reqs) >= el.drain_preemptions
    everything = [*reqs, late[0][1]]
    assert all(r.state is RequestState.FINISHED for r in everything)
    for mine, theirs in zip(everything, [*ref_reqs, ref_late[0][1]]):
        assert mine.output_token_ids == theirs.output_token_ids


def test_everything_finishes_in_elastic_mode_under_pressure():
    rng = random.Random(7)
    inst, _ = elastic_instance(base_blocks=40, reserve_blocks=24, budget=32)
    reqs = [
        make_request(f"q{i}", rng.randint(4, 60), max_tokens=rng.randint(1, 60), arrival_s=rng.uniform(0, 2))
        for i in range(60)
    ]
    run = simulate_instance(inst, reqs, check_invariants=True)
    assert not run.unfinished
    assert all(r.state is RequestState.FINISHED for r in reqs)
    assert all(len(r.output_token_ids) == r.max_tokens for r in reqs)
    assert inst.elastic.num_lends >= 1 and inst.elastic.num_reclaims >= 1
    assert not inst.failed


def test_requests_must_fit_the_base_pool():
    inst, _ = elastic_instance(base_blocks=4, reserve_blocks=16)
    big = make_request("big", 12, max_tokens=8)  # 19 tokens = 5 blocks > 4 base blocks
    assert not inst.add_request(big, 0.0)
    assert "kv_capacity" in big.reject_reason


# -- static overcommit ---------------------------------------------------------------------------


def test_static_overcommit_fails_with_oom_instead_of_crashing():
    # reserve 8 MiB = 8 blocks; a step needs 1 MiB per prompt token... and nothing for decodes
    act = lambda n: n * MIB  # noqa: E731
    inst, _ = elastic_instance(base_blocks=8, reserve_blocks=8, mode="static", activation_bytes=act)
    assert inst.pool.num_blocks == 16  # the reserve sits in the pool for good
    background = [make_request(f"bg{i}", 4, max_tokens=20, arrival_s=0.0) for i in range(3)]
    burst = [make_request(f"burst{i}", 8, max_tokens=2, arrival_s=1.0) for i in range(2)]
    late = make_request("late", 4, max_tokens=2, arrival_s=50.0)
    run = simulate_instance(inst, [*background, *burst, late], check_invariants=True)
    assert inst.failed and inst.failure_reason == "oom"
    assert not run.unfinished
    failed = [r for r in [*background, *burst, late] if r.state is RequestState.REJECTED]
    assert failed and all(r.reject_reason == "oom" for r in failed)
    assert late in failed
    assert inst.step(100.0) is None


def test_static_overcommit_survives_while_kv_stays_in_the_base_pool():
    act = lambda n: n * MIB  # noqa: E731
    inst, _ = elastic_instance(
        base_blocks=64, reserve_blocks=8, mode="static", activation_bytes=act, budget=8
    )
    reqs = [make_request(f"s{i}", 8, max_tokens=4, arrival_s=0.1 * i) for i in range(5)]
    simulate_instance(inst, reqs, check_invariants=True)
    assert not inst.failed and all(r.state is RequestState.FINISHED for r in reqs)


def test_config_for_a_real_model_sizes_the_region_from_the_reserve_formula():
    m = get_model("qwen2.5-7b")
    small = ElasticConfig.for_model(m, chunk_size=8192)
    big = ElasticConfig.for_model(m, chunk_size=32768)
    tp4 = ElasticConfig.for_model(m, chunk_size=32768, tp=4)
    assert 0 < small.reserve_blocks < big.reserve_blocks
    assert big.reserve_bytes > 4 * (1 << 30) > big.region_bytes > 3 * (1 << 30)
    assert tp4.reserve_bytes < big.reserve_bytes / 2
    assert big.activation_bytes(32768) == big.reserve_bytes
    assert big.activation_bytes(64) < big.reserve_bytes - big.region_bytes  # decodes never touch the region
    assert 1e-3 < big.map_s() < 2e-2  # milliseconds for a few GiB


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="mode"):
        ElasticConfig(reserve_blocks=1, block_bytes=1, mode="dynamic")
    with pytest.raises(ValueError, match="reserve_blocks"):
        ElasticConfig(reserve_blocks=-1, block_bytes=1)
    with pytest.raises(TypeError, match="ElasticBlockPool"):
        ElasticReserve(ElasticConfig(reserve_blocks=1, block_bytes=1), BlockPool(4, BS), None, 4)


def test_reproduce_scenario_static_fails_elastic_lends_and_keeps_ttft():
    from kvbalance.reproduce import elastic as experiment

    static, _ = experiment.run_mode("static-32768")
    assert static["failed"] and static["failure"] == "oom" and static["rejected_oom"] > 0
    el, _ = experiment.run_mode("elastic-32768")
    assert not el["failed"] and el["completed"] == experiment.NUM_BACKGROUND + experiment.NUM_LONG
    assert el["lends"] >= 1 and el["kv_capacity_lent_tokens"] > 1.15 * el["kv_capacity_tokens"]
    share = experiment.reserve_share("qwen2.5-7b", 4, 32768)["reserve_share_of_kv"]
    assert share < experiment.reserve_share("qwen2.5-7b", 1, 32768)["reserve_share_of_kv"]


@pytest.mark.parametrize("budget", [8, 16])
def test_one_token_last_prompt_chunk_is_prefill_work(budget):
    # prompt = 2 x budget + 1: the last chunk is one prompt token, which is prefill, not a decode
    inst, _ = elastic_instance(base_blocks=64, reserve_blocks=8, budget=budget)
    req = make_request("k", 2 * budget + 1, max_tokens=6)
    inst.add_request(req, 0.0)
    now = 0.0
    for _ in range(2):  # two full chunks
        out = inst.step(now)
        now += out.result.duration_s
        inst.complete(out, now)
    assert req.num_computed_tokens == 2 * budget
    assert inst.scheduler.has_prefill_work()
    run_steps(inst, now)  # raised "a prefill was planned while the reserve is lent" before the fix
    assert req.state is RequestState.FINISHED and req.num_output_tokens == 6
    assert inst.elastic.num_lends >= 1
