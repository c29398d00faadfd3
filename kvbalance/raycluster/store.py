"""The global KV store as a Ray actor: block tensors by chained block hash, the simulated store's policy.

``KVStoreActor`` is ``kvcache.store.GlobalKVStore`` (capacity, LRU, high/low watermarks, pins) with the
bytes beside it: one numpy array per stored block (``[layers, 2, block_size, kv_heads, head_dim]``, in the
instances' KV dtype bits). Instances ask it over Ray:

- ``match_pin(owner, rid, hashes)``: the longest stored prefix of ``hashes``, pinned for ``(owner, rid)``
  (the simulated store pins what a fetch reads, so a put cannot evict it mid-read); a second call for the
  same request first drops the first one's pins (the request was not admitted last step);
- ``fetch(owner, rid, first, count)``: blocks ``[first, first + count)`` of that pinned prefix, as one array
  ``[layers, 2, count, block_size, kv_heads, head_dim]`` returned through the object store; the pins go;
- ``unpin(owner, rid)`` / ``release_owner(owner)``: a request aborted before its fetch, an instance that
  died: its pins go (nothing else is held for it here);
- ``absent(hashes)`` then ``put(hashes, blocks)``: save a prompt's full blocks the store does not hold yet
  (``GlobalKVStore.put`` decides what stays; evicted blocks' bytes are dropped at once).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbalance.kvcache.store import GlobalKVStore, StoreConfig


class KVStoreActor:
    def __init__(self, config: StoreConfig, bytes_per_block: int) -> None:
        self.store = GlobalKVStore(config, bytes_per_block)
        self.blocks: dict[int, np.ndarray] = {}
        self.pins: dict[tuple[str, str], list[int]] = {}  # (owner, request id) -> pinned hashes
        self.fetched_blocks = 0
        self.saved_blocks = 0

    # -- reads ---------------------------------------------------------------------------
    def match_pin(self, owner: str, rid: str, hashes: Sequence[int]) -> int:
        self.unpin(owner, rid)
        n = self.store.match(list(hashes))
        if n:
            pinned = list(hashes[:n])
            self.store.pin(pinned)
            self.pins[(owner, rid)] = pinned
        return n

    def fetch(self, owner: str, rid: str, first: int, count: int) -> np.ndarray:
        pinned = self.pins.get((owner, rid))
        if pinned is None or first + count > len(pinned):
            raise KeyError(
                f"fetch: request {rid} of {owner} has {len(pinned or [])} blocks pinned, asked {first}+{count}"
            )
        hashes = pinned[first : first + count]
        out = np.stack([self.blocks[h] for h in hashes], axis=2)
        self.unpin(owner, rid)
        self.fetched_blocks += count
        return out

    def unpin(self, owner: str, rid: str) -> None:
        pinned = self.pins.pop((owner, rid), None)
        if pinned:
            self.store.unpin(pinned)

    def release_owner(self, owner: str) -> int:
        """Drop every pin an instance holds (it died); returns how many requests had pins."""
        mine = [key for key in self.pins if key[0] == owner]
        for key in mine:
            self.unpin(*key)
        return len(mine)

    # -- writes --------------------------------------------------------------------------
    def absent(self, hashes: Sequence[int]) -> list[int]:
        return [h for h in hashes if h not in self.store]

    def put(self, hashes: Sequence[int], blocks: np.ndarray) -> int:
        """Save blocks (``[layers, 2, n, ...]``, one per hash, prefix order); returns blocks added."""
        hashes = list(hashes)
        if blocks.shape[2] != len(hashes):
            raise ValueError(f"blocks: {blocks.shape[2]} blocks for {len(hashes)} hashes")
        evicted_before = self.store.num_evicted
        added = self.store.put(hashes)
        for i, h in enumerate(hashes):
            if h in self.store and h not in self.blocks:
                self.blocks[h] = np.array(blocks[:, :, i])  # its own copy: the shared view goes away
        if self.store.num_evicted != evicted_before or len(self.blocks) != len(self.store):
            self.blocks = {h: b for h, b in self.blocks.items() if h in self.store}
        self.saved_blocks += added
        return added

    # -- reports -------------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.store
        return {
            "blocks": len(s),
            "capacity_blocks": s.capacity_blocks,
            "pinned_requests": len(self.pins),
            "pinned_blocks": sum(s.pinned(h) for h in self.blocks),
            "fetched_blocks": self.fetched_blocks,
            "saved_blocks": self.saved_blocks,
            "evicted_blocks": s.num_evicted,
            "hit_blocks": s.hit_blocks,
            "lookup_blocks": s.lookup_blocks,
        }

    def check(self) -> None:
        """Invariants: the bytes held are exactly the stored blocks; pin counts match the pins recorded."""
        self.store.check_invariants()
        if set(self.blocks) != set(self.store._lru):
            raise AssertionError("store: held bytes differ from the stored blocks")
        counts: dict[int, int] = {}
        for pinned in self.pins.values():
            for h in pinned:
                counts[h] = counts.get(h, 0) + 1
        for h in self.store._lru:
            if self.store.pinned(h) != counts.get(h, 0):
                raise AssertionError(
                    f"store: block {h:#x} pinned {self.store.pinned(h)}, recorded {counts.get(h, 0)}"
                )
