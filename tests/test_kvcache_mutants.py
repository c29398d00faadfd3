"""Block pool, KV cache manager and radix cache, pinned to exact block ids, counts and references."""

from __future__ import annotations

import pytest
from conftest import make_request

from kvbalance.kvcache.blocks import BlockPool, ElasticBlockPool, OutOfBlocks
from kvbalance.kvcache.hashing import HASH_ALGOS, BlockHasher
from kvbalance.kvcache.manager import NO_HIT, KVCacheManager
from kvbalance.kvcache.prefix import RadixCache, prefix_block_hashes


def test_pool_sizes_and_block_arithmetic():
    pool = BlockPool(5, 4)
    assert (pool.num_free, pool.num_used, pool.capacity_tokens) == (5, 0, 20)
    assert [pool.blocks_for_tokens(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert pool.allocate(2) == [1, 0] and pool.allocate(0) == [] and pool.allocate(-1) == []
    assert (pool.num_free, pool.num_used) == (3, 2)
    assert pool.allocate(3) == [4, 3, 2] and pool.num_free == 0
    with pytest.raises(OutOfBlocks, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)
    pool.free([3])
    assert pool.allocate(1) == [3]  # LIFO: the block just freed comes back first


def test_incref_of_a_free_block_is_refused_and_refs_count_holders():
    pool = BlockPool(3, 4)
    with pytest.raises(RuntimeError, match="block 0: incref of a free block"):
        pool.incref([0])
    (b,) = pool.allocate(1)
    pool.incref([b, b])
    assert pool.ref_count(b) == 3
    pool.free([b, b])
    assert pool.ref_count(b) == 1 and pool.num_free == 2
    pool.free([b])
    assert pool.ref_count(b) == 0 and pool.num_free == 3
    pool.check_invariants()


def test_pool_invariant_checks_catch_corruption():
    pool = BlockPool(3, 4)
    pool.allocate(1)
    pool._free.append(pool._free[-1])
    with pytest.raises(AssertionError, match="free list holds a block twice"):
        pool.check_invariants()
    pool = BlockPool(3, 4)
    pool._ref[0] = 1
    with pytest.raises(AssertionError, match="free list and zero ref counts disagree"):
        pool.check_invariants()


def test_elastic_pool_hands_out_base_blocks_then_lent_ones_and_sizes_follow():
    pool = ElasticBlockPool(2, 4, num_elastic=3)
    assert (pool.num_blocks, pool.num_total_blocks, pool.num_free, pool.num_lent) == (2, 5, 2, 0)
    pool.attach([3, 4])
    assert (pool.num_blocks, pool.num_free, pool.num_lent, pool.capacity_tokens) == (4, 4, 2, 16)
    assert pool.is_attached(3) and not pool.is_attached(2)
    assert list(pool.elastic_block_ids()) == [2, 3, 4]
    got = pool.allocate(3)
    assert got[:2] == [1, 0] and got[2] in (3, 4) and pool.num_used == 3 and pool.num_free == 1
    with pytest.raises(OutOfBlocks, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    pool.free(got)
    assert pool.num_free == 4 and pool.num_used == 0
    pool.detach([3])
    assert pool.num_blocks == 3 and not pool.is_attached(3)
    pool.check_invariants()
    with pytest.raises(RuntimeError, match="block 3: detach of a detached block"):
        pool.detach([3])
    with pytest.raises(RuntimeError, match="block 4: attach of an attached block"):
        pool.attach([4])
    with pytest.raises(ValueError, match=r"block_ids: 1 is not in the elastic region \[2, 5\)"):
        pool.attach([1])
    with pytest.raises(ValueError, match="block_ids: a block is listed twice"):
        pool.attach([3, 3])
    assert sorted(pool.allocate(2)) == [0, 1]
    assert pool.allocate(1) == [4]  # the base pool is dry: the next block is lent
    with pytest.raises(RuntimeError, match="detach of a block in use"):
        pool.detach([4])


def test_manager_admits_with_a_prefix_hit_and_counts_available_blocks():
    kv = KVCacheManager(BlockPool(8, 4))
    assert kv.blocks_for_tokens(9) == 3 and kv.capacity_tokens == 32 and kv.block_size == 4
    a = make_request("a", list(range(10)), max_tokens=2)
    assert kv.get_computed_blocks(a) is NO_HIT
    assert kv.can_admit(NO_HIT, 10) and kv.num_blocks_to_admit(NO_HIT, 10) == 3
    kv.admit(a, NO_HIT, 10)
    assert a.block_ids == [2, 1, 0] and kv.num_free_blocks == 5  # ids come off the top of the free stack
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    assert kv.num_cached_blocks_of(a) == 2 and kv.cache.num_cached_blocks == 2
    assert kv.kv_used_tokens == 12  # a holds its three blocks
    b = make_request("b", list(range(9)) + [99], max_tokens=2)
    hit = kv.get_computed_blocks(b)
    assert (hit.num_blocks, hit.num_unlocked_blocks) == (2, 0)  # a still holds them
    kv.admit(b, hit, 10)
    assert b.block_ids == [2, 1, 3] and kv.pool.ref_count(2) == 3  # cache + a + b
    kv.free(a)
    kv.forget(a)
    kv.free(b)
    assert kv.num_free_blocks == 6 and kv.num_available_blocks == 8 and kv.kv_used_tokens == 0
    c = make_request("c", list(range(12)), max_tokens=1)
    hit = kv.get_computed_blocks(c)
    assert (hit.num_blocks, hit.num_unlocked_blocks) == (2, 2)
    # 3 blocks needed, 1 of them new; the 2 unlocked hit blocks stop being evictable once taken
    assert kv.num_blocks_to_admit(hit, 12) == 1
    assert kv.can_admit(hit, 12, reserve_blocks=5) and not kv.can_admit(hit, 12, reserve_blocks=6)
    kv.check_invariants([])


def test_manager_grows_block_tables_and_evicts_idle_cache_blocks_when_short():
    kv = KVCacheManager(BlockPool(4, 4))
    a = make_request("a", list(range(8)), max_tokens=1)
    kv.admit(a, NO_HIT, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    kv.free(a)
    assert kv.num_free_blocks == 2 and kv.cache.evictable_blocks == 2
    b = make_request("b", [50] * 16, max_tokens=1)
    kv.admit(b, NO_HIT, 4)
    assert kv.allocate_slots(b, 4) and len(b.block_ids) == 1  # already has room
    assert kv.max_tokens_fitting(b) == (1 + 1) * 4
    assert kv.allocate_slots(b, 16) and len(b.block_ids) == 4  # two cached blocks evicted on demand
    assert kv.cache.num_cached_blocks == 0 and kv.num_free_blocks == 0
    assert not kv.allocate_slots(b, 17) and len(b.block_ids) == 4  # nothing changed
    with pytest.raises(RuntimeError, match="admitted while it holds blocks"):
        kv.admit(b, NO_HIT, 4)


def test_manager_without_prefix_caching_never_hits():
    kv = KVCacheManager(BlockPool(4, 4), enable_prefix_caching=False)
    assert kv.can_admit(NO_HIT, 16) and not kv.can_admit(NO_HIT, 17)  # the whole pool, not one block more
    a = make_request("a", list(range(8)), max_tokens=1)
    kv.admit(a, NO_HIT, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    assert kv.cache is None and kv.num_cached_blocks_of(a) == 0
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", list(range(8)))) is NO_HIT
    assert kv.num_available_blocks == 4 and kv.kv_used_tokens == 0


def test_radix_cache_eviction_order_sizes_and_reset():
    pool = BlockPool(8, 2)
    cache = RadixCache(pool)
    for base in (0, 100, 200):
        toks = [base + i for i in range(4)]
        blocks = pool.allocate(2)
        cache.insert(prefix_block_hashes(toks, 2), blocks)
        pool.free(blocks)
    assert cache.num_cached_blocks == 6 and cache.evictable_blocks == 6 and cache.protected_blocks == 0
    node, n = cache.match_prefix(prefix_block_hashes([0, 1, 2, 3], 2))  # touch the oldest
    assert n == 2 and cache.blocks_of(node) == [1, 0]
    assert cache.evict(3) == 3  # the 100-prefix (LRU) goes whole, then the 200-prefix's tail
    assert cache.num_evicted == 3 and pool.num_free == 5 and cache.num_cached_blocks == 3
    assert cache.match_prefix(prefix_block_hashes([100, 101, 102, 103], 2))[1] == 0
    assert cache.match_prefix(prefix_block_hashes([200, 201, 202, 203], 2))[1] == 1
    cache.check_invariants()
    assert cache.reset() == 3 and cache.num_cached_blocks == 0 and pool.num_free == 8


def _tree(pool):
    """A cached prefix P = [0..3] (2 blocks of 2) with two branches: A = P + [4..7], B = P + [9, 9, 8, 8]."""
    cache = RadixCache(pool)
    ids = {}
    for name, toks in (("A", list(range(8))), ("B", list(range(4)) + [9, 9, 8, 8])):
        blocks = pool.allocate(4)
        _, cached = cache.insert(prefix_block_hashes(toks, 2), blocks)
        pool.free(blocks)
        ids[name] = cached
    return cache, ids


def test_evicting_blocks_removes_whole_branches_and_leaves_the_parent_evictable():
    pool = BlockPool(16, 2)
    cache, ids = _tree(pool)
    assert ids["A"][:2] == ids["B"][:2] and cache.num_cached_blocks == 6
    assert cache.evict_blocks([]) == 0
    assert cache.evict_blocks([ids["B"][2]]) == 2  # B's branch, from its first block
    assert cache.num_evicted == 2 and cache.num_cached_blocks == 4 and cache.evictable_blocks == 4
    cache.check_invariants()
    assert cache.evict_blocks([ids["A"][3]]) == 1  # only A's last block: the node is cut, not removed
    cache.check_invariants()
    assert cache.evict_blocks([ids["A"][2]]) == 1  # now P is a leaf again: it must be evictable
    cache.check_invariants()
    assert cache.num_evicted == 4 and cache.num_cached_blocks == 2
    assert cache.evict(10) == 2 and pool.num_free == 16 and cache.num_evicted == 6
    cache.check_invariants()


def test_evicting_a_prefix_block_drops_everything_below_it():
    pool = BlockPool(16, 2)
    cache, ids = _tree(pool)
    assert cache.evict_blocks([ids["A"][1]]) == 5  # P's second block, both branches under it
    cache.check_invariants()
    assert cache.num_cached_blocks == 1 and pool.num_free == 15
    assert cache.evict(10) == 1 and pool.num_free == 16  # no stale heap entry is freed twice


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_request_block_hashes_equal_the_prefix_hashes_of_its_tokens_across_the_prompt_boundary(algo):
    hasher = BlockHasher(algo)
    kv = KVCacheManager(BlockPool(16, 4), hasher=hasher)
    prefix = hasher.prefix_block_hashes
    req = make_request("r", list(range(100, 110)), max_tokens=20)
    assert kv.block_hashes(req, 4) == prefix(list(range(100, 104)), 4)
    assert kv.block_hashes(req, 9) == prefix(list(range(100, 108)), 4)
    req.output_token_ids.extend(range(500, 512))  # 22 tokens: blocks past the prompt mix prompt and output
    tokens = list(range(100, 110)) + list(range(500, 512))
    for n in (12, 13, 20, 22):
        assert kv.block_hashes(req, n) == prefix(tokens[:n], 4)
    assert kv.block_hashes(req, 8) == prefix(tokens[:8], 4)  # a shorter prefix of the cached list


def test_numpy_prompts_hash_like_lists():
    import numpy as np

    toks = list(range(7, 15))  # two blocks of 4: the few-block path
    assert prefix_block_hashes(np.array(toks), 4) == prefix_block_hashes(toks, 4)
    long = list(range(40))  # ten blocks: the vectorised path
    assert prefix_block_hashes(np.array(long), 4) == prefix_block_hashes(long, 4)
    assert prefix_block_hashes(long, 4)[:2] == prefix_block_hashes(long[:8], 4)


def test_unlocked_blocks_are_counted_along_the_whole_path():
    pool = BlockPool(16, 2)
    cache, ids = _tree(pool)
    node, n = cache.match_prefix(prefix_block_hashes(list(range(8)), 2))
    assert n == 4 and cache.unlocked_blocks_on_path(node) == 4  # P (2 blocks) and A's tail (2 blocks)
    cache.lock(node.parent)  # P locked by someone: only A's tail is unlocked
    assert cache.unlocked_blocks_on_path(node) == 2 and cache.protected_blocks == 2
    cache.unlock(node.parent)
    cache.check_invariants()


def test_elastic_pool_edges_lent_double_free_and_eviction_before_lending():
    with pytest.raises(ValueError, match="^num_elastic: must be >= 0, got -1$"):
        ElasticBlockPool(2, 4, num_elastic=-1)
    pool = ElasticBlockPool(2, 4, num_elastic=3)
    assert pool.num_elastic == 3 and pool.base_blocks == 2
    with pytest.raises(ValueError, match=r"^block_ids: 5 is not in the elastic region \[2, 5\)$"):
        pool.attach([5])
    with pytest.raises(ValueError, match="^block_ids: a block is listed twice$"):
        pool.detach([2, 2])
    pool.attach([2, 3, 4])
    asked: list[int] = []
    base = pool.allocate(2)

    def evict(n: int) -> int:  # a cache giving back exactly what was asked, from the base pool
        asked.append(n)
        pool.free(base[:n])
        return n

    pool.evict_before_lent = evict
    assert sorted(pool.allocate(1)) == [base[0]] and asked == [1]  # base block freed by eviction, not lent
    pool.evict_before_lent = lambda n: asked.append(n) or 0  # nothing left to evict
    pool.free([base[1]])  # one base block free: 2 asked, 1 short
    got = pool.allocate(2)
    assert asked == [1, 1] and got[0] == base[1] and got[1] >= 2  # the base block first, then a lent one
    lent = got[1:]
    pool.free(lent)
    with pytest.raises(RuntimeError, match=f"^block {lent[0]}: double free$"):
        pool.free(lent)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: p._lent_free.append(p._lent_free[-1]), "a free list holds a block twice"),
        (lambda p: p._free.append(p._lent_free.pop()), "a block sits in the wrong free list"),
        (lambda p: p._lent_pos.__setitem__(p._lent_free[0], 7), "lent free-list positions are stale"),
        (lambda p: p._ref.__setitem__(0, -1), "negative reference count"),
        (lambda p: p._attached.__setitem__(0, 0), "a base block is detached"),
        (lambda p: p._ref.__setitem__(4, 1), "a detached block is referenced"),
        (lambda p: setattr(p, "num_blocks", p.num_blocks + 1), "num_blocks 5 != attached blocks"),
        (lambda p: p._ref.__setitem__(3, 1), "free lists and zero ref counts disagree"),
    ],
)
def test_elastic_pool_invariant_checks_catch_each_corruption(corrupt, message):
    pool = ElasticBlockPool(2, 4, num_elastic=3)
    pool.attach([2, 3])
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_invariants()


def test_common_prefix_finds_the_first_differing_block():
    from kvbalance.kvcache.prefix import _common_prefix

    node = list(range(10, 18))  # 8 chained hashes
    for k in range(1, 9):
        other = node[:k] + [-1] * (8 - k)
        assert _common_prefix(node, other, 0) == k
        assert _common_prefix(node, [7, 7] + other, 2) == k  # matched from offset i
    assert _common_prefix(node, node[:3], 0) == 3  # the query ends first


def test_the_eviction_heap_is_rebuilt_from_live_leaves_and_still_evicts_lru_first():
    pool = BlockPool(8, 2)
    cache = RadixCache(pool)
    for base in (0, 100):
        blocks = pool.allocate(2)
        cache.insert(prefix_block_hashes([base, base + 1, base + 2, base + 3], 2), blocks)
        pool.free(blocks)
    hot = prefix_block_hashes([100, 101, 102, 103], 2)
    for _ in range(1100):  # every touch pushes a new heap entry: past 4 * nodes + 1024 the heap is rebuilt
        cache.match_prefix(hot)
    assert len(cache._heap) < 1024
    cache.check_invariants()
    assert cache.evict(2) == 2  # the cold prefix goes first
    assert (
        cache.match_prefix(hot)[1] == 2 and cache.match_prefix(prefix_block_hashes([0, 1, 2, 3], 2))[1] == 0
    )
