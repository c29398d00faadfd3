"""Resident drain: when a role flip takes a decode instance to prefill, its running decodes (the
"residents") move, KV and all, to decode instances with room, so the flipped instance computes prompts
alone instead of interleaving them with the answers it was decoding (BanaServe's KV migration, whole
requests at a time, on Llumnix's live-migration mechanics).

Without it a flipped instance keeps its residents until they finish: on ``phases-15`` a decode-heavy
period's answers (13.4 s of decoding on average) outlive the 15 s period, and an instance flipped back to
prefill held ~120 running decodes (60k KV tokens) into the prefill-heavy period (``role_flip.py``).

Placement (``place``): the residents are taken longest remaining answer first (they would pin the flipped
instance longest) and each goes to the decode instance with the most room that stays within three
limits once it lands: KV, counted at the end of every answer there (held + output still to come: the peak
its requests can reach, so a move never forces a preemption), batch slots (``max_num_seqs``), and the decode
step time of everything there at its present context, by the cost model, within ``step_fraction`` of the
TPOT SLO. A resident that fits nowhere stays and decodes on the flipped instance as before.

Mechanics (``ResidentDrain``), one batch per (source, destination), on the cluster's clock:

1. the destination reserves blocks for each resident's computed KV (``Scheduler.reserve_blocks``) and the
   batch's blocks copy over the link between the two GPU groups (``Topology.transfer_s``: bytes / bandwidth
   + latency), the residents decoding on the source meanwhile; batches out of one source share its egress
   (one after another);
2. up to ``max_stages`` pre-copy stages copy the blocks written (or re-dirtied: the partial last block) since
   the stage before, until a stage's dirty blocks copy within ``max_pause_s``;
3. at the source's next step boundary the residents stop (``Scheduler.detach``: their blocks stay held
   there), take their reserved blocks on the destination in WAITING_FOR_KV (``Scheduler.admit_reserved``)
   and the last dirty blocks move plus one handshake round trip (``default_sync_s``): the pause, in their
   TPOT. When it lands, the source's blocks go and the residents decode on the destination with every
   token, output and timestamp they had.

A resident that finishes, is aborted or preempted on the source before its stop leaves the batch (its
reservation released); one whose last blocks no longer fit stays on the source. Blocks are conserved: each
resident holds its blocks on exactly one side, plus the destination's reservation while copying.

``free`` is a what-if, not a system: every copy takes no time (an upper bound on what draining can give).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbalance.cluster.connector import report_transfers
from kvbalance.cluster.request_migration import block_bytes, can_migrate
from kvbalance.perf.migration import default_sync_s
from kvbalance.request import Request, RequestState

if TYPE_CHECKING:
    from kvbalance.cluster.core import Cluster, Member

PRECOPY, STOPPING, FINAL, DONE = "precopy", "stopping", "final", "done"


@dataclass
class Room:
    """What a destination can still take (``place``): KV at the end of its answers, slots, decode contexts."""

    member: Member
    kv_free_tokens: int  # capacity - (held + output still to come), over everything there and placed
    slots_free: int
    contexts: list[int]  # the context of every request there (its next decode step reads these)


def final_tokens(req: Request) -> int:
    """KV a request holds once its whole answer is written (its peak)."""
    return req.num_prompt_tokens + req.max_tokens


def room_of(m: Member) -> Room:
    inst = m.instance
    sched = inst.scheduler
    reqs = [*sched.running, *sched.waiting, *sched.loading.values()]
    ld = inst.load()
    peak = ld.kv_used_tokens + ld.remaining_output_tokens + ld.queued_prefill_tokens
    return Room(m, inst.kv_capacity_tokens - peak, inst.config.max_num_seqs - len(reqs),
                [r.num_tokens for r in reqs])  # fmt: skip


def step_s(m: Member, contexts: list[int]) -> float:
    """The cost model's decode step of ``m`` over requests at ``contexts`` (one new token each)."""
    if not contexts:
        return 0.0
    return m.instance.executor.cost_model.step_seconds([(1, c, False) for c in contexts])


def place(
    residents: list[Request], rooms: list[Room], tpot_slo_s: float, step_fraction: float = 0.8
) -> dict[str, Member]:
    """Request id -> destination for the residents that fit (module docstring); ``rooms`` change in place."""
    out: dict[str, Member] = {}
    order = sorted(residents, key=lambda r: (-(r.max_tokens - r.num_output_tokens), r.request_id))
    limit = step_fraction * tpot_slo_s
    steps = {id(x): step_s(x.member, x.contexts) for x in rooms}
    for r in order:
        need = final_tokens(r)
        for x in sorted(rooms, key=lambda x: (-x.kv_free_tokens, x.member.index)):
            if x.kv_free_tokens < need or x.slots_free < 1:
                continue
            if steps[id(x)] > 0 and step_s(x.member, [*x.contexts, r.num_tokens]) > limit:
                continue
            x.kv_free_tokens -= need
            x.slots_free -= 1
            x.contexts.append(r.num_tokens)
            steps[id(x)] = step_s(x.member, x.contexts)
            out[r.request_id] = x.member
            break
    return out


