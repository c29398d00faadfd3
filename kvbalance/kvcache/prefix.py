"""RadixCache: a token trie at block granularity over the BlockPool, with lock refs and LRU eviction.

Every node is one full KV block, keyed by the hash of the whole token prefix that ends with that
block (a chained prefix hash), so a lookup walks a prompt's blocks with one dict probe each and a
node's key also names its ancestors. Like SGLang's radix cache, a node has a ``lock_ref`` (requests
using it) and a ``last_access`` tick; sizes are two counters (evictable and protected blocks) moved
on lock/unlock, and eviction pops unlocked leaves from a heap ordered by last access, pushing a
parent when it becomes a leaf, so nothing ever scans the tree.

The cache holds one pool reference on each node's block; a request using a node holds another and
locks the node, so for every node ``ref_count(block) == 1 + lock_ref`` (checked by the tests).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from kvbalance.kvcache.blocks import BlockPool

_U64 = np.uint64


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finaliser: a non-linear 64-bit mix (wrapping uint64 arithmetic)."""
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


class _HashCoefficients:
    """Fixed pseudo-random coefficients: one per position in a block, one per block index."""

    def __init__(self) -> None:
        self._pos: dict[int, np.ndarray] = {}
        self._blk = np.zeros(0, dtype=np.uint64)

    def positions(self, block_size: int) -> np.ndarray:
        c = self._pos.get(block_size)
        if c is None:
            c = _splitmix64(np.arange(1, block_size + 1, dtype=np.uint64) * _U64(0x2545F4914F6CDD1D)) | _U64(
                1
            )
            self._pos[block_size] = c
        return c

    def blocks(self, n: int) -> np.ndarray:
        if n > len(self._blk):
            m = max(n, 2 * len(self._blk), 1024)
            self._blk = _splitmix64(np.arange(m, dtype=np.uint64) ^ _U64(0xD6E8FEB86659FD93)) | _U64(1)
        return self._blk[:n]


_COEF = _HashCoefficients()


_M64 = (1 << 64) - 1


def _splitmix64_int(x: int) -> int:
    """Pure-Python twin of :func:`_splitmix64` (same bits), for hashing one or two blocks cheaply."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _few_block_hashes(tokens, block_size: int, start_block: int, prev_hash: int, n_full: int) -> list[int]:
    pos = _COEF.positions(block_size).tolist()
    blk = _COEF.blocks(n_full).tolist()
    out = []
    h = prev_hash
    for b in range(start_block, n_full):
        chunk = tokens[b * block_size : (b + 1) * block_size]
        if isinstance(chunk, np.ndarray):
            chunk = chunk.tolist()
        acc = 0
        for t, c in zip(chunk, pos):
            acc += t * c
        h = (h + _splitmix64_int(acc & _M64) * blk[b]) & _M64
        out.append(h)
    return out


def prefix_block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    start_block: int = 0,
    prev_hash: int = 0,
    end_block=None,
) -> list[int]:
    """Chained hashes of full blocks ``[start_block, end_block)``: hash i names tokens ``[0, (i+1)*bs)``.

    ``prev_hash`` is the hash of block ``start_block - 1`` (0 at the start). Content hash of a block is a
    mixed polynomial of its tokens; the prefix hash is the running sum of block hashes times per-index
    coefficients (mod 2**64), so extending a prompt's hashes costs only the new blocks.
    """
    n_full = len(tokens) // block_size if end_block is None else end_block
    if n_full <= start_block:
        return []
    if n_full - start_block <= 2:
        return _few_block_hashes(tokens, block_size, start_block, prev_hash, n_full)
    arr = np.asarray(tokens[start_block * block_size : n_full * block_size], dtype=np.int64)
    blocks = arr.astype(np.uint64).reshape(-1, block_size)
    content = _splitmix64((blocks * _COEF.positions(block_size)).sum(axis=1, dtype=np.uint64))
    terms = content * _COEF.blocks(n_full)[start_block:]
    hashes = np.cumsum(terms, dtype=np.uint64) + _U64(prev_hash)
    return hashes.tolist()


def request_block_hashes(request, block_size: int, num_tokens: int) -> list[int]:
    """The request's chained block hashes over its first ``num_tokens`` tokens (cached on the request)."""
    cached = request._block_hashes
    if cached is None:
        cached = request._block_hashes = []
    want = num_tokens // block_size
    have = len(cached)
    if want > have:
        n_prompt = request.num_prompt_tokens
        prev = cached[-1] if have else 0
        if want * block_size <= n_prompt:
            cached.extend(prefix_block_hashes(request.prompt_token_ids, block_size, have, prev, want))
        else:
            # only the blocks past ``have`` are read: pad the front so block indices line up
            lo = have * block_size
            toks = _Offset(request.token_ids(lo, want * block_size), lo)
            cached.extend(prefix_block_hashes(toks, block_size, have, prev, want))
    return cached if want == len(cached) else cached[:want]


