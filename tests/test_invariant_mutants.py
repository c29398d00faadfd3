"""The check_invariants of the block pools and the radix cache, each corruption caught with its exact message.

Each test builds a consistent state, corrupts one field the way a bug would, and pins the whole
message (``^...$``), so a check that is switched off, weakened (``or`` -> ``and``, ``>=`` -> ``>``) or that
reports the wrong blocks fails here.
"""

from __future__ import annotations

import re

import pytest
from conftest import make_request

from kvbalance.kvcache.blocks import BlockPool, ElasticBlockPool
from kvbalance.kvcache.manager import NO_HIT, KVCacheManager
from kvbalance.kvcache.prefix import RadixCache


def _raises(check, message: str) -> None:
    with pytest.raises(AssertionError, match=f"^{message}$"):
        check()


def test_block_pool_corruptions():
    pool = BlockPool(3, 4)
    pool.check_invariants()
    pool._free.append(pool._free[-1])
    _raises(pool.check_invariants, "free list holds a block twice")
    pool = BlockPool(3, 4)
    pool._ref[0] = 1  # referenced yet free
    _raises(pool.check_invariants, re.escape("free list and zero ref counts disagree: [0] differ"))
    pool = BlockPool(12, 4)
    pool._ref[:] = [1] * 12  # twelve disagree: the message lists the first ten
    _raises(
        pool.check_invariants, re.escape(f"free list and zero ref counts disagree: {list(range(10))} differ")
    )
    pool = BlockPool(3, 4)
    (b,) = pool.allocate(1)
    pool._ref[b] = -1  # not free, not zero: only the sign check sees it
    _raises(pool.check_invariants, "negative reference count")


def _elastic() -> ElasticBlockPool:
    pool = ElasticBlockPool(2, 4, 2)  # base blocks 0, 1; elastic 2, 3 detached
    pool.check_invariants()
    return pool


def test_elastic_pool_corruptions():
    pool = _elastic()
    pool._free.append(pool._free[-1])
    _raises(pool.check_invariants, "a free list holds a block twice")
    pool = _elastic()
    pool._free.append(pool.base_blocks)  # the first elastic id in the base free list
    _raises(pool.check_invariants, "a block sits in the wrong free list")
    pool = _elastic()
    pool._lent_pos[3] = 0
    _raises(pool.check_invariants, "lent free-list positions are stale")
    pool = _elastic()
    (b,) = pool.allocate(1)
    pool._ref[b] = -1
    _raises(pool.check_invariants, "negative reference count")
    pool = _elastic()
    pool._free.remove(0)
    pool._attached[0] = 0
    _raises(pool.check_invariants, "a base block is detached")
    pool = _elastic()
    pool._ref[3] = 1
    _raises(pool.check_invariants, "a detached block is referenced")


def test_elastic_pool_free_list_disagreement_names_the_blocks():
    pool = ElasticBlockPool(12, 4, 0)
    pool._ref[:] = [1] * 12
    _raises(
        pool.check_invariants, re.escape(f"free lists and zero ref counts disagree: {list(range(10))} differ")
    )
    pool = _elastic()
    pool.attach([2, 3])  # lent blocks 2, 3 sit free in the lent list
    pool.check_invariants()
    pool._ref[0] = 1  # base block 0 referenced yet free: only it differs
    _raises(pool.check_invariants, re.escape("free lists and zero ref counts disagree: [0] differ"))


def _tree() -> tuple[BlockPool, RadixCache, dict]:
    """Root -> P [1, 2] -> {A [3], B [4]}: inserted as [1, 2, 3] then [1, 2, 4] (the split), unlocked."""
    pool = BlockPool(8, 4)
    cache = RadixCache(pool)
    first = pool.allocate(3)
    cache.insert([1, 2, 3], first)
    pool.free(first)
    other = pool.allocate(1)
    cache.insert([1, 2, 4], first[:2] + other)
    pool.free(other)
    cache.check_invariants()
    (p,) = cache.root.children.values()
    nodes = {"P": p, "A": p.children[3], "B": p.children[4]}
    assert [len(n.block_ids) for n in nodes.values()] == [2, 1, 1]
    return pool, cache, nodes


