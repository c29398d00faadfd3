"""Prefill/decode disaggregation: hand a prefilled request's KV from a prefill member to a decode member.

Flow (vLLM's P/D contract, through the KV connector): the prefill member runs the request to its first
token (``max_tokens`` 1 there) and, in ``request_finished``, keeps its blocks until the save lands. The
decode member, picked by the decode router from load snapshots, queues the request; when its blocks fit it
is admitted with the prompt's KV as asynchronous external tokens and waits in WAITING_FOR_KV holding them.
The transfer then takes bytes / link bandwidth + latency (``Topology.transfer_s``: NVLink inside a node,
the network between nodes) and, with ``layerwise_transfer``, runs layer by layer under the prefill's last
step when it can start at once, so only the part longer than that step shows. Transfers out of one
prefill member go one at a time (its egress link). When it lands, the prefill side frees the blocks and
the decode side runs the request: it is never decoded before its KV arrives. A request preempted on the
decode side later recomputes (the prefill copy is gone).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvbalance.cluster.connector import report_transfers
from kvbalance.request import Request, RequestState, SamplingParams


@dataclass
class Handoff:
    """One request's KV on its way from a prefill member to a decode member."""

    req: Request
    src: object  # Member
    dst: object  # Member
    ready_s: float  # the prefill step that produced it ended here
    last_step_s: float  # duration of that step (what a layer-wise transfer hides under)
    num_tokens: int = 0  # prompt tokens whose KV moves (past the decode side's own prefix hit)
    start_s: float = 0.0
    done_s: float = 0.0


