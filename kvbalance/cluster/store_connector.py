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

On real executors (``TorchExecutor``: ``read_blocks`` / ``write_blocks``) the bytes move too, as
``KVTransfer`` records (``peer="store"``, with the blocks' hashes) run by the worker half,
``executor/store_worker.StoreWorker``, which keeps the store's host-side copy: a save copies the prompt's
stored blocks (block ids taken when the step was planned: a request that finishes in the step has let go of
its table by the time the step ends) out of the instance's paged KV when the step ends; a fetch copies whole
blocks into the request's allocated blocks when it lands, before the request's next step. The real path
does not pipeline layer by layer (its fetch time is the whole read, ``GlobalKVStore.fetch_s``): what it
checks is that a fetched prefix gives the same tokens as computing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbalance.batch import BatchPlan, KVTransfer, ScheduledSeq
from kvbalance.cluster.connector import prompt_hashes, report_transfers
from kvbalance.executor.store_worker import STORE_PEER, StoreWorker
from kvbalance.kvcache.store import GlobalKVStore, layerwise_pipeline_s
from kvbalance.perf.cost import breakdown_total_s
from kvbalance.request import Request, RequestState


def moves_real_kv(executor) -> bool:
    """An executor whose KV blocks are real tensors (the worker half copies them)."""
    return hasattr(executor, "read_blocks") and hasattr(executor, "write_blocks")


@dataclass
class Fetch:
    req: Request
    member: object
    hashes: list[int]  # the blocks read from the store
    stored_tokens: int  # prompt tokens whose KV is there once it lands (local hit + fetched)
    start_s: float = 0.0
    done_s: float = 0.0
    pipeline_extra_s: float = 0.0  # what the fetch adds over computing the rest of the prompt
    transfer: KVTransfer | None = None  # the load: store blocks (by hash) -> the request's block ids


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
        self.fetched_tokens = 0  # prompt tokens whose KV came from the store (a request's external tokens)
        self.saved_blocks = 0
        self.worker = StoreWorker()  # the host-side copy, for members on real tensors
        self._tables: dict[int, dict[str, list[int]]] = {}  # member -> rid -> block table when planned
        self._evicted_seen = store.num_evicted
        for m in cluster.members:
            ex = m.instance.executor
            if m.role != "decode" and moves_real_kv(ex) and ex.kv_bytes_per_block != store.bytes_per_block:
                raise ValueError(
                    f"bytes_per_block: the store's blocks are {store.bytes_per_block} bytes, {m.name}'s KV "
                    f"blocks {ex.kv_bytes_per_block}"
                )

    # -- connector calls ----------------------------------------------------------------
    def matched(self, m, req: Request, num_computed_tokens: int) -> tuple[int, bool]:
        bs = m.instance.pool.block_size
        hashes = prompt_hashes(req, bs, req.num_prompt_tokens - 1, m.instance.kv.hasher)  # last: computed
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
        f.transfer = KVTransfer(
            req.request_id, req.block_ids[first:stored], num_tokens, "load", STORE_PEER, list(f.hashes)
        )
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
        self.fetched_tokens += num_tokens
        self.cluster.loop.at(f.done_s, self._land, f)

    def fetch_extra_s(self, m, req: Request, stored_tokens: int, num_blocks: int) -> float:
        """Time the fetch adds before the rest of the prompt is computed (layer-wise, or all of it)."""
        fetch = self.store.fetch_s(num_blocks)
        cost = getattr(m.instance.executor, "cost_model", None)
        if cost is None:  # a real executor: whole blocks land before the request's next step
            return fetch
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
        ex = f.member.instance.executor
        if f.req.state is RequestState.WAITING_FOR_KV and moves_real_kv(ex):
            self.worker(ex, f.transfer)  # while still pinned: the blocks cannot be evicted mid-read
        self.store.unpin(f.hashes)
        report_transfers(f.member.instance, [f.req.request_id], [])
        self.cluster.wake(f.member)

    # -- saves ----------------------------------------------------------------------------
    def record_block_tables(self, m, plan: BatchPlan) -> None:
        """A real member planned a step (``build_connector_meta``): keep the block tables of the prompts it
        finishes, which a request that finishes in the step no longer holds when the step ends."""
        if moves_real_kv(m.instance.executor):
            self._tables[m.index] = {
                s.request.request_id: list(s.request.block_ids) for s in plan.seqs if _finishes_prompt(s)
            }

    def on_step(self, m, outcome) -> None:
        """Save the prompts that finished computing in this step."""
        bs = m.instance.pool.block_size
        tables = self._tables.pop(m.index, None)
        for s in outcome.plan.seqs:
            if _finishes_prompt(s):
                hashes = prompt_hashes(s.request, bs, s.request.num_prompt_tokens, m.instance.kv.hasher)
                self.saved_blocks += self.store.put(hashes)
                if tables is not None:
                    self._save_blocks(m, s.request.request_id, hashes, tables[s.request.request_id])
        if self.store.num_evicted != self._evicted_seen:  # the host copy keeps exactly the stored blocks
            self._evicted_seen = self.store.num_evicted
            self.worker.retain(self.store.__contains__)

    def _save_blocks(self, m, rid: str, hashes: list[int], table: list[int]) -> None:
        """Copy the blocks the store kept (a put may drop some) into the host copy."""
        kept = [(b, h) for b, h in zip(table, hashes) if h in self.store]
        bs = m.instance.pool.block_size
        t = KVTransfer(rid, [b for b, _ in kept], len(kept) * bs, "save", STORE_PEER, [h for _, h in kept])
        self.worker(m.instance.executor, t)

    def check_drained(self) -> None:
        if self._in_flight:
            raise RuntimeError(f"store: fetches left in flight at the end: {list(self._in_flight)[:5]}")


def _finishes_prompt(s: ScheduledSeq) -> bool:
    return s.is_prefill and s.context_len >= s.request.num_prompt_tokens
