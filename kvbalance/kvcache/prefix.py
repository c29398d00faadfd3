"""RadixCache: a compressed token trie at block granularity over the BlockPool, with lock refs and LRU eviction.

A block is named by the chained hash of the whole token prefix that ends with it, so comparing two
prompts block by block is comparing two lists of ints, and one hash also names all its ancestors.
A node holds a run of blocks (their prefix hashes and block ids); children are keyed by the hash of
their first block. Like SGLang's radix cache, a node has a ``lock_ref`` (requests whose prefix runs
through it) and a ``last_access`` tick; a partial match splits a node; sizes are two counters
(evictable and protected blocks) moved on lock/unlock; eviction trims the tails of least recently
used unlocked leaves popped from a heap, pushing a parent when it becomes a leaf — nothing scans the
tree, and per-request work is per node, not per block (lists are sliced, not walked).

Each node also keeps its blocks' tokens (fixed-width int64 bytes, ``hashing.token_bytes``): a lookup that
matched by hash is checked against the request's tokens (:meth:`RadixCache.verify_tokens`), and a block
whose tokens differ ends the hit there (counted in ``num_token_mismatches``) — defence in depth should two
prefixes ever share a hash.

The cache holds one pool reference on each cached block; every request whose prefix uses a node
holds another and one ``lock_ref`` on it (a request locks the whole path from the root), so for
every cached block ``ref_count(block) == 1 + lock_ref(node)`` (checked by the tests).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvbalance.kvcache.blocks import BlockPool

# the hashes live in hashing.py; importers of kvbalance.kvcache.prefix keep getting them here
from kvbalance.kvcache.hashing import prefix_block_hashes as prefix_block_hashes
from kvbalance.kvcache.hashing import request_block_hashes as request_block_hashes


class RadixNode:
    __slots__ = (
        "key",
        "hashes",
        "block_ids",
        "tokens",
        "parent",
        "children",
        "lock_ref",
        "last_access",
        "alive",
        "flush",
    )

    def __init__(
        self, hashes: list[int], block_ids: list[int], parent, tokens: bytearray | None = None
    ) -> None:
        self.key = hashes[0] if hashes else None
        self.hashes = hashes
        self.block_ids = block_ids
        self.tokens = tokens  # the blocks' tokens as int64 bytes (None: inserted without them, not checked)
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.alive = True
        self.flush = (
            None  # set while its one locker has blocks to publish here still (deferred): publishes them
        )

    def __repr__(self) -> str:
        return f"RadixNode(blocks={len(self.block_ids)}, lock_ref={self.lock_ref}, children={len(self.children)})"


def _common_prefix(node_hashes: list[int], hashes: Sequence[int], i: int, n: int | None = None) -> int:
    """Blocks of ``node_hashes`` equal to ``hashes[i:n]`` (``n``: default all) from the start (>= 1 when the
    first matched).

    Prefix hashes are chained, so equality is monotone along the run: binary search the boundary.
    """
    m = min(len(node_hashes), (len(hashes) if n is None else n) - i)
    if node_hashes[m - 1] == hashes[i + m - 1]:
        return m
    lo, hi = 1, m - 1  # node_hashes[lo - 1] matches, node_hashes[hi] does not
    while lo <= hi:
        mid = (lo + hi) // 2
        if node_hashes[mid] == hashes[i + mid]:
            lo = mid + 1
        else:
            hi = mid - 1
    return lo


class RadixCache:
    """Prefix cache over a :class:`BlockPool` (see the module docstring)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._width = 8 * pool.block_size  # bytes of one block's tokens
        self.root = RadixNode([], [], None)
        self.root.lock_ref = 1  # never evicted, never counted
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._tick = 0
        self._seq = 0
        self._num_nodes = 0
        self.evictable_blocks = 0  # cached blocks in nodes with lock_ref == 0
        self.protected_blocks = 0  # cached blocks in nodes some request has locked
        self.num_evicted = 0
        self.num_token_mismatches = 0  # hits by hash refused because the cached tokens differ
        # lazy hashes (KVCacheManager.enable_lazy_hashes): a node may hold fewer hashes than blocks, the rest
        # computed from its tokens by this hasher (chained from its last hash) when a lookup or a split needs
        # them; None: every node holds all its hashes
        self.hasher = None

    # -- sizes ------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return self.evictable_blocks + self.protected_blocks

    def _push(self, node: RadixNode) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (node.last_access, self._seq, node))
        if len(self._heap) > 4 * self._num_nodes + 1024:
            self._heap = [
                (n.last_access, i, n)
                for i, n in enumerate(self.iter_nodes())
                if n.lock_ref == 0 and not n.children
            ]
            heapq.heapify(self._heap)
            self._seq = len(self._heap)

    def iter_nodes(self):
        """All nodes but the root (a traversal: for checks and rebuilds, never on a hot path)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def materialize(self, node: RadixNode) -> None:
        """Compute the hashes a lazy node does not hold yet (the same values an eager insert stored)."""
        h = node.hashes
        have = len(h)
        if have < len(node.block_ids):
            w = self._width
            h.extend(
                self.hasher.token_bytes_hashes(bytes(node.tokens[have * w :]), self.block_size, have, h[-1])
            )

    # -- paths ------------------------------------------------------------------
    def blocks_of(self, node: RadixNode) -> list[int]:
        """Block ids from the root down to the end of ``node``."""
        parts = []
        while node is not self.root:
            parts.append(node.block_ids)
            node = node.parent
        out: list[int] = []
        for p in reversed(parts):
            out.extend(p)
        return out

    def unlocked_blocks_on_path(self, node: RadixNode) -> int:
        n = 0
        while node is not self.root and node.lock_ref == 0:
            n += len(node.block_ids)
            node = node.parent
        return n

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node`` after its first ``k`` blocks; return the new upper part (same locks and stamp)."""
        if node.flush is not None:
            node.flush()
        if len(node.hashes) < len(node.block_ids):
            self.materialize(node)
        cut = k * self._width
        tokens = node.tokens
        upper = RadixNode(
            node.hashes[:k], node.block_ids[:k], node.parent, None if tokens is None else tokens[:cut]
        )
        if tokens is not None:
            del tokens[:cut]
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.parent.children[upper.key] = upper
        node.hashes = node.hashes[k:]
        node.block_ids = node.block_ids[k:]
        node.key = node.hashes[0]
        node.parent = upper
        upper.children[node.key] = node
        self._num_nodes += 1
        return upper

    # -- lookup -----------------------------------------------------------------
    def _next_run(
        self, node: RadixNode, hashes: Sequence[int], i: int, n: int
    ) -> tuple[RadixNode | None, int]:
        """The child of ``node`` that continues ``hashes[:n]`` at block ``i`` and how many of its blocks match
        (split so the returned node ends at the match), or ``(None, 0)``."""
        child = node.children.get(hashes[i])
        if child is None:
            return None, 0
        if child.flush is not None:  # a lookup reaches blocks published late: publish them first
            child.flush()
        if len(child.hashes) < len(child.block_ids):
            self.materialize(child)
        k = _common_prefix(child.hashes, hashes, i, n)
        if k < len(child.hashes):
            child = self._split(child, k)
        return child, k

    def match_prefix(self, hashes: Sequence[int]) -> tuple[RadixNode, int]:
        """Deepest node of the longest cached prefix of ``hashes`` and its length in blocks.

        A match that ends inside a node splits it, so the returned node ends exactly at the match.
        Nodes on the path are touched as recently used. Returns ``(root, 0)`` on a miss.
        """
        node = self.root
        i = 0
        n = len(hashes)
        self._tick += 1
        tick = self._tick
        while i < n:
            child, k = self._next_run(node, hashes, i, n)
            if child is None:
                break
            child.last_access = tick
            node = child
            i += k
        if node is not self.root and node.lock_ref == 0 and not node.children:
            self._push(node)
        return node, i

    def verify_tokens(self, node: RadixNode, num_blocks: int, tokens: bytes) -> tuple[RadixNode, int]:
        """Check a hit (``match_prefix``'s answer) against the request's tokens; return the verified part.

        ``tokens`` are the request's first ``num_blocks`` blocks of tokens as ``hashing.token_bytes``. The
        path is compared node by node; at the first block whose cached tokens differ the hit ends (the node
        is split there) and ``num_token_mismatches`` counts one refused lookup.
        """
        path = []
        n = node
        while n is not self.root:
            path.append(n)
            n = n.parent
        w = self._width
        off = 0
        for n in reversed(path):
            size = len(n.block_ids)
            if n.tokens is not None:
                mine = tokens[off * w : (off + size) * w]
                if n.tokens != mine:
                    self.num_token_mismatches += 1
                    j = 0  # the first block that differs
                    while j < size and n.tokens[j * w : (j + 1) * w] == mine[j * w : (j + 1) * w]:
                        j += 1
                    if j == 0:
                        return (n.parent, off)
                    return self._split(n, j), off + j
            off += size
        return node, num_blocks

    def lock(self, node: RadixNode) -> None:
        """Lock the path from the root to ``node`` (one request's use of that prefix)."""
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                n = len(node.block_ids)
                self.evictable_blocks -= n
                self.protected_blocks += n
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        root = self.root
        self._tick += 1
        tick = self._tick
        while node is not root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"{node}: unlock of an unlocked node")
            node.lock_ref -= 1
            node.last_access = tick
            if node.lock_ref == 0:
                n = len(node.block_ids)
                self.evictable_blocks += n
                self.protected_blocks -= n
                if not node.children:
                    self._push(node)
            node = node.parent

    # -- insertion --------------------------------------------------------------
    def extend(
        self,
        node: RadixNode,
        start: int,
        hashes: Sequence[int],
        block_ids: Sequence[int],
        tokens: bytes | None = None,
        end: int | None = None,
    ) -> tuple[RadixNode, list[int]]:
        """Cache blocks ``[start, end)`` (``end``: default ``len(hashes)``) below ``node`` for a caller that holds
        a lock on it.

        ``node`` ends at block ``start`` of the caller's sequence (the root when ``start == 0``); ``tokens``
        are those blocks' tokens (``hashing.token_bytes``), kept with the new blocks for :meth:`verify_tokens`.
        Blocks whose prefix is cached already are shared; the rest are added with a pool reference
        each. Returns the new deepest node — the caller's lock now covers the path to it — and the
        cached block ids of ``[start, end)``: where one differs from ``block_ids``, another
        request computed that block first and the caller should switch to the cached one.
        """
        i = start
        n = len(hashes) if end is None else end
        self._tick += 1
        tick = self._tick
        out: list[int] = []
        while i < n and node.children:
            child, k = self._next_run(node, hashes, i, n)
            if child is None:
                break
            if child.lock_ref == 0:
                self.evictable_blocks -= len(child.block_ids)
                self.protected_blocks += len(child.block_ids)
            child.lock_ref += 1
            child.last_access = tick
            out.extend(child.block_ids)
            node = child
            i += k
        if i < n:
            new_blocks = list(block_ids[i:n])
            self.pool.incref(new_blocks)
            self.protected_blocks += len(new_blocks)
            w = self._width
            new_tokens = None if tokens is None else bytearray(tokens[(i - start) * w : (n - start) * w])
            if new_tokens is not None and len(new_tokens) != (n - i) * w:
                raise ValueError(
                    f"tokens: need {(n - start) * w} bytes for blocks {start}..{n}, got {len(tokens)}"
                )
            if (
                node is not self.root
                and not node.children
                and node.lock_ref == 1
                and (node.tokens is None) == (new_tokens is None)
            ):
                # only the caller uses this leaf: grow it in place (a lazy node's hashes stay to compute; a
                # caller with lazy hashes may give fewer than n: the node becomes lazy)
                if len(node.hashes) == len(node.block_ids):
                    node.hashes.extend(hashes[i:n])
                node.block_ids.extend(new_blocks)
                if new_tokens is not None:
                    node.tokens += new_tokens
            else:
                child = RadixNode(list(hashes[i:n]), new_blocks, node, new_tokens)
                child.lock_ref = 1
                node.children[child.key] = child
                self._num_nodes += 1
                node = child
            node.last_access = tick
            out.extend(new_blocks)
        return node, out

    def grow_leaf(
        self, node: RadixNode, block_ids: list[int], tokens: bytes, tick: int | None = None
    ) -> None:
        """:meth:`extend` of ``node`` (a leaf only the caller has locked, ``lock_ref == 1``, with tokens) by new
        blocks, for a caller with lazy hashes (``hasher`` set): the same tick, references, counters, blocks and
        tokens; the node's hashes are left to compute (:meth:`materialize`). ``tick``: the one taken when the
        last of these blocks filled (:meth:`take_tick`; publication deferred), instead of a new one."""
        if tick is None:
            self._tick += 1
            tick = self._tick
        self.pool.incref(block_ids)
        self.protected_blocks += len(block_ids)
        node.block_ids.extend(block_ids)
        node.tokens += tokens
        node.last_access = tick

    def take_tick(self) -> int:
        """The tick an :meth:`extend` now would stamp (and count), for a publication deferred to later."""
        self._tick += 1
        return self._tick

    def flush_all(self) -> None:
        """Publish every block whose publication is deferred (``RadixNode.flush``)."""
        for node in list(self.iter_nodes()):
            if node.flush is not None:
                node.flush()

    def insert(
        self, hashes: Sequence[int], block_ids: Sequence[int], tokens: bytes | None = None
    ) -> tuple[RadixNode, list[int]]:
        """Cache a whole sequence's blocks without keeping a lock (see :meth:`extend`)."""
        node, out = self.extend(self.root, 0, hashes, block_ids, tokens)
        if node is not self.root:
            self.unlock(node)
        return node, out

    # -- eviction ---------------------------------------------------------------
    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks, trimming the tails of least recently used unlocked leaves."""
        heap = self._heap
        if num_blocks == 1 and heap:  # a decode's block: one off the LRU leaf's tail, the loop below in short
            b = self.take_lru_tail()
            if b is not None:
                self.pool.free((b,))
                return 1
        to_free = self.evict_taking(num_blocks)
        self.pool.free(to_free)
        return len(to_free)

    def evict_taking(self, num_blocks: int) -> list[int]:
        """:meth:`evict`, but the blocks are handed to the caller in the order ``evict`` frees them, each still
        with the cache's pool reference (the caller frees them, or keeps them: ``free`` then ``allocate``)."""
        heap = self._heap
        root = self.root
        freed = 0
        to_free: list[int] = []
        while freed < num_blocks and heap:
            stamp, _, node = heap[0]
            if not node.alive or node.lock_ref != 0 or node.children or stamp != node.last_access:
                heapq.heappop(heap)
                continue  # stale entry
            k = min(len(node.block_ids), num_blocks - freed)
            if k == len(node.block_ids):
                heapq.heappop(heap)
                to_free.extend(node.block_ids)
                node.alive = False
                parent = node.parent
                del parent.children[node.key]
                self._num_nodes -= 1
                if parent is not root and parent.lock_ref == 0 and not parent.children:
                    self._seq += 1
                    heapq.heappush(heap, (parent.last_access, self._seq, parent))
            else:
                to_free.extend(node.block_ids[-k:])
                del node.block_ids[-k:]
                del node.hashes[len(node.block_ids) :]  # (a lazy node may hold fewer)
                if node.tokens is not None:
                    del node.tokens[-k * self._width :]
                self._seq += 1
                heapq.heapreplace(heap, (stamp, self._seq, node))  # pop it, push it back: one sift
            self.evictable_blocks -= k
            freed += k
        self.num_evicted += freed
        return to_free

    def take_lru_tail(self) -> int | None:
        """:meth:`evict` of one block where it trims the least recently used leaf's tail (the leaf keeps other
        blocks), but the block is handed to the caller with the cache's pool reference instead of freed (the
        caller frees it, or keeps it as its own: what ``free`` then ``allocate(1)`` would do); None (nothing
        changed) in any other case."""
        got: list[int] = []
        return got[0] if self.take_lru_tails([got]) else None

    def take_lru_tails(self, dests: list[list[int]], start: int = 0) -> int:
        """:meth:`take_lru_tail` for each of ``dests[start:]`` in order (each a block table: the block is appended
        to it), while it can, in one call; returns the index of the first it could not serve (``len(dests)``:
        all)."""
        heap = self._heap
        width = self._width
        i = start
        k = len(dests)
        while i < k and heap:
            stamp, _, node = heap[0]
            ids = node.block_ids
            if not (
                len(ids) > 1
                and node.alive
                and node.lock_ref == 0
                and not node.children
                and stamp == node.last_access
            ):
                break
            dests[i].append(ids.pop())
            del node.hashes[len(ids) :]
            if node.tokens is not None:
                del node.tokens[-width:]
            self._seq += 1
            entry = (stamp, self._seq, node)
            n = len(heap)  # still the smallest (the usual case): no sift
            if (n < 2 or entry < heap[1]) and (n < 3 or entry < heap[2]):
                heap[0] = entry
            else:
                heapq.heapreplace(heap, entry)
            self.evictable_blocks -= 1
            self.num_evicted += 1
            i += 1
        return i

    def evict_blocks(self, block_ids: Sequence[int]) -> int:
        """Drop the given blocks from the prefix cache, with every cached block below them; return blocks freed.

        A cached block's descendants extend its prefix, so they go too. Every block dropped must be unlocked
        (no running request uses it): preempt the holders first. Cost: one traversal of the tree.
        """
        targets = set(block_ids)
        if not targets:
            return 0
        self.flush_all()
        root = self.root
        freed: list[int] = []
        nodes_removed = 0
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            cut = next((j for j, b in enumerate(node.block_ids) if b in targets), None)
            if cut is None:
                stack.extend(node.children.values())
                continue
            if node.lock_ref != 0:
                raise RuntimeError(
                    f"{node}: cannot evict block {node.block_ids[cut]} that a running request uses"
                )
            # everything below the cut goes
            freed.extend(node.block_ids[cut:])
            below = list(node.children.values())
            while below:
                n = below.pop()
                freed.extend(n.block_ids)
                n.alive = False
                nodes_removed += 1
                below.extend(n.children.values())
            node.children = {}
            if cut == 0:
                node.alive = False
                nodes_removed += 1
                parent = node.parent
                del parent.children[node.key]
                if parent is not root and parent.lock_ref == 0 and not parent.children:
                    self._push(parent)
            else:
                del node.block_ids[cut:]
                del node.hashes[cut:]
                if node.tokens is not None:
                    del node.tokens[cut * self._width :]
                self._push(node)  # a leaf now
        self._num_nodes -= nodes_removed
        self.evictable_blocks -= len(freed)
        self.num_evicted += len(freed)
        self.pool.free(freed)
        return len(freed)

    def reset(self) -> int:
        """Drop every unlocked block (e.g. after weights change); return blocks freed."""
        return self.evict(self.num_cached_blocks)

    def all_block_ids(self) -> set[int]:
        return {b for node in self.iter_nodes() for b in node.block_ids}

    # -- checks -----------------------------------------------------------------
    def check_invariants(self) -> None:
        self.flush_all()
        if self.hasher is not None:
            for node in self.iter_nodes():
                self.materialize(node)
        evictable = protected = nodes = 0
        entries = {(id(n), stamp) for stamp, _, n in self._heap}
        seen: set[int] = set()
        for node in self.iter_nodes():
            nodes += 1
            if not node.alive or not node.block_ids or len(node.hashes) != len(node.block_ids):
                raise AssertionError(f"{node}: dead, empty or ragged node in the tree")
            if node.tokens is not None and len(node.tokens) != len(node.block_ids) * self._width:
                raise AssertionError(
                    f"{node}: {len(node.tokens)} token bytes for {len(node.block_ids)} blocks"
                )
            if node.key != node.hashes[0] or node.parent.children.get(node.key) is not node:
                raise AssertionError(f"{node}: stored under a foreign key")
            if node.lock_ref < 0:
                raise AssertionError(f"{node}: negative lock_ref")
            if node.parent is not self.root and node.parent.lock_ref < node.lock_ref:
                raise AssertionError(f"{node}: locked more than its parent")
            if node.lock_ref == 0:
                evictable += len(node.block_ids)
                if not node.children and (id(node), node.last_access) not in entries:
                    raise AssertionError(f"{node}: evictable leaf missing from the eviction heap")
            else:
                protected += len(node.block_ids)
            for b in node.block_ids:
                if b in seen:
                    raise AssertionError(f"block {b} cached twice")
                seen.add(b)
                # the cache's own reference plus one per locker that uses this copy (a locker that
                # computed the block concurrently keeps its own copy: block tables are append-only)
                if not 1 <= self.pool.ref_count(b) <= 1 + node.lock_ref:
                    raise AssertionError(
                        f"{node}: block {b} ref count {self.pool.ref_count(b)} not in [1, 1 + lock_ref]"
                    )
        if (evictable, protected) != (self.evictable_blocks, self.protected_blocks):
            raise AssertionError(
                f"size counters ({self.evictable_blocks}, {self.protected_blocks}) != ({evictable}, {protected})"
            )
        if nodes != self._num_nodes:
            raise AssertionError(f"node count {self._num_nodes} != {nodes}")
