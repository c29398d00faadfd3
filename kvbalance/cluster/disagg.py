"""Prefill/decode disaggregation: hand a prefilled request's KV from a prefill member to a decode member.

Flow (vLLM's P/D contract): the prefill member runs the request to its first token (``max_tokens`` 1 there);
it then keeps the request's blocks until the save lands (``request_finished`` -> hold); the decode member is
picked by the decode router from load snapshots; the transfer starts once the decode member has room for
the blocks (reserved there while the bytes move), takes bytes / link bandwidth + latency
(``Topology.transfer_s``; NVLink inside a node, the network between nodes) and, with ``layerwise_transfer``,
runs layer by layer under the prefill's last step, so only the part longer than that step shows. Transfers
out of one prefill member go one at a time (its egress link). Until the load lands the request waits for
its KV (counted as ``num_loading`` in the decode member's load) and is never scheduled there.

Stopgap until the KV connector (``kvcache/connector.py``) is on main: the hold and the landing use the
prefix cache directly — the prefill side holds the prompt's cached path (plus one block for a partial tail)
and the decode side caches the landed full blocks (``cluster/holds.py``), so admission finds them as a
prefix hit and only the partial tail block (< block_size tokens) is recomputed. TODO(connector): replace with
``get_num_new_matched_tokens`` / ``update_state_after_alloc`` / ``request_finished`` and WAITING_FOR_KV.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

from kvbalance.cluster.holds import BlockHold, hold_computed, land, release
from kvbalance.request import Request, RequestState, SamplingParams


@dataclass
class Handoff:
    """One request's KV on its way from a prefill member to a decode member."""

    req: Request
    src: object  # Member
    dst: object  # Member
    num_tokens: int  # prompt tokens whose KV moves
    ready_s: float  # the prefill step that produced it ended here
    last_step_s: float  # duration of that step (what a layer-wise transfer hides under)
    src_hold: BlockHold | None = None  # prefill side keeps the blocks until the save lands
    dst_blocks: list[int] = dataclasses.field(default_factory=list)  # decode-side reservation
    start_s: float = 0.0
    done_s: float = 0.0


