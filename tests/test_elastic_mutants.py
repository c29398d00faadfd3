"""Elastic KV reserve: the reserve formulas on a toy shape (hand-computed bytes) and lend / reclaim pinned
exactly on a stub scheduler (counters, switch times, admission, what is drained)."""

from __future__ import annotations

import pytest
from conftest import make_request

from kvbalance.kvcache import elastic_reserve as er
from kvbalance.kvcache.blocks import BlockPool, ElasticBlockPool
from kvbalance.kvcache.elastic import GIB, ElasticConfig, ElasticReserve
from kvbalance.kvcache.prefix import RadixCache, prefix_block_hashes

# L = 2 layers, h = 8, H = 4 query heads, K = 2 KV heads, d = 2, I = 16, V = 10, e = 2 bytes
TOY = dict(
    num_layers=2, hidden_size=8, num_heads=4, num_kv_heads=2, head_dim=2, intermediate_size=16, vocab_size=10
)


def test_activation_reserve_is_resident_plus_the_largest_phase():
    # C = 5: resident 2*5*8*2 = 160; attn 5*2*((4+4)*2 + (4+2)*2 + 4*2 + 8) = 440;
    # mlp 5*2*(32 + 16 + 8) = 560; sampler 5*10*(2 + 8) = 500 -> 160 + 560
    assert er.activation_reserve_bytes(chunk_size=5, **TOY) == 720
    assert er.activation_reserve_bytes(chunk_size=5, num_sampled_tokens=1, **TOY) == 720
    # a big vocabulary makes the sampler's logits the peak: 5 * 100 * 10 = 5000
    assert er.activation_reserve_bytes(chunk_size=5, **{**TOY, "vocab_size": 100}) == 160 + 5000
    assert (
        er.activation_reserve_bytes(chunk_size=5, num_sampled_tokens=2, **{**TOY, "vocab_size": 100}) == 2160
    )
    # tp = 2: heads 2 / 1, I 8: attn 10*(8 + 6 + 4 + 8) = 260, mlp 10*(16 + 8 + 8) = 320
    assert er.activation_reserve_bytes(chunk_size=5, tp=2, num_sampled_tokens=1, **TOY) == 160 + 320
    # tp = 4: KV heads round up (replicated): attn 10*(6 + 4 + 2 + 8) = 200, mlp 10*(8 + 4 + 8) = 200
    assert er.activation_reserve_bytes(chunk_size=5, tp=4, num_sampled_tokens=1, **TOY) == 160 + 200
    assert er.activation_reserve_bytes(chunk_size=5, num_sampled_tokens=0, **TOY) == 720
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        er.activation_reserve_bytes(chunk_size=0, **TOY)
    with pytest.raises(ValueError, match="num_sampled_tokens must be non-negative"):
        er.activation_reserve_bytes(chunk_size=5, num_sampled_tokens=-1, **TOY)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        er.activation_reserve_bytes(chunk_size=5, tp=0, **TOY)


def test_kv_bytes_pool_share_and_lendable_tokens():
    assert er.kv_bytes_per_token(**TOY) == 2 * 2 * 2 * 2 * 2 == 32
    assert er.kv_bytes_per_token(tp=2, **TOY) == 16 and er.kv_bytes_per_token(tp=4, **TOY) == 16
    assert er.kv_pool_bytes(1000, 300, 100, 0.9, 50) == 900 - 300 - 100 - 50
    assert er.kv_pool_bytes(1000, 0, 0, 1.0) == 1000
    assert er.reserve_share_of_kv(1000, 300, 100, 0.9, 50) == 100 / (100 + 450)
    assert er.lendable_kv_tokens(100, **TOY) == 3 and er.lendable_kv_tokens(0, **TOY) == 0
    with pytest.raises(ValueError, match="no memory left for the KV pool"):
        er.kv_pool_bytes(1000, 800, 100)
    with pytest.raises(ValueError, match="gpu_memory_bytes must be positive"):
        er.kv_pool_bytes(0, 0, 0)
    with pytest.raises(ValueError, match="gpu_memory_utilization must lie in"):
        er.kv_pool_bytes(1000, 0, 0, 1.5)
    for i, name in enumerate(("weight_bytes", "reserve_bytes", "other_bytes")):
        args = [0, 0, 0]
        args[i] = -1
        with pytest.raises(ValueError, match=f"^{name} must be non-negative"):
            er.kv_pool_bytes(1000, args[0], args[1], 0.9, args[2])
    with pytest.raises(ValueError, match="reserve_bytes must be non-negative"):
        er.lendable_kv_tokens(-1, **TOY)