class _Offset:
    """A token list that starts at position ``offset`` (reads below it are never made)."""

    __slots__ = ("tokens", "offset")

    def __init__(self, tokens: list[int], offset: int) -> None:
        self.tokens = tokens
        self.offset = offset

    def __len__(self) -> int:
        return self.offset + len(self.tokens)

    def __getitem__(self, s: slice):
        return self.tokens[s.start - self.offset : s.stop - self.offset]


class RadixNode:
    __slots__ = ("key", "block_id", "parent", "num_children", "lock_ref", "last_access")

    def __init__(self, key, block_id: int, parent) -> None:
        self.key = key
        self.block_id = block_id
        self.parent = parent
        self.num_children = 0
        self.lock_ref = 0
        self.last_access = 0

    def __repr__(self) -> str:
        return f"RadixNode(block={self.block_id}, lock_ref={self.lock_ref}, children={self.num_children})"


class RadixCache:
    """Prefix cache over a :class:`BlockPool` (see the module docstring)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.root = RadixNode(None, -1, None)
        self.root.lock_ref = 1  # never evicted
        self._nodes: dict[int, RadixNode] = {}
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._tick = 0
        self._seq = 0
        self.evictable_blocks = 0  # nodes with lock_ref == 0 (evictable now or once their children go)
        self.protected_blocks = 0  # nodes locked by at least one request
        self.num_evicted = 0

    # -- sizes ------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._nodes)

    def _push(self, node: RadixNode) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (node.last_access, self._seq, node))
        if len(self._heap) > 2 * len(self._nodes) + 1024:
            self._compact_heap()

    def _compact_heap(self) -> None:
        self._heap = [
            (n.last_access, i, n)
            for i, n in enumerate(self._nodes.values())
            if n.lock_ref == 0 and n.num_children == 0
        ]
        heapq.heapify(self._heap)
        self._seq = len(self._heap)

    # -- lookup -----------------------------------------------------------------
    def match_prefix(self, hashes: Sequence[int]) -> list[RadixNode]:
        """Nodes of the longest cached prefix of ``hashes`` (one per block), touched as recently used."""
        nodes = self._nodes
        out: list[RadixNode] = []
        for h in hashes:
            node = nodes.get(h)
            if node is None:
                break
            out.append(node)
        if out:
            self._tick += 1
            tick = self._tick
            for node in out:
                node.last_access = tick
            last = out[-1]
            if last.lock_ref == 0 and last.num_children == 0:
                self._push(last)
        return out

    def lock(self, nodes: Sequence[RadixNode]) -> None:
        for node in nodes:
            if node.lock_ref == 0:
                self.evictable_blocks -= 1
                self.protected_blocks += 1
            node.lock_ref += 1

    def unlock(self, nodes: Sequence[RadixNode]) -> None:
        self._tick += 1
        tick = self._tick
        for node in reversed(nodes):
            if node.lock_ref <= 0:
                raise RuntimeError(f"{node}: unlock of an unlocked node")
            node.lock_ref -= 1
            node.last_access = tick
            if node.lock_ref == 0:
                self.evictable_blocks += 1
                self.protected_blocks -= 1
                if node.num_children == 0:
                    self._push(node)

    # -- insertion --------------------------------------------------------------
    def insert(self, hashes: Sequence[int], block_ids: Sequence[int], start: int = 0) -> list[RadixNode]:
        """Cache blocks ``[start, len(hashes))`` of a sequence; return their nodes (not locked).

        ``hashes[start - 1]`` must already be cached when ``start > 0``. Where a block's prefix is
        cached already (another request computed it), the existing node is returned and the caller
        should switch to its block; otherwise a new node takes a pool reference on ``block_ids[i]``.
        """
        nodes = self._nodes
        pool = self.pool
        parent = self.root if start == 0 else nodes[hashes[start - 1]]
        self._tick += 1
        tick = self._tick
        out: list[RadixNode] = []
        for i in range(start, len(hashes)):
            h = hashes[i]
            node = nodes.get(h)
            if node is None:
                node = RadixNode(h, block_ids[i], parent)
                node.last_access = tick
                pool.incref((block_ids[i],))
                nodes[h] = node
                parent.num_children += 1
                self.evictable_blocks += 1
            else:
                node.last_access = tick
            out.append(node)
            parent = node
        if out and out[-1].lock_ref == 0 and out[-1].num_children == 0:
            self._push(out[-1])  # its access stamp moved: the old heap entry is stale
        return out

    # -- eviction ---------------------------------------------------------------
    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks by dropping least recently used unlocked leaves."""
        heap = self._heap
        nodes = self._nodes
        root = self.root
        freed = 0
        to_free: list[int] = []
        while freed < num_blocks and heap:
            stamp, _, node = heapq.heappop(heap)
            if (
                node.lock_ref != 0
                or node.num_children != 0
                or stamp != node.last_access
                or nodes.get(node.key) is not node
            ):
                continue  # stale entry
            del nodes[node.key]
            to_free.append(node.block_id)
            self.evictable_blocks -= 1
            freed += 1
            parent = node.parent
            parent.num_children -= 1
            if parent is not root and parent.lock_ref == 0 and parent.num_children == 0:
                self._seq += 1
                heapq.heappush(heap, (parent.last_access, self._seq, parent))
        self.pool.free(to_free)
        self.num_evicted += freed
        return freed

    def reset(self) -> int:
        """Drop every unlocked node (e.g. after weights change); return blocks freed."""
        return self.evict(len(self._nodes))

    # -- checks -----------------------------------------------------------------
    def check_invariants(self) -> None:
        children: dict[int, int] = {}
        evictable = protected = 0
        for key, node in self._nodes.items():
            if node.key != key:
                raise AssertionError("node stored under a foreign key")
            if node.lock_ref < 0:
                raise AssertionError(f"{node}: negative lock_ref")
            if node.lock_ref == 0:
                evictable += 1
            else:
                protected += 1
            parent = node.parent
            if parent is not self.root:
                if self._nodes.get(parent.key) is not parent:
                    raise AssertionError(f"{node}: parent not in the cache")
                if parent.lock_ref < node.lock_ref:
                    raise AssertionError(f"{node}: locked more than its parent")
            children[id(parent)] = children.get(id(parent), 0) + 1
            if self.pool.ref_count(node.block_id) != 1 + node.lock_ref:
                raise AssertionError(
                    f"{node}: block ref count {self.pool.ref_count(node.block_id)} != 1 + lock_ref"
                )
        for node in [self.root, *self._nodes.values()]:
            if node.num_children != children.get(id(node), 0):
                raise AssertionError(f"{node}: child count {node.num_children} is wrong")
        if (evictable, protected) != (self.evictable_blocks, self.protected_blocks):
            raise AssertionError(
                f"size counters ({self.evictable_blocks}, {self.protected_blocks}) != ({evictable}, {protected})"
            )
        entries = {(id(n), stamp) for stamp, _, n in self._heap}
        for node in self._nodes.values():
            if node.lock_ref == 0 and node.num_children == 0 and (id(node), node.last_access) not in entries:
                raise AssertionError(f"{node}: evictable leaf missing from the eviction heap")
