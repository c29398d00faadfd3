"""BlockPool: the paged KV memory of one instance — fixed-size blocks, a free list, reference counts.

Allocation and release are O(1) per block whatever the pool size (a LIFO stack of free ids, a
reference count per block), so the pool stays fast at 100k+ blocks. A block is free exactly when
its reference count is zero; the prefix cache and each request that uses a block hold one
reference each.
"""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        # Reversed so that the first allocations get ids 0, 1, 2, ... (easier to read in tests).
        self._free = list(range(num_blocks - 1, -1, -1))

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

    # -- checks -----------------------------------------------------------------
    def check_invariants(self) -> None:
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("free list holds a block twice")
        zero = {b for b, r in enumerate(self._ref) if r == 0}
        if zero != set(free):
            raise AssertionError(
                f"free list and zero ref counts disagree: {sorted(zero ^ set(free))[:10]} differ"
            )
        if any(r < 0 for r in self._ref):
            raise AssertionError("negative reference count")
