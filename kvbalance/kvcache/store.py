"""GlobalKVStore: a shared host-memory tier of full prefix blocks, and the layer-wise fetch pipeline timing.

Any prefill instance saves full prefix blocks (named by their chained block hash, so a hash stands for its
whole prefix: the instances' ``kvcache.hashing.BlockHasher``, SHA-256 by default, so a client cannot make two
prompts share a stored block) into one store; any prefill instance finds the longest stored prefix of a new prompt and
fetches it instead of recomputing it (BanaServe's global KV cache store). The store has a capacity in
blocks, a link to the GPUs (bandwidth + latency), and evicts least recently used blocks with Mooncake
Store's watermarks: when a put takes it past ``high_watermark`` (95% full) it frees blocks down to
``high_watermark - eviction_ratio`` (5% of capacity). Blocks being read (pinned by a fetch in flight) are
never evicted; if only pinned blocks remain the put keeps what fits and drops the rest (counted).

``layerwise_pipeline_s`` is the timing of BanaServe's three-stage pipeline — fetch layer l+1 while computing
layer l while storing layer l-1 — as a flow shop: with per-layer times f, c, s it is
a recursion over layers, which for equal layers is (L - 1) max(f, c, s) + f + c + s; without overlap the stages
run back to back, L (f + c + s).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvbalance.specs import LinkSpec, get_link


@dataclass(frozen=True)
class StoreConfig:
    """Capacity and policy of the global KV store. Units in the names."""

    capacity_bytes: float = 512e9  # host DRAM given to the store (per cluster)
    link: str = "pcie4"  # GPU <-> host link a fetch or save crosses
    high_watermark: float = 0.95  # Mooncake Store: start evicting at 95% full ...
    eviction_ratio: float = 0.05  # ... and free 5% of the capacity
    layerwise_overlap: bool = True  # fetch / compute / store pipelined layer by layer

    def __post_init__(self) -> None:
        if not self.capacity_bytes > 0:
            raise ValueError(f"capacity_bytes: must be > 0, got {self.capacity_bytes}")
        if not 0 < self.high_watermark <= 1:
            raise ValueError(f"high_watermark: must be in (0, 1], got {self.high_watermark}")
        if not 0 < self.eviction_ratio <= self.high_watermark:
            raise ValueError(f"eviction_ratio: must be in (0, high_watermark], got {self.eviction_ratio}")
        get_link(self.link)


def layerwise_pipeline_s(
    compute_s: Sequence[float],
    fetch_s: Sequence[float],
    store_s: Sequence[float] | None = None,
    overlap: bool = True,
) -> float:
    """Time of L layers through fetch -> compute -> store (per-layer times, seconds).

    With ``overlap``: a three-stage flow shop — layer l's compute starts when its fetch is done and layer
    l-1's compute is done; its store when its compute and layer l-1's store are done. For equal layers that is
    (L - 1) x max(f, c, s) + (f + c + s): about max(compute, fetch) per layer plus one layer's fill and drain.
    Without: the sum of everything.
    """
    L = len(compute_s)
    if len(fetch_s) != L or (store_s is not None and len(store_s) != L):
        raise ValueError("fetch_s / store_s: need one time per layer, as many as compute_s")
    store = list(store_s) if store_s is not None else [0.0] * L
    if any(t < 0 for t in (*compute_s, *fetch_s, *store)):
        raise ValueError("compute_s / fetch_s / store_s: times must be >= 0")
    if not overlap:
        return float(sum(compute_s) + sum(fetch_s) + sum(store))
    f_done = c_done = s_done = 0.0
    for f, c, s in zip(fetch_s, compute_s, store):
        f_done += f
        c_done = max(c_done, f_done) + c
        s_done = max(s_done, c_done) + s
    return s_done


class GlobalKVStore:
    """Block hash -> stored, in LRU order, with pin counts for blocks being read."""

    def __init__(self, config: StoreConfig, bytes_per_block: int) -> None:
        if bytes_per_block < 1:
            raise ValueError(f"bytes_per_block: must be >= 1, got {bytes_per_block}")
        self.config = config
        self.bytes_per_block = bytes_per_block
        self.capacity_blocks = int(config.capacity_bytes // bytes_per_block)
        if self.capacity_blocks < 1:
            raise ValueError(
                f"capacity_bytes: {config.capacity_bytes} holds no block of {bytes_per_block} bytes"
            )
        self.link: LinkSpec = get_link(config.link)
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> pin count, least recent first
        self.num_evicted = 0
        self.num_dropped = 0  # puts that found only pinned blocks to evict
        self.num_saved = 0
        self.hit_blocks = 0
        self.lookup_blocks = 0

    # -- sizes -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    @property
    def high_blocks(self) -> int:
        return int(round(self.config.high_watermark * self.capacity_blocks, 9))

    @property
    def low_blocks(self) -> int:
        return int(round((self.config.high_watermark - self.config.eviction_ratio) * self.capacity_blocks, 9))

    def pinned(self, block_hash: int) -> int:
        return self._lru.get(block_hash, 0)

    # -- lookup and reads ----------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> int:
        """Length in blocks of the longest stored prefix of ``hashes`` (touched as recently used)."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        for h in reversed(hashes[:n]):
            self._lru.move_to_end(h)
        self.lookup_blocks += len(hashes)
        self.hit_blocks += n
        return n

    def pin(self, hashes: Sequence[int]) -> None:
        """A fetch of these blocks starts: they may not be evicted until ``unpin``."""
        for h in hashes:
            if h not in self._lru:
                raise KeyError(f"block {h:#x} is not in the store")
        for h in hashes:
            self._lru[h] += 1

    def unpin(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            if self._lru.get(h, 0) <= 0:
                raise RuntimeError(f"block {h:#x}: unpin without a pin")
            self._lru[h] -= 1

    def fetch_s(self, num_blocks: int) -> float:
        """Time to read ``num_blocks`` over the store's link (latency + bytes / bandwidth; 0 for none)."""
        if num_blocks <= 0:
            return 0.0
        return self.link.latency_s + num_blocks * self.bytes_per_block / self.link.bandwidth_bytes_s

    # -- writes ------------------------------------------------------------------
    def put(self, hashes: Sequence[int]) -> int:
        """Save a prefix's blocks (children first, so parents stay more recent); returns blocks added."""
        lru = self._lru
        added = 0
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
                continue
            if len(lru) >= self.capacity_blocks and not self._evict_to(self.capacity_blocks - 1):
                self.num_dropped += 1
                continue
            lru[h] = 0
            added += 1
        self.num_saved += added
        if len(lru) > self.high_blocks:
            self._evict_to(self.low_blocks)
        return added

    def _evict_to(self, target: int) -> bool:
        """Evict unpinned blocks, least recent first, until at most ``target`` remain; False if it cannot."""
        lru = self._lru
        if len(lru) <= target:
            return True
        victims = []
        for h, pins in lru.items():
            if len(lru) - len(victims) <= target:
                break
            if pins == 0:
                victims.append(h)
        for h in victims:
            del lru[h]
        self.num_evicted += len(victims)
        return len(lru) <= target

    def check_invariants(self) -> None:
        if len(self._lru) > self.capacity_blocks:
            raise AssertionError(f"store holds {len(self._lru)} blocks, capacity {self.capacity_blocks}")
        if any(p < 0 for p in self._lru.values()):
            raise AssertionError("store: negative pin count")