@dataclass
class DrainBatch:
    """The residents moving from ``src`` to ``dst`` together: their stages, bytes, pause and outcome."""

    src: Member
    dst: Member
    reqs: dict[str, Request]
    start_s: float
    reserved: dict[str, int] = field(default_factory=dict)  # blocks held on the destination, per request
    clean: dict[str, int] = field(default_factory=dict)  # blocks [0, clean) copied and full
    stage_blocks: list[int] = field(default_factory=list)
    final_blocks: int = 0
    bytes_moved: float = 0.0
    stop_s: float | None = None
    end_s: float | None = None
    state: str = PRECOPY
    preemptions: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> residents that left the batch
    moved: int = 0

    def as_dict(self) -> dict:
        return {"src": self.src.name, "dst": self.dst.name, "start_s": self.start_s, "stop_s": self.stop_s,
                "end_s": self.end_s, "moved": self.moved, "dropped": dict(self.dropped),
                "stages": len(self.stage_blocks), "bytes": self.bytes_moved,
                "pause_s": (self.end_s - self.stop_s) if self.stop_s is not None else 0.0}  # fmt: skip


class ResidentDrain:
    """Moves a flipped instance's residents to decode instances with room (module docstring)."""

    def __init__(
        self, cluster: Cluster, tpot_slo_s: float, *, free: bool = False, max_stages: int = 3,
        max_pause_s: float = 0.005, step_fraction: float = 0.8,
    ) -> None:  # fmt: skip
        if max_stages < 1 or not max_pause_s >= 0 or not 0 < step_fraction:
            raise ValueError(f"max_stages, max_pause_s, step_fraction: need >= 1, >= 0, > 0, got {max_stages}, "
                             f"{max_pause_s}, {step_fraction}")  # fmt: skip
        self.cluster = cluster
        self.tpot_slo_s = tpot_slo_s
        self.free = free
        self.max_stages = max_stages
        self.max_pause_s = max_pause_s
        self.step_fraction = step_fraction
        self.active: list[DrainBatch] = []
        self.log: list[DrainBatch] = []
        self._egress_free_s: dict[int, float] = {}
        self._moving: set[str] = set()  # request ids in a batch

    # -- planning --------------------------------------------------------------------------------------
    def residents(self, m: Member) -> list[Request]:
        return [
            r for r in m.instance.scheduler.running if can_migrate(r, m) and r.request_id not in self._moving
        ]

    def destinations(self, src: Member) -> list[Member]:
        """Decode members other than ``src`` that are not themselves being drained."""
        busy = {b.src.index for b in self.active}
        return [
            m for m in self.cluster.members if m.role == "decode" and m is not src and m.index not in busy
        ]

    def plan(self, src: Member) -> dict[str, Member]:
        """Where ``src``'s residents would go now (request id -> destination), nothing reserved."""
        return place(self.residents(src), [room_of(m) for m in self.destinations(src)], self.tpot_slo_s,
                     self.step_fraction)  # fmt: skip

    def drain(self, src: Member) -> list[DrainBatch]:
        """Start moving ``src``'s residents (those that fit somewhere): one batch per destination."""
        where = self.plan(src)
        now = self.cluster.loop.now
        batches: dict[int, DrainBatch] = {}
        for r in self.residents(src):
            dst = where.get(r.request_id)
            if dst is None:
                continue
            b = batches.get(dst.index)
            if b is None:
                b = batches[dst.index] = DrainBatch(src, dst, {}, now)
            b.reqs[r.request_id] = r
            b.preemptions[r.request_id] = r.num_preemptions
            self._moving.add(r.request_id)
        out = list(batches.values())
        for b in out:
            self.active.append(b)
            self.log.append(b)
            self._stage(b)
        return out

    # -- stages ----------------------------------------------------------------------------------------
    def _blocks(self, b: DrainBatch, r: Request) -> int:
        return b.src.instance.pool.blocks_for_tokens(r.num_computed_tokens)

    def _drop(self, b: DrainBatch, rid: str, reason: str) -> None:
        """``rid`` leaves the batch (no copy into its reservation is in flight): its reservation goes."""
        b.reqs.pop(rid)
        self._moving.discard(rid)
        if b.reserved.pop(rid, 0):
            report_transfers(b.dst.instance, [rid], [])
        b.dropped[reason] = b.dropped.get(reason, 0) + 1

    def _gone(self, b: DrainBatch, r: Request) -> str | None:
        if r.state is RequestState.ABORTED:
            return "aborted"
        if r.is_finished:
            return "finished"
        if r.num_preemptions != b.preemptions[r.request_id] or not can_migrate(r, b.src):
            return "preempted"
        return None

    def _reserve(self, b: DrainBatch, r: Request) -> bool:
        rid = r.request_id
        more = self._blocks(b, r) - b.reserved.get(rid, 0)
        if more > 0:
            if not b.dst.instance.scheduler.reserve_blocks(rid, more):
                return False
            b.reserved[rid] = b.reserved.get(rid, 0) + more
        return True

    def _copy_s(self, b: DrainBatch, blocks: int) -> float:
        nbytes = blocks * block_bytes(b.src)
        b.bytes_moved += nbytes
        if self.free:
            return 0.0
        return self.cluster.topology.transfer_s(nbytes, b.src.gpus, b.dst.gpus)

    def _reserve_all(self, b: DrainBatch, mark_clean: bool) -> int | None:
        """Drop the residents that left or no longer fit the destination, reserve the others' computed blocks
        there and return how many of those are dirty (``mark_clean``: then count them as copied); None when
        none is left (the batch has ended)."""
        dirty = 0
        for rid, r in list(b.reqs.items()):
            reason = self._gone(b, r)
            if reason is None and not self._reserve(b, r):
                reason = "dst_out_of_blocks"
            if reason is not None:
                self._drop(b, rid, reason)
                continue
            dirty += self._blocks(b, r) - b.clean.get(rid, 0)
            if mark_clean:
                b.clean[rid] = r.num_computed_tokens // b.src.instance.pool.block_size
        if not b.reqs:
            self._end(b)
            return None
        return dirty

    def _stage(self, b: DrainBatch) -> None:
        """Reserve each resident's computed blocks on the destination and copy the dirty ones."""
        dirty = self._reserve_all(b, mark_clean=True)
        if dirty is None:
            return
        b.stage_blocks.append(dirty)
        now = self.cluster.loop.now
        start = max(now, self._egress_free_s.get(b.src.index, now))
        done = start + self._copy_s(b, dirty)
        self._egress_free_s[b.src.index] = done
        self.cluster.loop.at(done, self._stage_done, b)

    def _dirty_blocks(self, b: DrainBatch) -> int:
        return sum(self._blocks(b, r) - b.clean.get(rid, 0) for rid, r in b.reqs.items())

    def _stage_done(self, b: DrainBatch) -> None:
        for rid, r in list(b.reqs.items()):
            reason = self._gone(b, r)
            if reason is not None:
                self._drop(b, rid, reason)
        if not b.reqs:
            self._end(b)
            return
        left = self._dirty_blocks(b) * block_bytes(b.src)
        small = (
            self.free or self.cluster.topology.transfer_s(left, b.src.gpus, b.dst.gpus) <= self.max_pause_s
        )
        if small or len(b.stage_blocks) >= self.max_stages:
            b.state = STOPPING  # the stop-and-copy at the source's next step boundary
            if not b.src.driver.busy:
                self._stop(b)
            return
        self._stage(b)

    # -- stop-and-copy and commit ----------------------------------------------------------------------
    def on_step(self, m: Member) -> None:
        """A step of ``m`` ended: its batches waiting for a step boundary stop now."""
        for b in [b for b in self.active if b.src is m and b.state == STOPPING]:
            self._stop(b)

    def _stop(self, b: DrainBatch) -> None:
        final = self._reserve_all(b, mark_clean=False)
        if final is None:
            return
        now = self.cluster.loop.now
        b.state, b.stop_s, b.final_blocks = FINAL, now, final
        src, dst = b.src.instance.scheduler, b.dst.instance.scheduler
        for rid, r in b.reqs.items():
            src.detach(r)
            dst.admit_reserved(r, r.num_computed_tokens)
            b.reserved.pop(rid)  # now the request's own block table there
            self.cluster.decode_assignment[rid] = b.dst.index  # where it lives now (abort finds it)
        link = self.cluster.topology.link_between(b.src.gpus, b.dst.gpus)
        pause = self._copy_s(b, final) + (0.0 if self.free else default_sync_s(link))
        self.cluster.loop.at(now + pause, self._commit, b)

    def _commit(self, b: DrainBatch) -> None:
        rids = list(b.reqs)
        b.moved = sum(1 for r in b.reqs.values() if r.state is RequestState.WAITING_FOR_KV)
        aborted = len(rids) - b.moved  # by the client during the stop-and-copy: both holds go now
        if aborted:
            b.dropped["aborted"] = b.dropped.get("aborted", 0) + aborted
        report_transfers(b.src.instance, [], rids)  # the source frees its blocks only now
        report_transfers(b.dst.instance, rids, [])  # the residents run on the destination
        self._moving.difference_update(rids)
        self._end(b)
        self.cluster.wake(b.dst)
        self.cluster.wake(b.src)

    def _end(self, b: DrainBatch) -> None:
        b.state, b.end_s = DONE, self.cluster.loop.now
        self.active.remove(b)

    # -- reports ---------------------------------------------------------------------------------------
    def summary(self) -> dict:
        done = [b for b in self.log if b.state == DONE]
        return {
            "drain_batches": len(done),
            "drain_moved": sum(b.moved for b in done),
            "drain_bytes": sum(b.bytes_moved for b in done),
            "drain_pause_s_max": max((b.as_dict()["pause_s"] for b in done), default=0.0),
            "drain_log": [b.as_dict() for b in done],
        }

    def check_drained(self) -> None:
        if self.active:
            raise RuntimeError(
                f"resident drain: batches left at the end: {[b.as_dict() for b in self.active]}"
            )
