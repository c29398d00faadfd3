"""Paged KV memory: the block pool, the radix prefix cache, the elastic reserve and the global store."""

from kvbalance.kvcache.blocks import BlockPool, OutOfBlocks
from kvbalance.kvcache.prefix import RadixCache, prefix_block_hashes, request_block_hashes

__all__ = ["BlockPool", "OutOfBlocks", "RadixCache", "prefix_block_hashes", "request_block_hashes"]
