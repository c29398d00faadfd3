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
    node, cached = cache.insert(h, blocks)
    assert cached == blocks
    pool.free(blocks)  # the request is done: only the cache holds them
    return cache, h, node


def test_match_splits_node_and_lock_moves_counters():
    pool = BlockPool(16, 4)
    cache, h, full = _cache_with(pool, list(range(16)), 4)
    blocks = cache.blocks_of(full)
    assert cache.evictable_blocks == 4 and cache.protected_blocks == 0
    node, hit = cache.match_prefix(h[:3])
    assert hit == 3 and cache.blocks_of(node) == blocks[:3] and cache.blocks_of(full) == blocks
    cache.lock(node)
    assert (cache.evictable_blocks, cache.protected_blocks) == (1, 3)
    cache.unlock(node)
    assert (cache.evictable_blocks, cache.protected_blocks) == (4, 0)
    cache.check_invariants()


def test_diverging_prompts_share_only_their_common_blocks():
    pool = BlockPool(32, 4)
    cache, ha, _ = _cache_with(pool, list(range(16)), 4)
    hb = prefix_block_hashes(list(range(8)) + [99] * 8, 4)
    node, hit = cache.match_prefix(hb)
    assert hit == 2
    cache.lock(node)
    own = pool.allocate(2)
    table = cache.blocks_of(node) + own
    pool.incref(table[:2])
    end, cached = cache.extend(node, 2, hb, table)
    assert cached == own and cache.blocks_of(end) == table
    cache.unlock(end)
    pool.free(table)
    assert cache.num_cached_blocks == 6
    cache.check_invariants()


def test_leaf_grows_in_place_for_its_only_user():
    pool = BlockPool(16, 4)
    cache = RadixCache(pool)
    toks = list(range(24))
    h = prefix_block_hashes(toks, 4)
    table = pool.allocate(6)
    node, _ = cache.extend(cache.root, 0, h[:2], table)
    node2, _ = cache.extend(node, 2, h[:5], table)
    assert node2 is node and cache.blocks_of(node) == table[:5]
    cache.check_invariants()
    cache.unlock(node)
    pool.free(table)
    cache.check_invariants()


def test_concurrent_duplicate_blocks_are_shared():
    pool = BlockPool(16, 4)
    cache = RadixCache(pool)
    h = prefix_block_hashes(list(range(8)), 4)
    a, b = pool.allocate(2), pool.allocate(2)
    na, ca = cache.extend(cache.root, 0, h, a)
    nb, cb = cache.extend(cache.root, 0, h, b)
    assert ca == a and cb == a and nb is na and na.lock_ref == 2


def test_evicts_lru_leaf_first_and_trims_tails():
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
    assert cache.match_prefix(hb)[1] == 1  # b's tail went first
    assert cache.match_prefix(ha)[1] == 2
    cache.check_invariants()


def test_locked_nodes_are_never_evicted():
    pool = BlockPool(8, 4)
    cache, h, node = _cache_with(pool, list(range(8)), 4)
    cache.lock(node)
    pool.incref(cache.blocks_of(node))
    assert cache.evict(10) == 0
    cache.unlock(node)
    pool.free(cache.blocks_of(node))
    assert cache.evict(10) == 2
    assert pool.num_free == 8
    cache.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=120))
def test_random_operations_keep_accounting_exact(ops):
    """Requests share prefixes from a few roots, lock/unlock, extend and evict in random order."""
    bs = 4
    pool = BlockPool(40, bs)
    cache = RadixCache(pool)
    live: list[tuple[object, list]] = []  # (locked path end, block table) per live request
    rng = random.Random(0)
    for root, nblocks, action in ops:
        if action == 3 and live:
            node, table = live.pop(rng.randrange(len(live)))
            cache.unlock(node)
            pool.free(table)
        elif action == 2:
            cache.evict(rng.randint(1, 5))
        else:
            tokens = [root] * (bs * 2) + [root * 100 + i for i in range(bs * nblocks)]
            h = prefix_block_hashes(tokens, bs)
            node, hit = cache.match_prefix(h)
            cache.lock(node)
            table = cache.blocks_of(node)
            pool.incref(table)
            need = len(h) - hit
            if need > pool.num_free:
                cache.evict(need - pool.num_free)
            if need > pool.num_free:
                cache.unlock(node)
                pool.free(table)
            else:
                table += pool.allocate(need)
                end, cached = cache.extend(node, hit, h, table)
                assert cached == table[hit:]  # nothing new was cached meanwhile
                live.append((end, table))
        pool.check_invariants()
        cache.check_invariants()
    for node, table in live:
        cache.unlock(node)
        pool.free(table)
    cache.evict(pool.num_blocks)
    assert pool.num_free == pool.num_blocks
    assert cache.evictable_blocks == cache.protected_blocks == 0
