"""An approximate per-instance prefix index built from routing decisions (what the router sent where).

sgl-router's cache-aware policy and Dynamo's KV router without KV events both guess each worker's cache
from the requests routed to it. Here the guess is kept per KV block: the chained block hashes of each
routed prompt (``kvcache.prefix.prefix_block_hashes``, so a hash names its whole prefix), in LRU order with
a capacity in tokens (sgl-router's ``max_tree_size``). A match walks the new prompt's hashes while they are
present, so it is the longest cached prefix, in whole blocks.
"""

from __future__ import annotations

from collections import OrderedDict

from kvbalance.kvcache.prefix import prefix_block_hashes
from kvbalance.request import Request


class ApproxPrefixIndex:
    """One instance's routed prefixes: block hash -> present, least recently routed first."""

    def __init__(self, block_size: int, max_tokens: int | None = None) -> None:
        if max_tokens is not None and max_tokens < block_size:
            raise ValueError(f"max_tree_size_tokens: must be >= one block ({block_size}), got {max_tokens}")
        self.block_size = block_size
        self.max_blocks = None if max_tokens is None else max_tokens // block_size
        self._lru: OrderedDict[int, None] = OrderedDict()

    @property
    def size_tokens(self) -> int:
        return len(self._lru) * self.block_size

    def prompt_hashes(self, req: Request) -> list[int]:
        return prefix_block_hashes(req.prompt_token_ids, self.block_size)

    def match_blocks(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        lru = self._lru
        for h in reversed(hashes):  # parents end up more recent than children: leaves are evicted first
            lru[h] = None
            lru.move_to_end(h)
        if self.max_blocks is not None:
            while len(lru) > self.max_blocks:
                lru.popitem(last=False)
