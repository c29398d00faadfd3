"""The global KV store's connector: prefill instances save full prefix blocks to it and fetch from it.

On routing, the scheduler-half question "how many of this prompt's tokens can come from outside" is
answered here: the store's longest stored prefix beyond what the chosen instance caches locally. Those
blocks are pinned in the store (never evicted while read), room is reserved on the instance (and its local
prefix locked), and the request reaches the instance's queue when the fetch lands; the landed blocks are
cached there, so admission finds them as a prefix hit and computes only the rest of the prompt.

Fetch timing is BanaServe's layer-wise pipeline (``kvcache.store.layerwise_pipeline_s``): layer l+1 is
fetched while layer l of the rest of the prompt computes, so the request waits only for what the pipeline
adds over plain compute — about one layer's fetch when compute dominates — instead of the whole fetch
(``layerwise_overlap=False``). Fetches into one instance share its host link, one after another. Saves
happen when a request finishes its prompt on a prefill or colocated instance (the pipeline's store stage,
off the critical path). TODO(connector): move onto ``kvcache/connector.py``'s scheduler half when it lands.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbalance.batch import BatchPlan, ScheduledSeq
from kvbalance.cluster.holds import BlockHold
from kvbalance.kvcache.prefix import request_block_hashes
from kvbalance.kvcache.store import GlobalKVStore, layerwise_pipeline_s
from kvbalance.perf.cost import breakdown_total_s
from kvbalance.request import Request


@dataclass
class Fetch:
    req: Request
    member: object
    hashes: list[int]  # the stored prefix, from block 0
    local_blocks: int  # of those, already cached on the instance (held while the fetch runs)
    hold: BlockHold = field(default_factory=BlockHold)
    blocks: list[int] = field(default_factory=list)  # reserved for the fetched blocks
    start_s: float = 0.0
    done_s: float = 0.0
    pipeline_extra_s: float = 0.0  # what the fetch adds over computing the rest of the prompt


class StoreConnector:
    def __init__(self, cluster, store: GlobalKVStore) -> None:
        self.cluster = cluster
        self.store = store
        self._ingress_free_s: dict[int, float] = {}
        self._in_flight: dict[int, list[Fetch]] = {}
        self.fetches: list[Fetch] = []
        self.fetched_blocks = 0
        self.saved_blocks = 0

    # -- fetch ----------------------------------------------------------------------
    def admit(self, m, req: Request) -> None:
        """Route ``req`` into member ``m``, first fetching its stored prefix when that beats the local cache."""
        inst = m.instance
        bs = inst.pool.block_size
        hashes = request_block_hashes(req, bs, ((req.num_prompt_tokens - 1) // bs) * bs)
        local = 0
        node = None
        if inst.cache is not None and hashes:
            node, local = inst.cache.match_prefix(hashes)
        stored = self.store.match(hashes) if hashes else 0
        n = stored - local
        avail = inst.pool.num_free + (inst.cache.evictable_blocks if inst.cache is not None else 0)
        if n <= 0 or inst.cache is None or n + int(inst.config.watermark * inst.pool.num_blocks) > avail:
            m.driver.arrive(req)
            return
        f = Fetch(req, m, hashes[:stored], local)
        if local:
            inst.cache.lock(node)
            f.hold = BlockHold(node, inst.cache.blocks_of(node))
            inst.pool.incref(f.hold.blocks)
        short = n - inst.pool.num_free
        if short > 0:
            inst.cache.evict(short)
        f.blocks = inst.pool.allocate(n)
        self.store.pin(f.hashes[local:])
        self._start(f)

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

    def _start(self, f: Fetch) -> None:
        now = self.cluster.loop.now
        m = f.member
        n = len(f.hashes) - f.local_blocks
        f.pipeline_extra_s = self.fetch_extra_s(m, f.req, len(f.hashes) * m.instance.pool.block_size, n)
        f.start_s = max(now, self._ingress_free_s.get(m.index, 0.0))
        f.done_s = f.start_s + f.pipeline_extra_s
        self._ingress_free_s[m.index] = f.start_s + self.store.fetch_s(
            n
        )  # the link is busy for the whole read
        self._in_flight.setdefault(m.index, []).append(f)
        self.fetches.append(f)
        self.fetched_blocks += n
        self.cluster.loop.at(f.done_s, self._land, f)

    def _land(self, f: Fetch) -> None:
        m = f.member
        inst = m.instance
        self._in_flight[m.index].remove(f)
        self.store.unpin(f.hashes[f.local_blocks :])
        cache = inst.cache
        start = f.hold.node if f.hold.node is not None else cache.root
        ids = [-1] * f.local_blocks + f.blocks
        node, cached = cache.extend(start, f.local_blocks, f.hashes, ids)
        for own, b in zip(f.blocks, cached):
            if own != b:  # cached meanwhile by another request: share it
                inst.pool.incref((b,))
                inst.pool.free((own,))
        cache.unlock(node)  # one unlock for the whole path: the local lock and what extend added below it
        inst.pool.free(cached)
        if f.hold.blocks:
            inst.pool.free(f.hold.blocks)
        f.hold, f.blocks = BlockHold(), []
        m.driver.arrive(f.req)

    # -- save -----------------------------------------------------------------------
    def on_step(self, m, outcome) -> None:
        """Save the prompts that finished computing in this step."""
        for s in outcome.plan.seqs:
            if s.is_prefill and s.context_len >= s.request.num_prompt_tokens:
                self.save(m, s.request)

    def save(self, m, req: Request) -> None:
        """``req`` finished its prompt on ``m``: its full prompt blocks go to the store."""
        bs = m.instance.pool.block_size
        hashes = request_block_hashes(req, bs, (req.num_prompt_tokens // bs) * bs)
        self.saved_blocks += self.store.put(hashes)

    # -- accounting -------------------------------------------------------------------
    def incoming(self, m) -> tuple[int, int, int]:
        """(requests, prompt tokens, output tokens) of the fetches landing on member ``m``."""
        fs = self._in_flight.get(m.index, ())
        prompt = sum(f.req.num_prompt_tokens - len(f.hashes) * m.instance.pool.block_size for f in fs)
        return len(fs), prompt, sum(f.req.max_tokens for f in fs)

    def holds_on(self, m) -> tuple[list[BlockHold], list[int]]:
        fs = self._in_flight.get(m.index, ())
        return [f.hold for f in fs], [b for f in fs for b in f.blocks]
