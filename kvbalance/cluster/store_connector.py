"""The global KV store through the KV connector: prefill instances save full prefix blocks and fetch them.

At admission the connector's scheduler half offers the store's longest stored prefix past the instance's
local prefix hit as asynchronous external tokens: the request is admitted holding blocks for them, waits in
WAITING_FOR_KV while they are read (pinned in the store: never evicted while read), and then computes the
rest of its prompt. Fetch timing is BanaServe's layer-wise pipeline (``kvcache.store.layerwise_pipeline_s``):
layer l+1 is fetched while layer l of the rest of the prompt computes, so the request waits only for what the
pipeline adds over plain compute — about one layer's fetch when compute dominates — instead of the whole
fetch (``layerwise_overlap=False``). Fetches into one instance share its host link, one after another.
Saves: a prompt that finished computing on a prefill or colocated instance is put into the store (the
pipeline's store stage, off the critical path).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbalance.batch import BatchPlan, ScheduledSeq
from kvbalance.cluster.connector import prompt_hashes, report_transfers
from kvbalance.kvcache.store import GlobalKVStore, layerwise_pipeline_s
from kvbalance.perf.cost import breakdown_total_s
from kvbalance.request import Request


@dataclass
class Fetch:
    req: Request
    member: object
    hashes: list[int]  # the blocks read from the store
    stored_tokens: int  # prompt tokens whose KV is there once it lands (local hit + fetched)
    start_s: float = 0.0
    done_s: float = 0.0
    pipeline_extra_s: float = 0.0  # what the fetch adds over computing the rest of the prompt


class StoreConnector:
    def __init__(self, cluster, store: GlobalKVStore) -> None:
        self.cluster = cluster
        self.store = store
        self._ingress_free_s: dict[int, float] = {}
        self._offer: dict[
            str, tuple[list[int], int]
        ] = {}  # rid -> (prompt hashes, stored blocks) last offered
        self._in_flight: dict[str, Fetch] = {}
        self.fetches: list[Fetch] = []
        self.fetched_blocks = 0
        self.saved_blocks = 0

    # -- connector calls ----------------------------------------------------------------
    def matched(self, m, req: Request, num_computed_tokens: int) -> tuple[int, bool]:
        bs = m.instance.pool.block_size
        hashes = prompt_hashes(req, bs, req.num_prompt_tokens - 1)  # the last token is always computed
        stored = self.store.match(hashes) if hashes else 0
        external = stored * bs - num_computed_tokens
        if external <= 0:
            return 0, False
        self._offer[req.request_id] = (hashes, stored)
        return external, True

    def start_fetch(self, m, req: Request, num_tokens: int) -> None:
        hashes, stored = self._offer.pop(req.request_id)
        bs = m.instance.pool.block_size
        first = stored - num_tokens // bs
        f = Fetch(req, m, hashes[first:stored], stored * bs)
        self.store.pin(f.hashes)
        n = len(f.hashes)
        now = self.cluster.loop.now
        f.pipeline_extra_s = self.fetch_extra_s(m, req, f.stored_tokens, n)
        f.start_s = max(now, self._ingress_free_s.get(m.index, 0.0))
        f.done_s = f.start_s + f.pipeline_extra_s
        self._ingress_free_s[m.index] = f.start_s + self.store.fetch_s(
            n
        )  # the link is busy for the whole read
        self._in_flight[req.request_id] = f
        self.fetches.append(f)
        self.fetched_blocks += n
        self.cluster.loop.at(f.done_s, self._land, f)

    def fetch_extra_s(self, m, req: Request, stored_tokens: int, num_blocks: int) -> float:
        """Time the fetch adds before the rest of the prompt is computed (layer-wise, or all of it)."""
        fetch = self.store.fetch_s(num_blocks)
        cost = m.instance.executor.cost_model
        rest = max(1, min(req.num_prompt_tokens - stored_tokens, m.instance.config.max_num_batched_tokens))
        plan = BatchPlan(
            [ScheduledSeq(req, stored_tokens, rest, False)], block_size=m.instance.pool.block_size
        )
        compute = breakdown_total_s(cost.predict(plan))
        L = cost.model.num_layers
        total = layerwise_pipeline_s(
            [compute / L] * L, [fetch / L] * L, overlap=self.store.config.layerwise_overlap
        )
        return total - compute

    def _land(self, f: Fetch) -> None:
        del self._in_flight[f.req.request_id]
        self.store.unpin(f.hashes)
        report_transfers(f.member.instance, [f.req.request_id], [])
        self.cluster.wake(f.member)

    # -- saves ----------------------------------------------------------------------------
    def on_step(self, m, outcome) -> None:
        """Save the prompts that finished computing in this step."""
        bs = m.instance.pool.block_size
        for s in outcome.plan.seqs:
            if s.is_prefill and s.context_len >= s.request.num_prompt_tokens:
                self.saved_blocks += self.store.put(prompt_hashes(s.request, bs, s.request.num_prompt_tokens))

    def check_drained(self) -> None:
        if self._in_flight:
            raise RuntimeError(f"store: fetches left in flight at the end: {list(self._in_flight)[:5]}")
