"""``kv_aware``: NVIDIA Dynamo's KV router cost, lowest wins.

Dynamo's router (docs "Router Design" / "Routing Concepts") projects two loads per worker and adds them:

    prefill_blocks = active prefill blocks on the worker + the request's prompt blocks the worker does not cache
    decode_blocks  = active blocks on the worker + the request's blocks not already there
    cost           = overlap_score_weight x prefill_blocks + decode_blocks

Here, from an ``InstanceLoad``: active prefill = ``queued_prefill_tokens`` (prompt tokens routed there and not
yet computed, waiting or mid-prefill; Dynamo counts them until the first token), active blocks =
``kv_used_tokens + queued_prefill_tokens`` (KV held plus the KV the queued prompts will hold: Dynamo counts a
request's blocks from the moment it is routed), both in blocks. The overlap (cached prompt blocks) comes from
an approximate index of what was routed to each instance (Dynamo's mode without KV events), LRU-bounded by
the instance's KV capacity (what its cache can hold; ``max_index_tokens`` overrides) and, as Dynamo's
``router-ttl-secs`` (120 s), forgetting blocks not routed for ``ttl_s`` (the request's arrival time is the
clock). Weight 1 is Dynamo's default; temperature 0 (deterministic argmin, lowest index on ties) is used,
not its softmax sampling.

An earlier version priced only the request's own uncached blocks plus the KV in use: requests queued on an
instance counted for nothing, so a burst on a cached prefix all went to one instance (hot-spot ratio 1.95
on uniform document popularity, the lowest max rate of all routers). The active-prefill term is what keeps
Dynamo balanced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvbalance.cluster.routers.base import ROUTERS, Router, argmin, load_keys
from kvbalance.cluster.routers.prefix_index import ApproxPrefixIndex
from kvbalance.engine import InstanceLoad
from kvbalance.request import Request

DYNAMO_TTL_S = 120.0  # --router-ttl-secs: block TTL when KV events are off


@ROUTERS.register("kv_aware")
class KVAwareRouter(Router):
    def __init__(
        self, block_size: int = 16, overlap_score_weight: float = 1.0, max_index_tokens: int | None = None,
        ttl_s: float | None = DYNAMO_TTL_S,
    ) -> None:  # fmt: skip
        super().__init__(block_size)
        if overlap_score_weight < 0:
            raise ValueError(f"overlap_score_weight: must be >= 0, got {overlap_score_weight}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s: must be > 0 (or None: no expiry), got {ttl_s}")
        self.overlap_score_weight = overlap_score_weight
        self.max_index_tokens = max_index_tokens
        self.ttl_s = ttl_s
        self.indexes: dict[object, ApproxPrefixIndex] = {}

    def _index(self, key: object, load: InstanceLoad) -> ApproxPrefixIndex:
        if key not in self.indexes:
            cap = self.max_index_tokens or max(load.kv_capacity_tokens, self.block_size)
            self.indexes[key] = ApproxPrefixIndex(self.block_size, cap, self.ttl_s)
        return self.indexes[key]

    def costs(self, req: Request, loads: Sequence[InstanceLoad]) -> list[float]:
        bs = self.block_size
        idx = [self._index(k, ld) for k, ld in zip(load_keys(loads), loads)]
        hashes = idx[0].prompt_hashes(req)
        request_blocks = math.ceil(req.num_prompt_tokens / bs)
        out = []
        for ix, ld in zip(idx, loads):
            new_blocks = request_blocks - ix.match_blocks(hashes, req.arrival_s)
            prefill_blocks = ld.queued_prefill_tokens / bs + new_blocks
            decode_blocks = (ld.kv_used_tokens + ld.queued_prefill_tokens) / bs + new_blocks
            out.append(self.overlap_score_weight * prefill_blocks + decode_blocks)
        return out

    def choose(self, req: Request, loads: Sequence[InstanceLoad]) -> int:
        choice = argmin(self.costs(req, loads))
        ix = self._index(load_keys(loads)[choice], loads[choice])
        ix.insert(ix.prompt_hashes(req), req.arrival_s)
        return choice
