"""Block pool and radix cache: exact accounting under long random operation sequences."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbalance.kvcache import BlockPool, OutOfBlocks, RadixCache, prefix_block_hashes


def test_allocate_and_free_return_blocks():
    pool = BlockPool(8, 4)
    a = pool.allocate(3)
    assert pool.num_free == 5 and len(set(a)) == 3
    pool.incref(a[:1])
    pool.free(a)
    assert pool.num_free == 7 and pool.ref_count(a[0]) == 1
    pool.free(a[:1])
    assert pool.num_free == 8
    pool.check_invariants()


def test_double_free_is_caught():
    pool = BlockPool(4, 4)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a)


def test_allocating_more_than_free_raises():
    pool = BlockPool(2, 4)
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)


def test_bad_pool_sizes_name_the_field():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0)


def test_prefix_hashes_depend_on_whole_prefix():
    a = prefix_block_hashes(list(range(12)), 4)
    b = prefix_block_hashes([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11], 4)
    assert len(a) == 3 and a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    # incremental extension gives the same chain
    tail = prefix_block_hashes(list(range(12)), 4, start_block=1, prev_hash=a[0])
    assert tail == a[1:]


def _cache_with(pool, tokens, bs):
    cache = RadixCache(pool)
    h = prefix_block_hashes(tokens, bs)
    blocks = pool.allocate(len(h))
    nodes = cache.insert(h, blocks)
    pool.free(blocks)  # the request is done: only the cache holds them
    return cache, h, nodes


def test_match_insert_and_lock_counters():
    pool = BlockPool(16, 4)
    cache, h, nodes = _cache_with(pool, list(range(16)), 4)
    assert cache.evictable_blocks == 4 and cache.protected_blocks == 0
    hit = cache.match_prefix(h[:3])
    assert hit == nodes[:3]
    cache.lock(hit)
    assert (cache.evictable_blocks, cache.protected_blocks) == (1, 3)
    cache.unlock(hit)
    assert (cache.evictable_blocks, cache.protected_blocks) == (4, 0)
    cache.check_invariants()


def test_evicts_lru_leaf_first():
    pool = BlockPool(16, 4)
    cache = RadixCache(pool)
    ha = prefix_block_hashes([1] * 8, 4)
    hb = prefix_block_hashes([2] * 8, 4)
    for h in (ha, hb):
        blocks = pool.allocate(2)
        cache.insert(h, blocks)
        pool.free(blocks)
    cache.match_prefix(ha)  # a is now more recent than b
    assert cache.evict(1) == 1
    assert len(cache.match_prefix(hb)) == 1  # b's leaf went first
    assert len(cache.match_prefix(ha)) == 2
    cache.check_invariants()


def test_locked_nodes_are_never_evicted():
    pool = BlockPool(8, 4)
    cache, h, nodes = _cache_with(pool, list(range(8)), 4)
    cache.lock(nodes)
    pool.incref([n.block_id for n in nodes])
    assert cache.evict(10) == 0
    cache.unlock(nodes)
    pool.free([n.block_id for n in nodes])
    assert cache.evict(10) == 2
    assert pool.num_free == 8
    cache.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=120))
def test_random_operations_keep_accounting_exact(ops):
    """Requests share prefixes from a few roots, lock/unlock, insert and evict in random order."""
    bs = 4
    pool = BlockPool(40, bs)
    cache = RadixCache(pool)
    live: list[tuple[list, list]] = []  # (locked nodes, own blocks) per live request
    rng = random.Random(0)
    for root, nblocks, action in ops:
        if action == 3 and live:
            nodes, own = live.pop(rng.randrange(len(live)))
            cache.unlock(nodes)
            pool.free([n.block_id for n in nodes] + own)
        elif action == 2:
            cache.evict(rng.randint(1, 5))
        else:
            tokens = [root] * (bs * 2) + [root * 100 + i for i in range(bs * nblocks)]
            h = prefix_block_hashes(tokens, bs)
            hit = cache.match_prefix(h)
            cache.lock(hit)
            pool.incref([n.block_id for n in hit])
            need = len(h) - len(hit)
            if need > pool.num_free:
                cache.evict(need - pool.num_free)
            if need > pool.num_free:
                cache.unlock(hit)
                pool.free([n.block_id for n in hit])
            else:
                own = pool.allocate(need)
                table = [n.block_id for n in hit] + own
                new = cache.insert(h, table, start=len(hit))
                assert [n.block_id for n in new] == own  # nothing new was cached meanwhile
                cache.lock(new)
                live.append((hit + new, []))  # its own blocks are now the new nodes' blocks
        pool.check_invariants()
        cache.check_invariants()
    for nodes, own in live:
        cache.unlock(nodes)
        pool.free([n.block_id for n in nodes] + own)
    cache.evict(pool.num_blocks)
    assert pool.num_free == pool.num_blocks
    assert cache.evictable_blocks == cache.protected_blocks == 0
