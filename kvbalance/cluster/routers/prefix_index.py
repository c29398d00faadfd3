"""An approximate per-instance prefix index built from routing decisions (what the router sent where).

sgl-router's cache-aware policy and Dynamo's KV router without KV events both guess each worker's cache
from the requests routed to it. Here the guess is kept per KV block: the chained block hashes of each
routed prompt (``kvcache.prefix.prefix_block_hashes``, so a hash names its whole prefix), in LRU order with
a capacity in tokens (sgl-router's ``max_tree_size``) and, optionally, a time to live (Dynamo's
``router-ttl-secs`` without KV events: a block not routed for ``ttl_s`` is forgotten; the caller passes the
clock, e.g. the request's arrival time). A match walks the new prompt's hashes while they are present, so it
is the longest cached prefix, in whole blocks.
"""

from __future__ import annotations

from collections import OrderedDict

from kvbalance.kvcache.prefix import prefix_block_hashes
from kvbalance.request import Request


class ApproxPrefixIndex:
    """One instance's routed prefixes: block hash -> present, least recently routed first."""

    def __init__(self, block_size: int, max_tokens: int | None = None, ttl_s: float | None = None) -> None:
        if max_tokens is not None and max_tokens < block_size:
            raise ValueError(f"max_tree_size_tokens: must be >= one block ({block_size}), got {max_tokens}")
        self.block_size = block_size
        self.max_blocks = None if max_tokens is None else max_tokens // block_size
        self.ttl_s = ttl_s
        self._lru: OrderedDict[int, float] = OrderedDict()  # hash -> when it was last routed

    @property
    def size_tokens(self) -> int:
        return len(self._lru) * self.block_size

    def prompt_hashes(self, req: Request) -> list[int]:
        return prefix_block_hashes(req.prompt_token_ids, self.block_size)

    def _expire(self, now: float | None) -> None:
        if self.ttl_s is None or now is None:
            return
        lru = self._lru
        while lru and next(iter(lru.values())) < now - self.ttl_s:  # oldest first
            lru.popitem(last=False)

    def match_blocks(self, hashes: list[int], now: float | None = None) -> int:
        self._expire(now)
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: list[int], now: float | None = None) -> None:
        lru = self._lru
        t = 0.0 if now is None else now
        for h in reversed(hashes):  # parents end up more recent than children: leaves are evicted first
            lru[h] = t
            lru.move_to_end(h)
        if self.max_blocks is not None:
            while len(lru) > self.max_blocks:
                lru.popitem(last=False)