def test_model_shape_reads_objects_dicts_and_aliases():
    s = er.model_shape(TOY)
    assert (s.num_layers, s.hidden_size, s.vocab_size, s.dtype_bytes) == (2, 8, 10, 2)
    assert er.model_shape(s) == s  # any object with the attribute names
    aliased = er.model_shape(
        None, num_layers=2, hidden=8, num_heads=4, num_kv_heads=2, head_dim=2, intermediate=16, vocab=10
    )
    assert aliased == s
    assert er.model_shape(TOY, hidden_size=16, dtype_bytes=4).hidden_size == 16  # keywords win
    assert er.model_shape(TOY, dtype_bytes=4).dtype_bytes == 4
    with pytest.raises(ValueError, match="model shape is missing 'vocab_size'"):
        er.model_shape({k: v for k, v in TOY.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="head_dim must be a positive integer, got 0"):
        er.model_shape(TOY, head_dim=0)
    with pytest.raises(ValueError, match="head_dim must be a positive integer"):
        er.model_shape(TOY, head_dim=2.5)
    with pytest.raises(TypeError, match=r"unknown model shape fields: \['layers'\]"):
        er.model_shape(TOY, layers=3)


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
    cfg = ElasticConfig.for_model(TOY, chunk_size=50, block_size=1, max_num_seqs=5, mode="static")
    reserve = er.activation_reserve_bytes(chunk_size=50, **TOY)
    keep = er.activation_reserve_bytes(chunk_size=5, **TOY)
    assert (cfg.reserve_bytes, cfg.block_bytes, cfg.mode) == (reserve, 32, "static")
    assert cfg.reserve_blocks == (reserve - keep) // 32
    assert cfg.activation_bytes(5) == keep and cfg.activation_bytes(0) == er.activation_reserve_bytes(
        chunk_size=1, **TOY
    )


class StubScheduler:
    def __init__(self) -> None:
        self.running, self.waiting, self.admission_open, self.prefill = [], [], True, False
        self.preempted: list[str] = []

    def has_prefill_work(self) -> bool:
        return self.prefill

    def preempt(self, req) -> None:
        self.preempted.append(req.request_id)
        self.running.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []


def _reserve(lend_min_used_fraction=0.0, with_cache=False):
    pool = ElasticBlockPool(4, 2, num_elastic=2)
    cfg = ElasticConfig(reserve_blocks=2, block_bytes=GIB, lend_min_used_fraction=lend_min_used_fraction)
    cache = RadixCache(pool) if with_cache else None
    sched = StubScheduler()
    sched.pool = pool
    return ElasticReserve(cfg, pool, sched, cache, base_blocks=4), pool


def test_lends_only_for_decode_only_batches_and_reclaims_when_a_request_waits():
    res, pool = _reserve()
    sched = res.scheduler
    assert res.before_step(0.0) == 0.0 and not res.lent  # nothing runs
    sched.running = [make_request("a", 2)]
    sched.prefill = True
    assert res.before_step(0.0) == 0.0 and not res.lent  # a prompt is unfinished
    sched.prefill = False
    assert res.before_step(1.0) == pytest.approx(0.0001 + 2 * 0.002)
    assert res.lent and not sched.admission_open and pool.num_blocks == 6 and pool.capacity_tokens == 12
    assert res.before_step(2.0) == 0.0 and res.lend(2.0) == 0.0  # already lent
    sched.waiting = [make_request("w", 2)]
    assert res.before_step(4.0) == pytest.approx(0.0001 + 2 * 0.002)
    assert not res.lent and sched.admission_open and pool.num_blocks == 4 and res.reclaim(5.0) == 0.0
    assert res.stats(9.0) == {
        "mode": "elastic",
        "reserve_blocks": 2,
        "reserve_bytes": 2 * GIB,
        "lends": 1,
        "reclaims": 1,
        "drain_preemptions": 0,
        "drain_evicted_blocks": 0,
        "switch_s": pytest.approx(2 * (0.0001 + 2 * 0.002)),
        "lent_s": 3.0,
        "peak_capacity_tokens": 12,
    }


def test_lending_waits_until_the_base_pool_is_used_enough():
    res, pool = _reserve(lend_min_used_fraction=0.5)
    res.scheduler.running = [make_request("a", 2)]
    held = pool.allocate(1)
    assert res.before_step(0.0) == 0.0 and not res.lent  # 1 of 4 base blocks used < 50%
    held += pool.allocate(1)
    assert res.before_step(0.0) > 0 and res.lent  # exactly half is enough
    assert res.stats(3.0)["lent_s"] == 3.0 and res.stats()["lent_s"] == 0.0


def test_reclaim_preempts_lent_block_holders_newest_first_and_evicts_lent_cached_blocks():
    res, pool = _reserve(with_cache=True)
    sched = res.scheduler
    old, new, base_only = make_request("old", 2), make_request("new", 2), make_request("base", 2)
    sched.running = [old, new, base_only]
    res.lend(0.0)
    base_only.block_ids = pool.allocate(4)  # the base pool first
    old.block_ids, new.block_ids = pool.allocate(1), pool.allocate(1)  # then the two lent blocks
    assert min(old.block_ids + new.block_ids) >= 4
    res.cache.insert(prefix_block_hashes([1, 2], 2), new.block_ids)
    pool.free(new.block_ids)  # a lent block now held by the cache only
    new.block_ids = []
    sched.running = [old, base_only]
    sched.waiting = [make_request("w", 2)]
    res.before_step(1.0)
    assert sched.preempted == ["old"] and res.drain_preemptions == 1 and res.drain_evicted_blocks == 1
    assert not res.lent and res.cache.num_cached_blocks == 0 and pool.num_blocks == 4
    pool.free(base_only.block_ids)
    assert pool.num_free == 4


def test_activation_memory_left_and_the_static_oom_check():
    pool = BlockPool(6, 2)
    cfg = ElasticConfig(reserve_blocks=2, block_bytes=100, mode="static", reserve_bytes=250)
    res = ElasticReserve(cfg, pool, StubScheduler(), None, base_blocks=4)
    assert res.activation_free_bytes() == 250 and res.before_step(0.0) == 0.0
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
    elastic.scheduler.running = [make_request("a", 2)]
    elastic.before_step(0.0)
    assert elastic.activation_free_bytes() == 0  # the whole region is mapped into the pool
    assert elastic.fits(Plan(3, 0))
    with pytest.raises(RuntimeError, match="a prefill was planned while the reserve is lent"):
        elastic.fits(Plan(3, 1))
    with pytest.raises(TypeError, match="pool: elastic mode needs an ElasticBlockPool"):
        ElasticReserve(
            ElasticConfig(reserve_blocks=1, block_bytes=1), BlockPool(2, 2), StubScheduler(), None, 2
        )
