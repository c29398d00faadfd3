"""KVCacheManager: the one owner of an instance's KV memory — block pool, radix prefix cache, block tables.

The scheduler speaks tokens; this class turns them into blocks (vLLM v1's ``KVCacheManager``):

* :meth:`get_computed_blocks` — the longest cached prefix of a waiting request (a :class:`PrefixHit`);
* :meth:`can_allocate` / :meth:`allocate_slots` — blocks for ``n`` more tokens (computed here, or arriving
  from outside through the KV connector), taking the prefix hit's blocks on admission and evicting
  unreferenced cached blocks when the free list is short;
* :meth:`cache_full_blocks` — publish a request's newly full blocks in the prefix cache;
* :meth:`free` — drop a request's blocks (finish, abort, preemption); :meth:`forget` its hashes.

Each request's block table (``request.block_ids``) is append-only once written: when another request
computed the same block first, the cache keeps that block and this request keeps its own copy (freed
with the request), so no block id ever changes under an in-flight KV save. A request's locked path in
the prefix cache covers the blocks it has cached, and its block hashes are kept here, not on the request.

Blocks are named by ``hasher`` (a :class:`~kvbalance.kvcache.hashing.BlockHasher`; SHA-256 by default), and
every hit is also checked against the cached blocks' tokens: a block whose tokens differ from the
request's is a miss (``RadixCache.num_token_mismatches``), whatever its hash says.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbalance.kvcache.blocks import BlockPool
from kvbalance.kvcache.hashing import BlockHasher, token_bytes
from kvbalance.kvcache.prefix import RadixCache, RadixNode
from kvbalance.request import Request


def _token_bytes(req: Request, start: int, end: int) -> bytes:
    """``token_bytes`` of the request's tokens ``[start, end)`` (prompt tokens straight from the prompt)."""
    n = req._num_prompt
    if end <= n:
        return token_bytes(req.prompt_token_ids[start:end])
    if start >= n:  # output tokens only (a decode's block)
        return token_bytes(req.output_token_ids[start - n : end - n])
    return token_bytes(req.token_ids(start, end))


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A waiting request's longest cached prefix: the deepest cache node and its length in blocks."""

    node: RadixNode | None
    num_blocks: int
    num_unlocked_blocks: int  # of those, blocks no one holds yet (they stop being evictable once taken)


NO_HIT = PrefixHit(None, 0, 0)


