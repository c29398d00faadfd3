"""Elastic KV reserve: config checks and switch times, and lend / reclaim pinned exactly on the reserve alone
(the switches it returns: what to preempt, admission; counters, what is drained, the static mode's
activation-memory check)."""

from __future__ import annotations

import pytest
from conftest import make_request

from kvbalance.kvcache.blocks import BlockPool, ElasticBlockPool
from kvbalance.kvcache.elastic import GIB, NO_SWITCH, ElasticConfig, ElasticReserve, ReserveSwitch
from kvbalance.kvcache.prefix import RadixCache, prefix_block_hashes
from kvbalance.perf import memory
from kvbalance.specs import get_model


def test_elastic_config_sizes_switch_times_and_validation():
    cfg = ElasticConfig(reserve_blocks=4, block_bytes=GIB // 8)
    assert cfg.reserve_bytes == GIB // 2 and cfg.region_bytes == GIB // 2
    assert cfg.map_s() == pytest.approx(0.0001 + 0.5 * 0.002)
    slow_unmap = ElasticConfig(reserve_blocks=4, block_bytes=GIB // 8, unmap_s_per_gib=0.01, map_fixed_s=0.0)
    assert slow_unmap.unmap_s() == pytest.approx(0.005) and slow_unmap.map_s() == pytest.approx(0.001)
    assert ElasticConfig(reserve_blocks=0, block_bytes=1).reserve_bytes == 0
    bad = [
        (dict(mode="lazy"), "mode"),
        (dict(reserve_blocks=-1), "reserve_blocks"),
        (dict(block_bytes=0), "block_bytes"),
        (dict(map_s_per_gib=-1.0), "map_s_per_gib"),
        (dict(unmap_s_per_gib=-1.0), "unmap_s_per_gib"),
        (dict(map_fixed_s=-1.0), "map_fixed_s"),
        (dict(lend_min_used_fraction=1.5), "lend_min_used_fraction"),
        (dict(reserve_bytes=3), "reserve_bytes"),
    ]
    for kw, field in bad:
        with pytest.raises(ValueError, match=f"^{field}: "):
            ElasticConfig(**{"reserve_blocks": 2, "block_bytes": 4, **kw})
    assert (
        ElasticConfig(reserve_blocks=2, block_bytes=4, lend_min_used_fraction=1.0).lend_min_used_fraction == 1
    )


def test_config_for_a_model_lends_what_a_decode_step_does_not_need():
    m = get_model("llama-2-7b")
    cfg = ElasticConfig.for_model(m, chunk_size=2048, block_size=16, max_num_seqs=64, mode="static")
    reserve = memory.activation_reserve_bytes(m, 2048, 1)
    keep = memory.activation_reserve_bytes(m, 64, 1)
    assert (cfg.reserve_bytes, cfg.block_bytes, cfg.mode) == (
        reserve,
        16 * memory.kv_bytes_per_token(m),
        "static",
    )
    assert cfg.reserve_blocks == (reserve - keep) // cfg.block_bytes > 0
    assert cfg.activation_bytes(64) == keep
    assert cfg.activation_bytes(0) == memory.activation_reserve_bytes(m, 1, 1)  # at least one token


def _reserve(lend_min_used_fraction=0.0, with_cache=False, num_elastic=2):
    pool = ElasticBlockPool(4, 2, num_elastic=num_elastic)
    cfg = ElasticConfig(
        reserve_blocks=num_elastic, block_bytes=GIB, lend_min_used_fraction=lend_min_used_fraction
    )
    cache = RadixCache(pool) if with_cache else None
    return ElasticReserve(cfg, pool, cache, base_blocks=4), pool


SWITCH_S = 0.0001 + 2 * 0.002  # map / unmap of the 2 GiB region


def test_lends_only_for_decode_only_batches_and_reclaims_when_a_request_waits():
    res, pool = _reserve()
    a = make_request("a", 2)
    assert res.before_step([], waiting=False, has_prefill_work=False) == NO_SWITCH  # nothing runs
    assert res.before_step([a], waiting=False, has_prefill_work=True) == NO_SWITCH  # a prompt is unfinished
    lend = res.before_step([a], waiting=False, has_prefill_work=False)
    assert lend == ReserveSwitch("lend", (), admission_open=False)
    assert not res.lent and pool.num_blocks == 4  # deciding changes nothing
    assert res.apply(lend, 1.0) == pytest.approx(SWITCH_S)
    assert res.lent and pool.num_blocks == 6 and pool.capacity_tokens == 12
    assert res.before_step([a], False, False) == NO_SWITCH and res.lend_switch() == NO_SWITCH  # already lent
    assert res.apply(lend, 2.0) == 0.0 and pool.num_blocks == 6
    reclaim = res.before_step([a], waiting=True, has_prefill_work=False)
    assert reclaim == ReserveSwitch("reclaim", (), admission_open=True)  # a holds no lent block
    assert res.apply(reclaim, 4.0) == pytest.approx(SWITCH_S)
    assert not res.lent and pool.num_blocks == 4
    assert res.reclaim_switch([a]) == NO_SWITCH and res.apply(reclaim, 5.0) == 0.0
    assert res.apply(NO_SWITCH, 6.0) == 0.0 and not res.lent
    assert res.stats(9.0) == {
        "mode": "elastic",
        "reserve_blocks": 2,
        "reserve_bytes": 2 * GIB,
        "lends": 1,
        "reclaims": 1,
        "drain_preemptions": 0,
        "drain_evicted_blocks": 0,
        "switch_s": pytest.approx(2 * SWITCH_S),
        "lent_s": 3.0,
        "peak_capacity_tokens": 12,
    }


def test_lending_waits_until_the_base_pool_is_used_enough():
    res, pool = _reserve(lend_min_used_fraction=0.5)
    running = [make_request("a", 2)]
    held = pool.allocate(1)
    assert res.before_step(running, False, False) == NO_SWITCH  # 1 of 4 base blocks used < 50%
    held += pool.allocate(1)
    assert res.apply(res.before_step(running, False, False), 0.0) > 0 and res.lent  # exactly half is enough
    assert res.stats(3.0)["lent_s"] == 3.0 and res.stats()["lent_s"] == 0.0


def test_reclaim_asks_to_preempt_lent_block_holders_newest_first_and_evicts_lent_cached_blocks():
    res, pool = _reserve(with_cache=True, num_elastic=3)
    old, mid, new, base_only = (make_request(n, 2) for n in ("old", "mid", "new", "base"))
    res.apply(res.lend_switch(), 0.0)
    base_only.block_ids = pool.allocate(4)  # the base pool first
    old.block_ids, mid.block_ids, new.block_ids = pool.allocate(1), pool.allocate(1), pool.allocate(1)
    assert min(old.block_ids + mid.block_ids + new.block_ids) >= 4  # then the lent blocks
    res.cache.insert(prefix_block_hashes([1, 2], 2), new.block_ids)
    pool.free(new.block_ids)  # a lent block now held by the cache only
    new.block_ids = []
    running = [old, base_only, mid]
    switch = res.before_step(running, waiting=True, has_prefill_work=False)
    assert switch.action == "reclaim" and switch.admission_open is True
    assert [r.request_id for r in switch.preempt] == ["mid", "old"]  # newest first; base-only stays
    assert res.lent and pool.num_blocks == 7  # nothing done yet
    with pytest.raises(RuntimeError, match="detach of a block in use"):  # holders not preempted yet
        res.apply(switch, 1.0)
    for req in switch.preempt:  # what the instance's scheduler does
        pool.free(req.block_ids)
        req.block_ids = []
    assert res.apply(switch, 1.0) == pytest.approx(0.0001 + 3 * 0.002)
    assert res.drain_preemptions == 2 and res.drain_evicted_blocks == 1
    assert not res.lent and res.cache.num_cached_blocks == 0 and pool.num_blocks == 4
    pool.free(base_only.block_ids)
    assert pool.num_free == 4


def test_activation_memory_left_and_the_static_oom_check():
    pool = BlockPool(6, 2)
    cfg = ElasticConfig(reserve_blocks=2, block_bytes=100, mode="static", reserve_bytes=250)
    res = ElasticReserve(cfg, pool, None, base_blocks=4)
    assert (
        res.activation_free_bytes() == 250
        and res.before_step([make_request("a", 2)], False, False) == NO_SWITCH
    )
    pool.allocate(5)  # one block past the base pool
    assert res.activation_free_bytes() == 150
    assert res.step_activation_bytes(8, has_prefill=True) == 250 and res.step_activation_bytes(8, False) == 0

    class Plan:
        def __init__(self, tokens, prefill):
            self.num_tokens, self.num_prefill_tokens = tokens, prefill

    assert res.fits(Plan(3, 0)) and not res.fits(Plan(3, 2))
    cfg.activation_bytes = lambda n: 50 * n
    assert res.fits(Plan(3, 2)) and not res.fits(Plan(4, 2))  # 150 fits exactly, 200 does not
    elastic, _ = _reserve()
    elastic.apply(elastic.before_step([make_request("a", 2)], False, False), 0.0)
    assert elastic.activation_free_bytes() == 0  # the whole region is mapped into the pool
    assert elastic.fits(Plan(3, 0))
    with pytest.raises(RuntimeError, match="a prefill was planned while the reserve is lent"):
        elastic.fits(Plan(3, 1))
    with pytest.raises(TypeError, match="pool: elastic mode needs an ElasticBlockPool"):
        ElasticReserve(ElasticConfig(reserve_blocks=1, block_bytes=1), BlockPool(2, 2), None, 2)
