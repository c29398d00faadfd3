"""Radix cache recency: every use (insert, extend, unlock) stamps a later tick, so eviction is exact LRU."""

from __future__ import annotations

import re

import pytest

from kvbalance.kvcache.blocks import BlockPool
from kvbalance.kvcache.prefix import RadixCache


def _insert(pool: BlockPool, cache: RadixCache, hashes: list[int]) -> None:
    blocks = pool.allocate(len(hashes))
    _, cached = cache.insert(hashes, blocks)
    pool.free(blocks)  # the cache keeps its own reference (or already had the prefix)
    assert len(cached) == len(hashes)


def test_reinserting_a_prefix_makes_it_the_most_recent_and_the_other_goes_first():
    pool = BlockPool(4, 4)
    cache = RadixCache(pool)
    _insert(pool, cache, [1])
    _insert(pool, cache, [2])
    _insert(pool, cache, [1])  # a later use of [1]: [2] is now least recently used
    cache.check_invariants()
    assert cache.evict(1) == 1
    assert cache.match_prefix([2])[1] == 0 and cache.match_prefix([1])[1] == 1
    assert cache.evict(1) == 1 and cache.num_cached_blocks == 0


def test_an_unlock_stamps_the_path_as_just_used():
    pool = BlockPool(4, 4)
    cache = RadixCache(pool)
    blocks = pool.allocate(1)
    node, _ = cache.insert([1], blocks)
    pool.free(blocks)
    _insert(pool, cache, [2])
    cache.lock(node)
    cache.unlock(node)  # released after [2] was cached: [2] is older
    assert cache.evict(1) == 1
    assert cache.match_prefix([1])[1] == 1 and cache.match_prefix([2])[1] == 0


def test_unlock_of_an_unlocked_node_is_refused():
    pool = BlockPool(4, 4)
    cache = RadixCache(pool)
    blocks = pool.allocate(1)
    node, _ = cache.insert([7], blocks)
    with pytest.raises(RuntimeError, match=f"^{re.escape(repr(node))}: unlock of an unlocked node$"):
        cache.unlock(node)
    assert node.lock_ref == 0
