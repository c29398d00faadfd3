"""BlockPool: the paged KV memory of one instance — fixed-size blocks, a free list, reference counts.

Allocation and release are O(1) per block whatever the pool size (a LIFO stack of free ids, a
reference count per block), so the pool stays fast at 100k+ blocks. A block is free exactly when
its reference count is zero; the prefix cache and each request that uses a block hold one
reference each.

:class:`ElasticBlockPool` adds an elastic region (the Elastic KV Cache paper's lendable activation
reserve): blocks that exist but start *detached* (reference count 0, not in any free list) and join
or leave the pool with ``attach`` / ``detach``. Base blocks are always handed out first, so lent
blocks are used only when the base pool runs dry and reclaiming them rarely has to drain anything.
The plain pool's hot paths are untouched.

``BlockPool.resize`` changes how many blocks are usable (a layer migration changes how much KV a block
costs on a GPU): growing adds free blocks, shrinking retires free blocks only — a block in use never
moves — and fails, changing nothing, when too few are free. Retired ids keep reference count 0 outside
the free list and are reused first when the pool grows again.
"""

from __future__ import annotations

from collections.abc import Callable


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.num_blocks = num_blocks  # blocks usable now (attached)
        self.num_total_blocks = num_blocks  # every block id, attached or not: ids are [0, num_total_blocks)
        self.block_size = block_size
        self._ref = [0] * num_blocks
        # Reversed so that the first allocations get ids 0, 1, 2, ... (easier to read in tests).
        self._free = list(range(num_blocks - 1, -1, -1))
        self._retired: list[int] = []  # ids taken out by ``resize`` (reference count 0, not free)

    # -- sizes ------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # -- allocation -------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        if n <= 0:
            return []
        free = self._free
        ids = free[-n:]
        del free[-n:]
        ref = self._ref
        for b in ids:
            ref[b] = 1
        return ids

    def incref(self, block_ids) -> None:
        ref = self._ref
        for b in block_ids:
            if ref[b] <= 0:
                raise RuntimeError(f"block {b}: incref of a free block")
            ref[b] += 1

    def free(self, block_ids) -> None:
        """Drop one reference from each block; blocks that reach zero return to the free list."""
        ref = self._ref
        free = self._free
        for b in block_ids:
            r = ref[b]
            if r <= 0:
                raise RuntimeError(f"block {b}: double free")
            r -= 1
            ref[b] = r
            if r == 0:
                free.append(b)

    # -- resizing ---------------------------------------------------------------
    def resize(self, num_blocks: int) -> None:
        """Make ``num_blocks`` blocks usable. Shrinking takes free blocks only (the most recently freed);
        raises ``OutOfBlocks`` (nothing changed) when fewer than ``num_blocks_now - num_blocks`` are free."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        retired = self._retired
        diff = num_blocks - self.num_blocks
        if diff < 0:
            if -diff > len(self._free):
                raise OutOfBlocks(f"resize: {-diff} blocks must leave, {len(self._free)} are free")
            retired.extend(self._free[diff:])
            del self._free[diff:]
        elif diff > 0:
            reuse = min(diff, len(retired))
            new = list(range(self.num_total_blocks, self.num_total_blocks + diff - reuse))
            self._ref.extend([0] * len(new))
            self.num_total_blocks += len(new)
            self._free.extend(retired[len(retired) - reuse :] + new)
            del retired[len(retired) - reuse :]
        self.num_blocks = num_blocks

    # -- checks -----------------------------------------------------------------
    def check_invariants(self) -> None:
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("free list holds a block twice")
        retired = set(self._retired)
        if retired & set(free) or any(self._ref[b] for b in retired):
            raise AssertionError("a retired block is free or in use")
        if self.num_blocks + len(retired) != self.num_total_blocks:
            raise AssertionError(
                f"{self.num_blocks} usable + {len(retired)} retired != {self.num_total_blocks}"
            )
        zero = {b for b, r in enumerate(self._ref) if r == 0} - retired
        if zero != set(free):
            raise AssertionError(
                f"free list and zero ref counts disagree: {sorted(zero ^ set(free))[:10]} differ"
            )
        if any(r < 0 for r in self._ref):
            raise AssertionError("negative reference count")


class ElasticBlockPool(BlockPool):
    """A BlockPool of ``num_blocks`` base blocks plus ``num_elastic`` detached blocks ``[base, base + E)``.

    ``num_blocks`` counts the attached blocks (base plus lent), so sizes and ``capacity_tokens`` follow
    lending. Free lent blocks sit in their own stack with a position index, so ``detach`` is O(E) and
    allocation takes base blocks first. A detached block has reference count 0 and is in no free list.
    """

    def __init__(self, num_blocks: int, block_size: int, num_elastic: int) -> None:
        super().__init__(num_blocks, block_size)
        if num_elastic < 0:
            raise ValueError(f"num_elastic: must be >= 0, got {num_elastic}")
        self.base_blocks = num_blocks
        self.num_elastic = num_elastic
        self.num_total_blocks = num_blocks + num_elastic
        self._ref.extend([0] * num_elastic)
        self._attached = bytearray(b"\x01" * num_blocks) + bytearray(num_elastic)
        self._lent_free: list[int] = []  # free attached elastic blocks (a stack)
        self._lent_pos: dict[int, int] = {}  # elastic block -> its index in _lent_free
        # called with a block count before lent blocks are handed out (e.g. the prefix cache's ``evict``), so
        # cached prefixes in base blocks make room first and lent blocks hold live KV only when they must
        self.evict_before_lent: Callable[[int], int] | None = None

    # -- sizes ------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._lent_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._lent_free)

    @property
    def num_lent(self) -> int:
        """Elastic blocks attached now (free or in use)."""
        return self.num_blocks - self.base_blocks

    def is_attached(self, block_id: int) -> bool:
        return bool(self._attached[block_id])

    def elastic_block_ids(self) -> range:
        return range(self.base_blocks, self.num_total_blocks)

    # -- allocation -------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        base_free = len(self._free)
        if n <= base_free:
            return super().allocate(n)
        if self.evict_before_lent is not None and self._lent_free:
            self.evict_before_lent(n - base_free)
            base_free = len(self._free)
            if n <= base_free:
                return super().allocate(n)
        lent = self._lent_free
        if n > base_free + len(lent):
            raise OutOfBlocks(f"asked for {n} blocks, {base_free + len(lent)} free")
        ids = super().allocate(base_free)
        m = n - base_free
        extra = lent[-m:]
        del lent[-m:]
        pos = self._lent_pos
        ref = self._ref
        for b in extra:
            del pos[b]
            ref[b] = 1
        ids.extend(extra)
        return ids

    def free(self, block_ids) -> None:
        ref = self._ref
        free = self._free
        lent = self._lent_free
        pos = self._lent_pos
        base = self.base_blocks
        for b in block_ids:
            r = ref[b]
            if r <= 0:
                raise RuntimeError(f"block {b}: double free")
            r -= 1
            ref[b] = r
            if r == 0:
                if b < base:
                    free.append(b)
                else:
                    pos[b] = len(lent)
                    lent.append(b)

    def resize(self, num_blocks: int) -> None:
        raise ValueError("resize: an elastic pool changes size by attach / detach of its elastic region")

    # -- lending ----------------------------------------------------------------
    def _check_elastic(self, block_ids) -> list[int]:
        ids = list(block_ids)
        lo, hi = self.base_blocks, self.num_total_blocks
        for b in ids:
            if not lo <= b < hi:
                raise ValueError(f"block_ids: {b} is not in the elastic region [{lo}, {hi})")
        if len(set(ids)) != len(ids):
            raise ValueError("block_ids: a block is listed twice")
        return ids

    def attach(self, block_ids) -> None:
        """Put detached elastic blocks into the pool (free, reference count 0)."""
        ids = self._check_elastic(block_ids)
        att = self._attached
        for b in ids:
            if att[b]:
                raise RuntimeError(f"block {b}: attach of an attached block")
        lent = self._lent_free
        pos = self._lent_pos
        for b in ids:
            att[b] = 1
            pos[b] = len(lent)
            lent.append(b)
        self.num_blocks += len(ids)

    def detach(self, block_ids) -> None:
        """Take free elastic blocks out of the pool (O(len(block_ids))); each must be attached and free."""
        ids = self._check_elastic(block_ids)
        att = self._attached
        ref = self._ref
        for b in ids:
            if not att[b]:
                raise RuntimeError(f"block {b}: detach of a detached block")
            if ref[b] != 0:
                raise RuntimeError(f"block {b}: detach of a block in use (ref count {ref[b]})")
        lent = self._lent_free
        pos = self._lent_pos
        for b in ids:
            i = pos.pop(b)
            last = lent.pop()
            if last != b:  # swap-remove: the last free lent block takes b's slot
                lent[i] = last
                pos[last] = i
            att[b] = 0
        self.num_blocks -= len(ids)

    # -- checks -----------------------------------------------------------------
    def check_invariants(self) -> None:
        free, lent, att, ref = self._free, self._lent_free, self._attached, self._ref
        if len(set(free)) != len(free) or len(set(lent)) != len(lent):
            raise AssertionError("a free list holds a block twice")
        if any(b >= self.base_blocks for b in free) or any(b < self.base_blocks for b in lent):
            raise AssertionError("a block sits in the wrong free list")
        if {b: i for i, b in enumerate(lent)} != self._lent_pos:
            raise AssertionError("lent free-list positions are stale")
        if any(r < 0 for r in ref):
            raise AssertionError("negative reference count")
        detached = [b for b in range(self.num_total_blocks) if not att[b]]
        if any(b < self.base_blocks for b in detached):
            raise AssertionError("a base block is detached")
        if any(ref[b] for b in detached):
            raise AssertionError("a detached block is referenced")
        if self.num_blocks != self.num_total_blocks - len(detached):
            raise AssertionError(f"num_blocks {self.num_blocks} != attached blocks")
        zero = {b for b in range(self.num_total_blocks) if att[b] and ref[b] == 0}
        if zero != set(free) | set(lent):
            raise AssertionError(
                f"free lists and zero ref counts disagree: {sorted(zero ^ (set(free) | set(lent)))[:10]} differ"
            )
