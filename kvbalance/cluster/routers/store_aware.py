"""``store_aware``: this project's router for instances behind a global KV store: least work, locality as a tiebreak
that is worth what a fetch costs.

BanaServe's ``load_aware`` router ignores where a prefix is cached because any instance can fetch it from the
store. But a fetch is not free: a 1,536-token document of a 13B model is 1.3 GB over the instance's host link
(about 50 ms on PCIe 4, one fetch at a time per link), and with short questions the layer-wise pipeline cannot
hide it under the question's compute. Measured on uniform document popularity (``docqa-uniform``, llama-13b, 8 x
A100): ``load_aware`` with the store reached 77 req/s at SLO, sgl-router's ``cache_aware`` without it 88.
Cache-aware routing, in turn, piles hot documents onto one instance (Zipf popularity: 50 req/s against 92 for
``load_aware`` with the store).

So the cost of instance i, in prefill-token equivalents, is the work already there plus this request's work
there:

    cost_i = outstanding_i + compute_i + fetch_cost x fetched_i
    compute_i = prompt - max(local_i, stored)        (tokens it would compute)
    fetched_i = max(0, stored - local_i)             (tokens it would read from the store)

``outstanding_i`` is ``InstanceLoad.outstanding_tokens`` (prefill left plus output left, ``load_aware``'s
measure), ``local_i`` the prefix instance i is believed to cache (an index of what was routed there, LRU-bounded
by its KV capacity, as ``kv_aware``), ``stored`` the longest prefix routed anywhere (every computed prompt is
saved to the store). ``fetch_cost`` is what a prefix routed away from its cache costs per token, in
prefill-token equivalents. The fetch alone is cheap: for a 13B model on A100, 0.82 MB of KV per token at
~25 GB/s is 33 us against ~0.13 ms of prefill, 0.25. But the copy also lands in the new instance's cache and
evicts prefixes there that later requests then fetch or recompute, and the instance's link serves one fetch
at a time. Measured (llama-13b, 8 x A100, SLO attainment at ~vLLM's max rate; ``docqa-uniform`` at 97 req/s,
``docqa-zipf`` at 100): fetch_cost 0.25 -> 0.81 / 0.96, 0.5 -> 0.89 / 0.97, 1 -> 0.92 / 0.97, 2 -> 0.92 /
0.98, 4 -> 0.94 / 0.86 (vLLM's best router: 0.93 / 0.07); 2 is the default. Locality then wins unless another
instance has about twice the prefix's length less work; a hot prefix still spreads, and every instance that
fetched it caches it too. Ties go to the instance busy least so far, then the lowest index. Without a store
the same cost holds (a miss is recomputed, which costs at least as much).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbalance.cluster.routers.base import ROUTERS, Router, load_keys
from kvbalance.cluster.routers.prefix_index import ApproxPrefixIndex
from kvbalance.engine import InstanceLoad
from kvbalance.request import Request


@ROUTERS.register("store_aware")
class StoreAwareRouter(Router):
    def __init__(
        self, block_size: int = 16, fetch_cost: float = 2.0, max_index_tokens: int | None = None
    ) -> None:
        super().__init__(block_size)
        if not 0 <= fetch_cost < float("inf"):
            raise ValueError(
                f"fetch_cost: must be a finite number >= 0 (prefill-token equivalents), got {fetch_cost}"
            )
        self.fetch_cost = fetch_cost
        self.max_index_tokens = max_index_tokens
        self.indexes: dict[object, ApproxPrefixIndex] = {}
        self.last_costs: list[float] = []  # of the latest choice, for tests and reports

    def _index(self, key: object, load: InstanceLoad) -> ApproxPrefixIndex:
        if key not in self.indexes:
            cap = self.max_index_tokens or max(load.kv_capacity_tokens, self.block_size)
            self.indexes[key] = ApproxPrefixIndex(self.block_size, cap)
        return self.indexes[key]

    def costs(self, req: Request, loads: Sequence[InstanceLoad]) -> list[float]:
        bs = self.block_size
        idx = [self._index(k, ld) for k, ld in zip(load_keys(loads), loads)]
        hashes = idx[0].prompt_hashes(req)
        local = [ix.match_blocks(hashes) * bs for ix in idx]
        stored = max(local, default=0)
        prompt = req.num_prompt_tokens
        return [
            ld.outstanding_tokens + (prompt - stored) + self.fetch_cost * (stored - loc)
            for ld, loc in zip(loads, local)
        ]

    def choose(self, req: Request, loads: Sequence[InstanceLoad]) -> int:
        self.last_costs = c = self.costs(req, loads)
        choice = min(range(len(loads)), key=lambda i: (c[i], loads[i].busy_s, i))
        ix = self._index(load_keys(loads)[choice], loads[choice])
        ix.insert(ix.prompt_hashes(req))
        return choice