class PDConnector:
    """Cluster-side P/D hand-off (see the module docstring). ``layerwise_transfer`` hides it under compute."""

    def __init__(self, cluster, layerwise_transfer: bool = True) -> None:
        self.cluster = cluster
        self.layerwise_transfer = layerwise_transfer
        self._sampling: dict[str, SamplingParams] = {}  # request id -> its real sampling params
        self._pending: dict[str, Handoff] = {}  # prefilled, queued on the decode side, load not started
        self._in_flight: dict[str, Handoff] = {}
        self._egress_free_s: dict[int, float] = {}
        self._last_step_s: dict[int, float] = {}
        self._src_blocks: dict[str, list[int]] = {}  # rid -> its block table on the prefill side (held)
        self.handoffs: list[Handoff] = []  # every transfer, for reports and tests
        # admissions of handed-off requests on their decode member: prompt tokens admitted there and those its
        # own prefix cache held (the KV that did not have to move); kept apart from the prompts computed on
        # prefill members, whose hits save compute (``Cluster.hit_rates``)
        self.decode_admitted_tokens = 0
        self.decode_hit_tokens = 0

    # -- prefill side ---------------------------------------------------------------
    def rejection_reason(self, req: Request) -> str | None:
        """A request no decode member could ever hold is rejected up front, not after its prefill."""
        reasons = [m.instance.rejection_reason(req) for m in self.cluster.decoders]
        return None if any(r is None for r in reasons) else f"decode: {reasons[0]}"

    def begin_prefill(self, req: Request) -> None:
        self._sampling[req.request_id] = req.sampling
        req.sampling = dataclasses.replace(req.sampling, max_tokens=1)

    def handles(self, req: Request) -> bool:
        return req.request_id in self._sampling

    def output_budget(self, req: Request) -> int:
        """``req``'s real ``max_tokens`` (while it prefills, its own says 1: its first token)."""
        real = self._sampling.get(req.request_id)
        return real.max_tokens if real is not None else req.max_tokens

    def holds_for(self, src, req: Request, block_ids: list[int]) -> bool:
        """Prefill side ``request_finished``: keep the blocks (and their cache lock: the scheduler holds
        both) if the request goes on to a decode member, until the save lands."""
        real = self._sampling.get(req.request_id)
        if real is None or real.max_tokens <= 1:
            return False
        self._src_blocks[req.request_id] = list(block_ids)
        return True

    def _release_hold(self, src, rid: str) -> None:
        report_transfers(src.instance, [], [rid])  # the save landed (or is moot): the prefill side frees
        self._src_blocks.pop(rid, None)

    def prefill_done(self, src, req: Request) -> None:
        """The prefill member finished ``req`` (first token sampled, or rejected/aborted)."""
        req.sampling = self._sampling.pop(req.request_id)
        if req.state is not RequestState.FINISHED or req.finish_reason == "stop" or req.max_tokens <= 1:
            self._release_hold(src, req.request_id)  # nothing to hand off: drop any hold
            self.cluster._finished(req)
            return
        req.state, req.finish_s, req.finish_reason = RequestState.WAITING, None, None
        now = self.cluster.loop.now
        h = Handoff(req, src, None, now, self._last_step_s.get(src.index, 0.0))
        i = self.cluster.decode_router.choose(req, self.cluster.loads(self.cluster.decoders))
        h.dst = self.cluster.decoders[i]
        self.cluster.decode_assignment[req.request_id] = h.dst.index
        self._pending[req.request_id] = h
        h.dst.driver.arrive(req)

    def aborted_on_prefill(self, src, req: Request) -> None:
        """Aborted before its prefill finished: drop the hold ``request_finished`` may have taken."""
        req.sampling = self._sampling.pop(req.request_id)
        self._release_hold(src, req.request_id)

    def aborted_on_decode(self, req: Request) -> None:
        """Aborted after the hand-off: if its load never started, the prefill side's hold goes now; a load
        in flight lands first (the decode side keeps the blocks until then, the prefill side until then)."""
        h = self._pending.pop(req.request_id, None)
        if h is not None:
            self._release_hold(h.src, req.request_id)

    # -- decode side (connector calls) ---------------------------------------------------
    def is_handoff_to(self, dst, req: Request) -> bool:
        """``req`` was handed off to ``dst`` and its KV load has not started (not a recompute)."""
        h = self._pending.get(req.request_id)
        return h is not None and h.dst is dst

    def matched(self, dst, req: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.is_handoff_to(dst, req):
            return 0, False  # not a hand-off (or a recompute after preemption): compute it
        external = req.num_prompt_tokens - num_computed_tokens
        if external <= 0:  # the decode side caches the whole prompt already: nothing to move
            return 0, False
        return external, True

    def admitted(self, dst, req: Request, num_external_tokens: int) -> None:
        """The decode member admitted a hand-off: count its local hit, then load the rest of the prompt's KV
        or, when its own cache held all of it, let the prefill side free its copy."""
        self.decode_admitted_tokens += req.num_prompt_tokens
        self.decode_hit_tokens += min(req.num_cached_tokens, req.num_prompt_tokens)
        if num_external_tokens > 0:
            self.start_load(dst, req, num_external_tokens)
            return
        h = self._pending.pop(req.request_id)
        self._release_hold(h.src, req.request_id)

    def start_load(self, dst, req: Request, num_tokens: int) -> None:
        h = self._pending.pop(req.request_id)
        h.num_tokens = num_tokens
        now = self.cluster.loop.now
        free = self._egress_free_s.get(h.src.index, 0.0)
        move = self.transfer_s(h)
        if self.layerwise_transfer and now == h.ready_s and free <= h.ready_s - h.last_step_s:
            h.start_s = h.ready_s - h.last_step_s  # layer l leaves while layer l+1 computes
            h.done_s = max(h.ready_s, h.start_s + move)
        else:
            h.start_s = max(now, free)
            h.done_s = h.start_s + move
        self._egress_free_s[h.src.index] = h.done_s
        self._in_flight[req.request_id] = h
        self.handoffs.append(h)
        self.cluster.loop.at(h.done_s, self._land, h)

    def transfer_s(self, h: Handoff) -> float:
        ex = h.src.instance.executor
        if hasattr(ex, "cost_model"):
            per_token = ex.cost_model.model.kv_bytes_per_token
        else:  # a real executor: its KV tensor's bytes per block
            per_token = ex.kv_bytes_per_block / h.src.instance.pool.block_size
        return self.cluster.topology.transfer_s(h.num_tokens * per_token, h.src.gpus, h.dst.gpus)

    def _move_blocks(self, h: Handoff) -> None:
        """Real executors: copy the prompt's KV blocks from the prefill's held table to the decode's table."""
        src, dst = h.src.instance.executor, h.dst.instance.executor
        if not (hasattr(src, "read_blocks") and hasattr(dst, "write_blocks")):
            return  # simulated: the bytes are the transfer time
        bs = h.src.instance.pool.block_size
        first = (h.req.num_prompt_tokens - h.num_tokens) // bs  # the decode side's own hit ends on a block
        last = -(-h.req.num_prompt_tokens // bs)
        table = self._src_blocks[h.req.request_id]
        dst.write_blocks(h.req.block_ids[first:last], src.read_blocks(table[first:last]))

    def _land(self, h: Handoff) -> None:
        rid = h.req.request_id
        del self._in_flight[rid]
        if h.req.state is RequestState.WAITING_FOR_KV:
            self._move_blocks(h)
        self._release_hold(h.src, rid)  # the save landed: the prefill side frees its blocks
        report_transfers(h.dst.instance, [rid], [])  # the load landed: the request runs
        self.cluster.wake(h.src)
        self.cluster.wake(h.dst)

    def on_step(self, m, outcome) -> None:
        self._last_step_s[m.index] = outcome.result.duration_s

    def check_drained(self) -> None:
        stuck = [*self._pending, *self._in_flight, *self._sampling]
        if stuck:
            raise RuntimeError(f"P/D hand-off: requests left in transfer at the end: {stuck[:5]}")
