"""``kv_aware``: NVIDIA Dynamo's KV router cost, lowest wins.

cost_i = overlap_score_weight x (prefill blocks instance i would still compute for this request)
         + (decode blocks instance i holds)
Prefill blocks = the prompt's blocks minus those instance i is believed to cache (Dynamo's overlap from its
KV indexer; here the approximate index of what was routed there, Dynamo's mode without KV events); decode
blocks = KV in use on the instance (``InstanceLoad.kv_used_tokens``) in blocks. Weight 1 is Dynamo's default;
temperature 0 (deterministic argmin, lowest index on ties) is used, not its softmax sampling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvbalance.cluster.routers.base import ROUTERS, Router, argmin
from kvbalance.cluster.routers.prefix_index import ApproxPrefixIndex
from kvbalance.engine import InstanceLoad
from kvbalance.request import Request


@ROUTERS.register("kv_aware")
class KVAwareRouter(Router):
    def __init__(
        self, block_size: int = 16, overlap_score_weight: float = 1.0, max_index_tokens: int | None = None
    ) -> None:
        super().__init__(block_size)
        if overlap_score_weight < 0:
            raise ValueError(f"overlap_score_weight: must be >= 0, got {overlap_score_weight}")
        self.overlap_score_weight = overlap_score_weight
        self.max_index_tokens = max_index_tokens
        self.indexes: list[ApproxPrefixIndex] = []

    def _index(self, i: int) -> ApproxPrefixIndex:
        while len(self.indexes) <= i:
            self.indexes.append(ApproxPrefixIndex(self.block_size, self.max_index_tokens))
        return self.indexes[i]

    def costs(self, req: Request, loads: Sequence[InstanceLoad]) -> list[float]:
        idx = [self._index(i) for i in range(len(loads))]
        hashes = idx[0].prompt_hashes(req)
        request_blocks = math.ceil(req.num_prompt_tokens / self.block_size)
        out = []
        for ix, ld in zip(idx, loads):
            prefill_blocks = request_blocks - ix.match_blocks(hashes)
            decode_blocks = ld.kv_used_tokens / self.block_size
            out.append(self.overlap_score_weight * prefill_blocks + decode_blocks)
        return out

    def choose(self, req: Request, loads: Sequence[InstanceLoad]) -> int:
        choice = argmin(self.costs(req, loads))
        self._index(choice).insert(self._index(choice).prompt_hashes(req))
        return choice
