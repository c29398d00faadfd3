"""The global KV store's worker half on real tensors: the store's host-side copy of each stored block's K/V.

``kvcache/store.py``'s ``GlobalKVStore`` is the bookkeeping (which block hashes are stored, LRU, pins); this
is where the bytes live for real executors. A save copies blocks (K and V, every layer) out of an
executor's paged KV into host tensors keyed by block hash; a load copies them into the fetching executor's
allocated blocks. Both are driven by :class:`~kvbalance.batch.KVTransfer` records (``peer="store"``, one
hash per block in ``block_hashes``), the same records the simulated path carries; ``StoreWorker`` is also a
``TorchExecutor`` ``transfer_handler`` (``worker(executor, transfer)``) for transfers that ride in a plan.

It only speaks the executor's block helpers (``read_blocks`` / ``write_blocks``: ``[layers, 2, n,
block_size, kv_heads, head_dim]``), so it imports no torch itself; which blocks stay is the store's call
(:meth:`retain` after its evictions), so the copy holds exactly the stored blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvbalance.batch import KVTransfer

STORE_PEER = "store"


class StoreWorker:
    """Block hash -> one block's K/V ``[layers, 2, block_size, kv_heads, head_dim]`` on ``device``."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.blocks: dict[int, Any] = {}
        self.saved_blocks = 0  # copies made (a block already held is not copied again)
        self.loaded_blocks = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.blocks

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.blocks.values())

    def __call__(self, executor, transfer: KVTransfer) -> None:
        """Run one store transfer on ``executor`` (the ``TorchExecutor.transfer_handler`` signature)."""
        if transfer.peer != STORE_PEER:
            raise ValueError(
                f"peer: the store worker moves peer={STORE_PEER!r} transfers, got {transfer.peer!r}"
            )
        if len(transfer.block_hashes) != len(transfer.block_ids):
            raise ValueError(
                f"block_hashes: {len(transfer.block_hashes)} hashes for {len(transfer.block_ids)} blocks "
                f"(request {transfer.request_id})"
            )
        if transfer.direction == "save":
            self.save(executor, transfer)
        elif transfer.direction == "load":
            self.load(executor, transfer)
        else:
            raise ValueError(f"direction: must be 'load' or 'save', got {transfer.direction!r}")

    def save(self, executor, transfer: KVTransfer) -> None:
        """Copy the transfer's blocks to the host, keyed by hash (blocks already held are skipped)."""
        new = [(b, h) for b, h in zip(transfer.block_ids, transfer.block_hashes) if h not in self.blocks]
        if not new:
            return
        data = executor.read_blocks([b for b, _ in new]).to(self.device)
        for i, (_, h) in enumerate(new):
            self.blocks[h] = data[:, :, i].clone()  # one block's own storage: dropping it frees its bytes
        self.saved_blocks += len(new)

    def load(self, executor, transfer: KVTransfer) -> None:
        """Copy the stored blocks named by the transfer's hashes into its block ids on ``executor``."""
        if not transfer.block_ids:
            return
        missing = [h for h in transfer.block_hashes if h not in self.blocks]
        if missing:
            raise KeyError(
                f"block_hashes: {len(missing)} stored blocks of request {transfer.request_id} have no host copy "
                f"(first {missing[0]:#x}; saved by a simulated member, or evicted while pinned?)"
            )
        first = self.blocks[transfer.block_hashes[0]]
        out = first.new_empty((first.shape[0], first.shape[1], len(transfer.block_ids), *first.shape[2:]))
        for i, h in enumerate(transfer.block_hashes):
            out[:, :, i] = self.blocks[h]
        executor.write_blocks(transfer.block_ids, out)
        self.loaded_blocks += len(transfer.block_ids)

    def retain(self, keep: Callable[[int], bool]) -> int:
        """Drop the blocks ``keep`` rejects (the store evicted them); returns how many were dropped."""
        gone = [h for h in self.blocks if not keep(h)]
        for h in gone:
            del self.blocks[h]
        return len(gone)
