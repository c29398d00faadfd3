"""The KV connector inside one instance actor: both halves, over Ray's object store.

Scheduler half (``kvcache.connector.KVConnector``), as the simulated cluster's ``ClusterConnector``:

- decode role: a handed-off request (``expect_handoff``) is offered its prompt's KV past the local prefix
  hit as asynchronous external tokens; it waits in WAITING_FOR_KV holding its blocks;
- prefill / colocated role with a store: the store's longest stored prefix past the local hit is offered
  the same way (``KVStoreActor.match_pin``; the last prompt token is always computed);
- prefill role: ``request_finished`` keeps a P/D request's blocks until its save lands.

Worker half, on the executor's real tensors: a load is an ObjectRef (the prefill actor's ``ray.put`` of
the prompt's blocks, or the store's ``fetch``); :meth:`poll` lands those that are ready — ``ray.get``
(zero-copy on one node), ``write_blocks`` into the request's blocks, ``Instance.transfers_done`` — between
steps. A load that fails (its owner died) frees the blocks and is reported (``failed``): the front end
retries or fails the request. A request aborted while its load is in flight keeps its blocks until the
load lands or fails (the scheduler holds them), then they go. Saves: :meth:`take_saves` reads the blocks
of the prompts the step finished (block ids recorded when the step was planned) for the P/D hand-off and
for the store.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbalance.batch import BatchPlan
from kvbalance.cluster.connector import prompt_hashes
from kvbalance.raycluster.wire import from_wire
from kvbalance.request import Request, RequestState


@dataclass
class Load:
    """KV on its way into a request's blocks ``block_ids`` (the request's blocks ``[first, first + n)``)."""

    rid: str
    ref: object  # ray.ObjectRef of (array, dtype) or of an array (the store's fetch)
    block_ids: list[int]
    kind: str  # "handoff" or "store"
    first: int = 0  # of the sent array's blocks, the first one to write (a P/D hand-off past a local hit)
    num_tokens: int = 0


@dataclass
class PromptDone:
    """A prompt that finished computing in the last step, with its block table as planned."""

    req: Request
    block_ids: list[int]


@dataclass
class ConnectorStats:
    handoff_loads: int = 0
    handoff_tokens: int = 0
    store_fetches: int = 0
    store_fetch_tokens: int = 0
    failed_loads: int = 0
    bytes_loaded: int = 0


class ActorConnector:
    def __init__(self, role: str, name: str, store=None, kv_dtype: str = "float32") -> None:
        self.role = role
        self.name = name
        self.store = store  # a KVStoreActor handle, or None
        self.kv_dtype = kv_dtype
        self.instance = None  # set by the actor once the engine is built
        self.executor = None
        self.handoffs: dict[str, object] = {}  # rid -> the ObjectRef of its prompt's KV (decode role)
        self.pd_requests: set[str] = set()  # prefill role: requests that hand off to a decode instance
        self._offers: dict[str, tuple[int, str]] = {}  # rid -> (stored blocks, "store"|"handoff") offered
        self.loads: dict[str, Load] = {}  # in flight
        self.failed: list[tuple[str, str]] = []  # (rid, reason) of loads that failed, since the last take
        self._planned: dict[str, list[int]] = {}  # rid -> block table of prompts the planned step finishes
        self.stats = ConnectorStats()

    def bind(self, instance, executor) -> None:
        self.instance, self.executor = instance, executor

    # -- what the actor tells it ------------------------------------------------------
    def expect_handoff(self, rid: str, ref) -> None:
        """A P/D hand-off is coming: ``ref`` is the prefill actor's ``ray.put`` of (blocks, dtype)."""
        self.handoffs[rid] = ref

    def forget(self, rid: str) -> None:
        """A request left before admission (aborted while waiting): drop its offer and store pins."""
        self.handoffs.pop(rid, None)
        self.pd_requests.discard(rid)
        if self._offers.pop(rid, None) is not None and self.store is not None:
            self.store.unpin.remote(self.name, rid)

    # -- scheduler half -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        if self.role == "decode":
            if rid not in self.handoffs:
                return 0, False  # a recompute after preemption: compute it
            external = request.num_prompt_tokens - num_computed_tokens
            if external <= 0:
                self.handoffs.pop(rid)  # the whole prompt is cached here already
                return 0, False
            self._offers[rid] = (0, "handoff")
            return external, True
        if self.store is None:
            return 0, False
        import ray

        bs = self.instance.pool.block_size
        hashes = prompt_hashes(request, bs, request.num_prompt_tokens - 1, self.instance.kv.hasher)
        stored = ray.get(self.store.match_pin.remote(self.name, rid, hashes)) if hashes else 0
        external = stored * bs - num_computed_tokens
        if external <= 0:
            if stored:
                self.store.unpin.remote(self.name, rid)
            self._offers.pop(rid, None)
            return 0, False
        self._offers[rid] = (stored, "store")
        return external, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        offer = self._offers.pop(rid, None)
        if num_external_tokens <= 0 or offer is None:
            return
        bs = self.instance.pool.block_size
        stored, kind = offer
        if kind == "handoff":
            ref = self.handoffs.pop(rid)
            first = (request.num_prompt_tokens - num_external_tokens) // bs
            last = -(-request.num_prompt_tokens // bs)
            self.loads[rid] = Load(rid, ref, list(block_ids[first:last]), kind, first, num_external_tokens)
            return
        first = stored - num_external_tokens // bs
        ref = self.store.fetch.remote(self.name, rid, first, stored - first)
        self.loads[rid] = Load(rid, ref, list(block_ids[first:stored]), kind, 0, num_external_tokens)

    def build_connector_meta(self, plan: BatchPlan) -> None:
        self._planned = {
            s.request.request_id: list(s.request.block_ids)
            for s in plan.seqs
            if s.is_prefill and s.context_len >= s.request.num_prompt_tokens
        }

    def update_connector_output(self, finished_loads: list[str], finished_saves: list[str]) -> None:
        return None

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        # a P/D prefill keeps its blocks until its save (the put into the object store) lands
        return self.role == "prefill" and request.request_id in self.pd_requests

    # -- worker half ------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> list[str]:
        """Land the loads whose objects are ready (waiting up to ``timeout_s`` for one); returns their ids."""
        if not self.loads:
            return []
        import ray

        refs = [ld.ref for ld in self.loads.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=True)
        if not ready:
            return []
        ready_ids = {r.hex() for r in ready}
        landed = []
        for rid, ld in list(self.loads.items()):
            if ld.ref.hex() in ready_ids:
                del self.loads[rid]
                self._land(ld)
                landed.append(rid)
        return landed

    def _land(self, ld: Load) -> None:
        import ray

        req = self.instance.scheduler.loading.get(ld.rid)
        try:
            got = ray.get(ld.ref)
        except Exception as exc:  # the owner died, the object was lost, the store is gone
            self._fail(ld, req, f"{ld.kind} KV load failed: {type(exc).__name__}")
            return
        if req is not None and req.state is RequestState.WAITING_FOR_KV:
            array, dtype = got if ld.kind == "handoff" else (got, self.kv_dtype)
            blocks = from_wire(array, dtype)
            n = len(ld.block_ids)
            self.executor.write_blocks(ld.block_ids, blocks[:, :, ld.first : ld.first + n])
            self.stats.bytes_loaded += n * self.executor.kv_bytes_per_block
            if ld.kind == "handoff":
                self.stats.handoff_loads += 1
                self.stats.handoff_tokens += ld.num_tokens
            else:
                self.stats.store_fetches += 1
                self.stats.store_fetch_tokens += ld.num_tokens
        self.instance.transfers_done([ld.rid], [])  # runs now; or, aborted meanwhile, its held blocks go

    def _fail(self, ld: Load, req: Request | None, reason: str) -> None:
        self.stats.failed_loads += 1
        if req is not None:  # still waiting: end it here, nothing cached from the garbage blocks
            self.instance.abort(req, 0.0)
        self.instance.transfers_done([ld.rid], [])
        self.failed.append((ld.rid, reason))

    def take_failed(self) -> list[tuple[str, str]]:
        out, self.failed = self.failed, []
        return out

    def take_saves(self, plan: BatchPlan) -> list[PromptDone]:
        """The prompts ``plan`` (the step just run) finished, with their block tables as planned."""
        planned, self._planned = self._planned, {}
        return [
            PromptDone(s.request, planned[s.request.request_id])
            for s in plan.seqs
            if s.request.request_id in planned
        ]

    def pending_load_ids(self) -> list[str]:
        return list(self.loads)