def test_radix_cache_node_shape_corruptions():
    _, cache, n = _tree()
    n["A"].alive = False  # dead but still holding its blocks
    _raises(cache.check_invariants, re.escape(f"{n['A']}: dead, empty or ragged node in the tree"))
    _, cache, n = _tree()
    n["A"].hashes.append(5)  # ragged: two hashes, one block
    _raises(cache.check_invariants, re.escape(f"{n['A']}: dead, empty or ragged node in the tree"))
    _, cache, n = _tree()
    p = n["P"]
    del p.children[3]
    p.children[9] = n["A"]  # filed under a key that is not its first hash
    n["A"].key = 9
    _raises(cache.check_invariants, re.escape(f"{n['A']}: stored under a foreign key"))


def test_radix_cache_lock_and_heap_corruptions():
    _, cache, n = _tree()
    n["A"].lock_ref = -1
    _raises(cache.check_invariants, re.escape(f"{n['A']}: negative lock_ref"))
    _, cache, n = _tree()
    n["A"].lock_ref = 1  # locked while its parent is not
    _raises(cache.check_invariants, re.escape(f"{n['A']}: locked more than its parent"))
    _, cache, n = _tree()
    cache._heap.clear()
    with pytest.raises(
        AssertionError, match=r"^RadixNode\(.*\): evictable leaf missing from the eviction heap$"
    ):
        cache.check_invariants()


def test_radix_cache_block_and_counter_corruptions():
    _, cache, n = _tree()
    shared = n["P"].block_ids[0]
    n["A"].block_ids[0] = shared  # one block in two nodes
    _raises(cache.check_invariants, f"block {shared} cached twice")
    pool, cache, n = _tree()
    b = n["B"].block_ids[0]
    pool._ref[b] = 3
    _raises(cache.check_invariants, re.escape(f"{n['B']}: block {b} ref count 3 not in [1, 1 + lock_ref]"))
    _, cache, n = _tree()
    cache.evictable_blocks += 1
    _raises(cache.check_invariants, re.escape("size counters (5, 0) != (4, 0)"))
    _, cache, n = _tree()
    cache._num_nodes += 1
    _raises(cache.check_invariants, "node count 4 != 3")


def _manager_with_a_cached_request():
    kv = KVCacheManager(BlockPool(8, 4))
    a = make_request("a", list(range(10)), max_tokens=2)
    kv.admit(a, NO_HIT, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)  # a locks its two full blocks' path; its third block is its own
    assert kv.num_cached_blocks_of(a) == 2
    kv.check_invariants([a])
    return kv, a


def test_manager_corruptions():
    kv, a = _manager_with_a_cached_request()
    a.num_computed_tokens = 13  # four blocks' worth on three
    _raises(lambda: kv.check_invariants([a]), re.escape(f"{a}: fewer blocks than computed tokens need"))
    kv, a = _manager_with_a_cached_request()
    kv._hashes["a"][0] ^= 1  # same length, another first hash
    _raises(lambda: kv.check_invariants([a]), re.escape(f"{a}: locked cache path and block hashes disagree"))
    kv, a = _manager_with_a_cached_request()
    _raises(lambda: kv.check_invariants([]), "request a: holds a cache lock but no blocks")
    kv, a = _manager_with_a_cached_request()
    own = a.block_ids[2]
    kv.pool.incref([own])  # a reference nobody declares
    _raises(lambda: kv.check_invariants([a]), f"block {own}: ref count 2 != holders 1")


def test_manager_counts_blocks_held_for_a_save_on_top_of_the_block_tables():
    kv, a = _manager_with_a_cached_request()
    own = a.block_ids[2]
    kv.pool.incref([own, own])
    kv.check_invariants([a], held={"s1": [own], "s2": [own]})  # a + two saves = 3
    _raises(lambda: kv.check_invariants([a], held={"s1": [own]}), f"block {own}: ref count 3 != holders 2")