class PDConnector:
    """Cluster-side P/D hand-off (see the module docstring). ``layerwise_transfer`` hides it under compute."""

    def __init__(self, cluster, layerwise_transfer: bool = True) -> None:
        self.cluster = cluster
        self.layerwise_transfer = layerwise_transfer
        self._sampling: dict[str, SamplingParams] = {}  # request id -> its real sampling params
        self._queued: dict[int, deque[Handoff]] = {m.index: deque() for m in cluster.decoders}
        self._in_flight: dict[int, list[Handoff]] = {m.index: [] for m in cluster.decoders}
        self._egress_free_s: dict[int, float] = {}
        self._last_step_s: dict[int, float] = {}
        self.handoffs: list[Handoff] = []  # every transfer, for reports and tests

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

    def prefill_done(self, src, req: Request) -> None:
        """The prefill member finished ``req`` (first token sampled, or rejected/aborted)."""
        req.sampling = self._sampling.pop(req.request_id)
        done = req.state is not RequestState.FINISHED or req.finish_reason == "stop" or req.max_tokens <= 1
        if done:
            if req.state is RequestState.FINISHED and req.finish_reason != "stop":
                req.finish_reason = "length"
            self.cluster._finished(req)
            return
        req.state, req.finish_s, req.finish_reason = RequestState.WAITING, None, None
        now = self.cluster.loop.now
        h = Handoff(req, src, None, req.num_prompt_tokens, now, self._last_step_s.get(src.index, 0.0))
        h.src_hold = hold_computed(src.instance, req, h.num_tokens)
        i = self.cluster.decode_router.choose(req, self.cluster.loads(self.cluster.decoders))
        h.dst = self.cluster.decoders[i]
        self.cluster.decode_assignment[req.request_id] = h.dst.index
        self._queued[h.dst.index].append(h)
        self._try_start(h.dst)

    # -- transfer ------------------------------------------------------------------
    def _try_start(self, dst) -> None:
        queue = self._queued[dst.index]
        inst = dst.instance
        pool, cache = inst.pool, inst.cache
        while queue:
            h = queue[0]
            need = pool.blocks_for_tokens(h.num_tokens)
            watermark = int(inst.config.watermark * pool.num_blocks)
            available = pool.num_free + (cache.evictable_blocks if cache is not None else 0)
            busy = inst.has_work() or self._in_flight[dst.index]
            if busy and (need + watermark > available or inst.scheduler.num_waiting):
                return  # FCFS: the head waits until its blocks fit and landed requests are admitted
            queue.popleft()
            short = need - pool.num_free
            if short > 0 and cache is not None:
                cache.evict(short)
            h.dst_blocks = pool.allocate(need)
            self._start(h)

    def transfer_s(self, h: Handoff) -> float:
        kv_bytes = h.num_tokens * h.src.instance.executor.cost_model.model.kv_bytes_per_token
        return self.cluster.topology.transfer_s(kv_bytes, h.src.gpus, h.dst.gpus)

    def _start(self, h: Handoff) -> None:
        now = self.cluster.loop.now
        free = self._egress_free_s.get(h.src.index, 0.0)
        move = self.transfer_s(h)
        if self.layerwise_transfer and free <= h.ready_s - h.last_step_s and now == h.ready_s:
            h.start_s = h.ready_s - h.last_step_s  # layer l leaves while layer l+1 computes
            h.done_s = max(h.ready_s, h.start_s + move)
        else:
            h.start_s = max(now, free)
            h.done_s = h.start_s + move
        self._egress_free_s[h.src.index] = h.done_s
        self._in_flight[h.dst.index].append(h)
        self.handoffs.append(h)
        self.cluster.loop.at(h.done_s, self._land, h)

    def _land(self, h: Handoff) -> None:
        release(h.src.instance, h.src_hold)
        self._in_flight[h.dst.index].remove(h)
        hold = land(h.dst.instance, h.req, h.num_tokens, h.dst_blocks)
        h.dst_blocks = []
        # the landed blocks stay cached (evictable) and the request queues behind any preempted one: holding
        # them locked could deadlock a preempted head that needs the memory; under that pressure they are
        # evicted and recomputed, as any cached prefix would be
        release(h.dst.instance, hold)
        h.dst.driver.arrive(h.req)

    # -- decode side ------------------------------------------------------------------
    def on_step(self, m, outcome) -> None:
        self._last_step_s[m.index] = outcome.result.duration_s
        if m.role == "decode":
            self._try_start(m)

    def incoming(self, m) -> tuple[int, int]:
        """(requests, output tokens still to generate) whose KV is queued for or moving to member ``m``."""
        hs = [*self._queued[m.index], *self._in_flight[m.index]]
        return len(hs), sum(h.req.max_tokens - h.req.num_output_tokens for h in hs)

    def holds_on(self, m) -> tuple[list[BlockHold], list[int]]:
        """Blocks the hand-off holds on member ``m``: prefill-side holds and decode-side reservations."""
        holds = [h.src_hold for hs in self._in_flight.values() for h in hs if h.src is m and h.src_hold]
        holds += [h.src_hold for q in self._queued.values() for h in q if h.src is m and h.src_hold]
        extra = [b for h in self._in_flight.get(m.index, ()) for b in h.dst_blocks]
        return holds, extra

    def check_drained(self) -> None:
        stuck = [h.req.request_id for q in self._queued.values() for h in q]
        stuck += [h.req.request_id for f in self._in_flight.values() for h in f]
        if stuck or self._sampling:
            raise RuntimeError(f"P/D hand-off: requests left in transfer at the end: {stuck[:5]}")
