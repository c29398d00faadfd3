"""BlockPool.resize / KVCacheManager.resize: a layer migration changes a pool's size; blocks are conserved."""

from __future__ import annotations

import random

import pytest

from kvbalance.kvcache.blocks import BlockPool, ElasticBlockPool, OutOfBlocks
from kvbalance.kvcache.manager import KVCacheManager
from kvbalance.request import Request, SamplingParams


def test_grow_adds_free_blocks_and_shrink_takes_only_free_ones():
    pool = BlockPool(8, 16)
    held = pool.allocate(5)
    pool.resize(12)
    assert (pool.num_blocks, pool.num_free, pool.num_used, pool.capacity_tokens) == (12, 7, 5, 192)
    pool.check_invariants()
    pool.resize(6)  # 6 of the 7 free blocks leave; the 5 in use stay where they are
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (6, 1, 5)
    assert all(pool.ref_count(b) == 1 for b in held)
    pool.check_invariants()
    with pytest.raises(OutOfBlocks, match="2 blocks must leave, 1 are free"):
        pool.resize(4)
    assert (pool.num_blocks, pool.num_free) == (6, 1)  # unchanged
    pool.free(held)
    pool.resize(4)
    pool.check_invariants()
    assert (pool.num_blocks, pool.num_free, pool.num_total_blocks) == (4, 4, 12)
    pool.resize(10)  # retired ids are reused before new ones are made
    assert pool.num_total_blocks == 12 and pool.num_free == 10
    pool.check_invariants()
    with pytest.raises(ValueError, match="num_blocks"):
        pool.resize(0)


def test_random_resizes_conserve_blocks():
    rng = random.Random(0)
    pool = BlockPool(32, 4)
    tables: list[list[int]] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.35 and pool.num_free:
            tables.append(pool.allocate(rng.randint(1, pool.num_free)))
        elif op < 0.6 and tables:
            pool.free(tables.pop(rng.randrange(len(tables))))
        else:
            target = rng.randint(1, 64)
            try:
                pool.resize(target)
            except OutOfBlocks:
                assert pool.num_blocks - target > pool.num_free
        used = sum(len(t) for t in tables)
        assert pool.num_used == used and pool.num_free == pool.num_blocks - used
        pool.check_invariants()
    assert len({b for t in tables for b in t}) == sum(len(t) for t in tables)  # no block handed out twice


def test_manager_resize_evicts_idle_cache_first_and_never_in_use_kv():
    kv = KVCacheManager(BlockPool(8, 4))
    a = Request("a", list(range(16)), SamplingParams(max_tokens=1))
    hit = kv.get_computed_blocks(a)
    kv.admit(a, hit, 16)
    a.num_computed_tokens = 16
    kv.cache_full_blocks(a)
    b = Request("b", list(range(100, 108)), SamplingParams(max_tokens=1))
    kv.admit(b, kv.get_computed_blocks(b), 8)
    kv.free(a)  # a's 4 blocks stay cached, idle; b holds 2; 2 free
    assert (kv.pool.num_free, kv.num_available_blocks) == (2, 6)
    assert kv.resize(3)  # 5 must leave: 2 free + 3 evicted from the cache
    assert (kv.pool.num_blocks, kv.pool.num_used) == (3, 3) and len(b.block_ids) == 2
    assert not kv.resize(1)  # b's 2 blocks are in use: they never move
    assert kv.pool.num_blocks >= 2
    kv.check_invariants([b])
    assert kv.resize(20) and kv.pool.num_free == 20 - kv.pool.num_used
    kv.check_invariants([b])


def test_elastic_pool_resizes_only_through_its_region():
    with pytest.raises(ValueError, match="attach / detach"):
        ElasticBlockPool(4, 16, 4).resize(6)