class KVCacheManager:
    def __init__(
        self, pool: BlockPool, enable_prefix_caching: bool = True, hasher: BlockHasher | None = None
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.hasher = hasher if hasher is not None else BlockHasher()
        self.cache: RadixCache | None = RadixCache(pool) if enable_prefix_caching else None
        # request id -> (deepest locked cache node, blocks of the request covered by that path)
        self._paths: dict[str, tuple[RadixNode, int]] = {}
        self._hashes: dict[str, list[int]] = {}  # request id -> its chained block hashes so far
        self._lazy = False  # enable_lazy_hashes
        self._deferred: dict[
            str, list
        ] = {}  # request id -> [its leaf, blocks filled, tick]: defer_full_block

    def enable_lazy_hashes(self) -> bool:
        """Hash blocks only where a lookup needs them (a simulator fast path; exact: the same hits, the same
        cache, a lazy node's hashes computed on demand are the values an eager insert stores). A request's
        first block is hashed at admission; a miss there, and blocks published onto a leaf only its request
        uses, hash nothing more. For the cryptographic hashes (a poly64 hash depends on the block's index,
        which a node does not know). Returns whether it is on."""
        if self.cache is None or not self.hasher.cryptographic:
            return False
        self._lazy = True
        self.cache.hasher = self.hasher
        return True

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus cached blocks no request holds (evictable on demand)."""
        return self.pool.num_free + (self.cache.evictable_blocks if self.cache is not None else 0)

    @property
    def kv_used_tokens(self) -> int:
        """Tokens of KV held by requests (blocks in use minus cached-but-idle ones, in tokens)."""
        idle = self.cache.evictable_blocks if self.cache is not None else 0
        return (self.pool.num_used - idle) * self.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return self.pool.blocks_for_tokens(num_tokens)

    def block_hashes(self, req: Request, num_tokens: int) -> list[int]:
        """The request's chained hashes of its full blocks among its first ``num_tokens`` tokens."""
        cached = self._hashes.get(req.request_id)
        if cached is None:
            cached = self._hashes[req.request_id] = []
        return self.hasher.request_block_hashes(req, self.block_size, num_tokens, cached)

    # -- admission --------------------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> PrefixHit:
        """The longest cached prefix of ``req`` (never its last token: that one is computed to sample)."""
        if self.cache is None:
            return NO_HIT
        if self._lazy:  # the first block decides a miss: hash the rest only for a lookup that goes on
            first = self.block_hashes(req, min(req.num_tokens - 1, self.block_size))
            if not first or first[0] not in self.cache.root.children:
                self.cache.match_prefix(first)  # the same miss as with every hash (it counts a tick)
                return NO_HIT
        node, hit = self.cache.match_prefix(self.block_hashes(req, req.num_tokens - 1))
        if hit:  # the cached tokens must be the request's: a hash match alone is not enough
            node, hit = self.cache.verify_tokens(node, hit, _token_bytes(req, 0, hit * self.block_size))
        if not hit:
            return NO_HIT
        return PrefixHit(node, hit, self.cache.unlocked_blocks_on_path(node))

    def num_blocks_to_admit(self, hit: PrefixHit, num_tokens: int) -> int:
        """New blocks a request with ``hit`` needs to hold ``num_tokens`` tokens of KV."""
        return self.pool.blocks_for_tokens(num_tokens) - hit.num_blocks

    def can_admit(self, hit: PrefixHit, num_tokens: int, reserve_blocks: int = 0) -> bool:
        """Whether admitting with ``hit`` to ``num_tokens`` tokens leaves ``reserve_blocks`` available."""
        need = self.num_blocks_to_admit(hit, num_tokens)
        return need + reserve_blocks <= self.num_available_blocks - hit.num_unlocked_blocks

    def admit(self, req: Request, hit: PrefixHit, num_tokens: int) -> None:
        """Give ``req`` the hit's blocks plus new ones up to ``num_tokens`` tokens (checked by can_admit)."""
        if req.block_ids:
            raise RuntimeError(f"{req}: admitted while it holds blocks")
        hit_blocks: list[int] = []
        if hit.num_blocks:
            self.cache.lock(hit.node)
            hit_blocks = self.cache.blocks_of(hit.node)
            self.pool.incref(hit_blocks)
            self._paths[req.request_id] = (hit.node, hit.num_blocks)
        need = self.pool.blocks_for_tokens(num_tokens) - hit.num_blocks
        new = self._take(need)
        if new is None:  # cannot happen after can_admit
            raise RuntimeError("block accounting: admission check passed but allocation failed")
        req.block_ids = hit_blocks + new

    # -- growth -----------------------------------------------------------------------------------
    def _ensure_free(self, n: int) -> bool:
        short = n - self.pool.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.pool.num_free >= n

    def _take(self, n: int) -> list[int] | None:
        """:meth:`_ensure_free` then ``pool.allocate(n)``: the same blocks in the same order, the evicted ones
        handed over with the cache's reference instead of freed and allocated again; None (what eviction freed
        stays free) if they don't fit."""
        pool = self.pool
        short = n - pool.num_free
        if short > 0 and self.cache is not None:
            if type(pool) is BlockPool:
                got = self.cache.evict_taking(short)
                if len(got) < short:
                    pool.free(got)
                    return None
                return pool.allocate(n - short) + got  # allocate(n) after the free: the free list's tail
            self.cache.evict(short)
        if pool.num_free < n:
            return None
        return pool.allocate(n)

    def allocate_slots(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req``'s block table to hold ``num_tokens`` tokens; False (nothing changed) if they don't fit."""
        need = self.pool.blocks_for_tokens(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        new = self._take(need)
        if new is None:
            return False
        req.block_ids.extend(new)
        return True

    def allocate_one(self, req: Request) -> bool:
        """:meth:`allocate_slots` for a token count that needs exactly one more block (a decode at a block's
        first position), the same eviction and allocation without the arithmetic."""
        pool = self.pool
        if pool.num_free < 1 and self.cache is not None:
            if type(pool) is BlockPool:  # the evicted block, still referenced once, is the request's now
                b = self.cache.take_lru_tail()
                if b is not None:
                    req.block_ids.append(b)
                    return True
            self.cache.evict(1)
        if pool.num_free < 1:
            return False
        req.block_ids.extend(pool.allocate(1))
        return True

    def allocate_one_each(self, reqs: list[Request]) -> None:
        """:meth:`allocate_one` for each of ``reqs`` in order (each a decode at a block's first position), the
        caller having checked that they fit (``num_available_blocks``); the same blocks in the same order."""
        pool = self.pool
        cache = self.cache
        if type(pool) is not BlockPool or cache is None:
            for req in reqs:
                if not self.allocate_one(req):
                    raise RuntimeError("block accounting: a cohort decode's block failed to allocate")
            return
        free, ref = pool._free, pool._ref  # (the plain pool's stack: what allocate(1) takes, inline)
        tables = None  # the requests' block tables, for the cache's takes
        i, k = 0, len(reqs)
        while i < k:
            if free:
                b = free.pop()
                ref[b] = 1
                reqs[i].block_ids.append(b)
                i += 1
                continue
            if tables is None:
                tables = [r.block_ids for r in reqs]
            j = cache.take_lru_tails(tables, i)  # (none free: each block off the LRU leaf's tail)
            if j == i:
                if not self.allocate_one(reqs[i]):
                    raise RuntimeError("block accounting: a cohort decode's block failed to allocate")
                j += 1
            i = j

    def reserve(self, num_blocks: int, keep_available: int = 0) -> list[int] | None:
        """``num_blocks`` blocks for KV arriving from outside before its request does (a live migration's
        destination), evicting unreferenced cached blocks if needed, while ``keep_available`` blocks stay
        available; None (nothing changed) if they don't fit. The caller holds them (``release_held``)."""
        if num_blocks + keep_available > self.num_available_blocks or not self._ensure_free(num_blocks):
            return None
        return self.pool.allocate(num_blocks)

    def max_tokens_fitting(self, req: Request) -> int:
        """Most tokens ``req`` could hold now: its blocks plus every free block (cache already evicted)."""
        return (len(req.block_ids) + self.pool.num_free) * self.block_size

    # -- prefix cache -------------------------------------------------------------------------------
    def cache_full_blocks(self, req: Request) -> None:
        """Publish ``req``'s full computed blocks in the prefix cache (append-only: no block id changes)."""
        cache = self.cache
        if cache is None:
            return
        bs = self.block_size
        full = req.num_computed_tokens // bs
        rid = req.request_id
        node, have = self._paths.get(rid) or (cache.root, 0)
        if rid in self._deferred:
            raise RuntimeError(f"{req}: blocks to publish first (defer_full_block)")
        if full <= have:
            return
        tokens = _token_bytes(req, have * bs, full * bs)  # what the cache keeps for the hit check
        if self._lazy and have and not node.children and node.lock_ref == 1 and node.tokens is not None:
            cache.grow_leaf(node, req.block_ids[have:full], tokens)  # the common case: a leaf of its own
            self._paths[rid] = (node, full)
            return
        hashes = self._hashes.get(rid)
        if hashes is None:
            hashes = self._hashes[rid] = []
        k = len(hashes)
        if self._lazy and k < full:
            lazy = False
            if have == 0:  # a new child of the root: its key, the first block's hash, decides
                if k == 0:
                    hashes.extend(self.hasher.token_bytes_hashes(tokens[: 8 * bs], bs, 0, 0))
                lazy = hashes[0] not in node.children
            elif not node.children and node.lock_ref == 1 and node.tokens is not None:
                lazy = True  # a leaf only this request uses grows in place: no lookup, no key
            if lazy:
                node, _ = cache.extend(node, have, hashes, req.block_ids, tokens, end=full)
                self._paths[rid] = (node, full)
                return
            if k < have:  # the hashes the lookups below need, from the request's tokens
                self.hasher.request_block_hashes(req, bs, have * bs, hashes)
                k = len(hashes)
        if k < full:  # hash the blocks not hashed yet from the same bytes (blocks have..k are hashed)
            if k < have:
                raise RuntimeError(f"{req}: its cached path covers blocks it has no hashes for")
            prev = hashes[-1] if k else 0
            hashes.extend(self.hasher.token_bytes_hashes(tokens[(k - have) * 8 * bs :], bs, k, prev))
        node, _ = cache.extend(node, have, hashes, req.block_ids, tokens, end=full)
        # where another request cached a block first, the cache keeps its copy and req keeps its own
        self._paths[rid] = (node, full)

    def defer_full_block(self, req: Request, flush) -> list | None:
        """Instead of :meth:`cache_full_blocks` for a block ``req`` just filled, note it and publish it later
        (``flush`` then: it brings ``req``'s tokens up to date and calls :meth:`publish_deferred`), the cache
        ending exactly as if it had been published now; nothing done (None) unless ``req``'s cached path ends
        at a leaf only it uses (lazy hashes on). Anything that reads that leaf or ``req``'s cached blocks first
        publishes them: a lookup reaching the leaf, a split, :meth:`free`, :meth:`detach`, the checks.

        Returns the note, ``[leaf, blocks noted, tick of the last]`` (None: nothing done). While its leaf is not
        None (:meth:`publish_deferred` clears it), a later fill of the same request's next block may be noted on
        it directly, as this method would: ``note[1] += 1; note[2] = cache.take_tick()``."""
        rid = req.request_id
        d = self._deferred.get(rid)
        cache = self.cache
        if d is None:
            path = self._paths.get(rid)
            if not self._lazy or path is None:
                return None
            node = path[0]
            if node.children or node.lock_ref != 1 or node.tokens is None:
                return None
            d = self._deferred[rid] = [node, 0, 0]
            node.flush = flush
        d[1] += 1
        d[2] = cache.take_tick()
        return d

    def publish_deferred(self, req: Request) -> None:
        """Publish the blocks :meth:`defer_full_block` noted for ``req`` (its tokens up to date)."""
        d = self._deferred.pop(req.request_id, None)
        if d is None:
            return
        node, count, tick = d
        d[0] = None  # the note is spent (defer_full_block)
        node.flush = None
        rid = req.request_id
        have = self._paths[rid][1]
        bs = self.block_size
        self.cache.grow_leaf(node, req.block_ids[have : have + count], _token_bytes(req, have * bs, (have + count) * bs),
                             tick)  # fmt: skip
        self._paths[rid] = (node, have + count)

    def _publish_first(self, req: Request) -> None:
        d = self._deferred.get(req.request_id)
        if d is not None:
            d[0].flush()

    def num_cached_blocks_of(self, req: Request) -> int:
        self._publish_first(req)
        path = self._paths.get(req.request_id)
        return 0 if path is None else path[1]

    # -- release ------------------------------------------------------------------------------------
    def free(self, req: Request) -> None:
        """Release ``req``'s blocks and its lock on the prefix cache (its cached blocks stay cached)."""
        self._publish_first(req)
        path = self._paths.pop(req.request_id, None)
        if path is not None:
            self.cache.unlock(path[0])
        self.pool.free(req.block_ids)
        req.block_ids = []

    def detach(self, req: Request) -> tuple[RadixNode, int] | None:
        """Take ``req``'s blocks and cache lock out of its hands without releasing them (a transfer still
        reads or writes them); the caller keeps ``req``'s former block table and returns both through
        :meth:`release_held`. Returns the lock (or None)."""
        self._publish_first(req)
        req.block_ids = []
        return self._paths.pop(req.request_id, None)

    def release_held(self, block_ids: list[int], path: tuple[RadixNode, int] | None) -> None:
        """Release what :meth:`detach` kept: the cache lock, then the blocks."""
        if path is not None:
            self.cache.unlock(path[0])
        self.pool.free(block_ids)

    def resize(self, num_blocks: int) -> bool:
        """Resize the pool to ``num_blocks`` (a layer migration changed what a block costs here). Shrinking
        evicts idle cached blocks first and takes free blocks only; False (pool unchanged) if too few are
        free once the cache is evicted: in-use KV never moves."""
        short = self.pool.num_blocks - num_blocks
        if short > 0 and not self._ensure_free(short):
            return False
        self.pool.resize(num_blocks)
        return True

    def forget(self, req: Request) -> None:
        """Drop what is kept about a request that will never be scheduled again (its block hashes)."""
        self._hashes.pop(req.request_id, None)

    # -- checks -------------------------------------------------------------------------------------
    def check_invariants(
        self, holders: list[Request], held: dict[str, list[int]] | None = None, held_paths: dict | None = None
    ) -> None:
        """Exact accounting: every block's ref count equals its holders (block tables, blocks held for a
        KV save, the prefix cache); each locked path holds the same blocks' hashes as its request."""
        self.pool.check_invariants()
        cache = self.cache
        if cache is not None:
            cache.check_invariants()  # (publishes what is deferred first)
        refs: dict[int, int] = {}
        for req in holders:
            if len(req.block_ids) < self.pool.blocks_for_tokens(req.num_computed_tokens):
                raise AssertionError(f"{req}: fewer blocks than computed tokens need")
            for b in req.block_ids:
                refs[b] = refs.get(b, 0) + 1
            path = self._paths.get(req.request_id)
            if path is not None:
                node, n = path
                if self._lazy:
                    self.hasher.request_block_hashes(req, self.block_size, n * self.block_size,
                                                     self._hashes.setdefault(req.request_id, []))  # fmt: skip
                path_hashes = []
                while node is not cache.root:
                    path_hashes[:0] = node.hashes
                    node = node.parent
                if path_hashes != self._hashes[req.request_id][:n] or len(path_hashes) != n:
                    raise AssertionError(f"{req}: locked cache path and block hashes disagree")
        for blocks in (held or {}).values():
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        for rid, path in (held_paths or {}).items():
            if path is not None and len(cache.blocks_of(path[0])) != path[1]:
                raise AssertionError(f"request {rid}: held cache lock covers the wrong number of blocks")
        holder_ids = {r.request_id for r in holders}
        for rid in self._paths:
            if rid not in holder_ids:
                raise AssertionError(f"request {rid}: holds a cache lock but no blocks")
        cached = cache.all_block_ids() if cache is not None else set()
        for b in range(self.pool.num_total_blocks):
            expect = refs.get(b, 0) + (1 if b in cached else 0)
            if self.pool.ref_count(b) != expect:
                raise AssertionError(f"block {b}: ref count {self.pool.ref_count(b)} != holders {expect}")
