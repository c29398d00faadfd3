"""Request-level live migration between two colocated members (Llumnix, OSDI '24 §4.2): a running request's
KV moves to another instance in stages while it keeps decoding, then a short stop-and-copy hands it over.

The handshake and stages, on the cluster's clock (``RequestMigrator.start``):

1. the destination reserves blocks for the request's computed KV (``Scheduler.reserve_blocks``; the
   migration aborts, nothing held, if they do not fit) and stage 0 copies them;
2. stage k copies the blocks written (or re-dirtied: a partial last block) during stage k - 1, after
   reserving the new ones on the destination; the request decodes on the source meanwhile. Blocks and
   times follow ``perf.migration.live_migration_cost``'s rounds: ``ceil(pos / block_size) - clean`` dirty
   blocks, ``latency + bytes / bandwidth`` on the link between the two GPU groups (``Topology``);
3. once at most ``last_stage_max_blocks`` are dirty, the request stops at the source's next step boundary
   (``Scheduler.detach``: its blocks stay held there), takes its reserved blocks on the destination in
   WAITING_FOR_KV (``Scheduler.admit_reserved``, the P/D hand-off's decode-side state) and the last blocks
   move plus one handshake round trip (``default_sync_s``): the pause. When they land the commit reports
   the save to the source (its blocks go) and the load to the destination (the request runs there with all
   its computed tokens, outputs, sampling params and timestamps: TTFT unchanged, the pause in its TPOT).

A migration aborts cleanly — the destination's reservation is released once no copy writes into it, the
request stays where it is — if the request finishes, is aborted or preempted on the source, if the
destination runs out of blocks, or if ``max_stages`` pre-copy stages do not converge (Llumnix drops the
migration then; ``live_migration_cost`` stops-and-copies instead). A client abort during the stop-and-copy
is the destination's WAITING_FOR_KV abort: both sides keep their blocks until the copy lands.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbalance.cluster.connector import report_transfers
from kvbalance.perf.migration import default_sync_s
from kvbalance.request import Request, RequestState

if TYPE_CHECKING:
    from kvbalance.cluster.core import Cluster, Member

PRECOPY, STOPPING, FINAL, DONE = "precopy", "stopping", "final", "done"


@dataclass
class RequestMigration:
    """One request's move from ``src`` to ``dst``: its stages (blocks copied each), bytes, pause, outcome."""

    req: Request
    src: Member
    dst: Member
    start_s: float
    preemptions: int  # the request's preemption count at the start (a preemption aborts the move)
    stage_blocks: list[int] = field(
        default_factory=list
    )  # pre-copy stages; the stop-and-copy is final_blocks
    final_blocks: int = 0
    reserved_blocks: int = 0  # blocks held on the destination so far
    clean_blocks: int = 0  # blocks [0, clean) copied and full
    bytes_moved: float = 0.0
    stop_s: float | None = None
    end_s: float | None = None
    state: str = PRECOPY
    outcome: str | None = None  # "committed" or the abort reason

    @property
    def pause_s(self) -> float:
        return (self.end_s - self.stop_s) if self.outcome == "committed" else 0.0


def block_bytes(m: Member) -> float:
    """Bytes of one KV block of ``m`` (all layers, whole model: the topology shards it over TP ranks)."""
    ex = m.instance.executor
    if hasattr(ex, "cost_model"):
        return m.instance.pool.block_size * ex.cost_model.model.kv_bytes_per_token
    return float(ex.kv_bytes_per_block)  # a real executor: its KV tensor's bytes per block


def can_migrate(req: Request, m: Member) -> bool:
    """A running request past its prompt (decoding), on ``m``: what Llumnix's migrate-out filter accepts."""
    return (
        req.state is RequestState.RUNNING
        and req in m.instance.scheduler.running
        and (req.num_computed_tokens >= req.num_prompt_tokens)
    )


class RequestMigrator:
    """Drives live migrations on a cluster's clock; ``start`` begins one, ``on_step`` stops at boundaries."""

    def __init__(self, cluster: Cluster, last_stage_max_blocks: int = 16, max_stages: int = 3) -> None:
        if last_stage_max_blocks < 1 or max_stages < 1:
            raise ValueError(
                f"last_stage_max_blocks, max_stages: must be >= 1, got {last_stage_max_blocks}, {max_stages}"
            )
        self.cluster = cluster
        self.last_stage_max_blocks = last_stage_max_blocks
        self.max_stages = max_stages
        self.active: dict[str, RequestMigration] = {}  # request id -> its migration in flight
        self.busy: set[int] = set()  # members in a migration (as source or destination)
        self.log: list[RequestMigration] = []

    # -- starting and stages ---------------------------------------------------------------------
    def start(self, req: Request, src: Member, dst: Member) -> RequestMigration | None:
        """Begin moving ``req`` (decoding on ``src``) to ``dst``; None if it cannot start (not decoding there,
        either member already migrating); a migration that aborts at once is logged with its reason."""
        if src is dst or src.index in self.busy or dst.index in self.busy or not can_migrate(req, src):
            return None
        if dst.instance.rejection_reason(req) is not None:  # could never hold it whole (a smaller pool)
            return None
        mig = RequestMigration(req, src, dst, self.cluster.loop.now, req.num_preemptions)
        self.active[req.request_id] = mig
        self.busy.update((src.index, dst.index))
        self.log.append(mig)
        self._copy_stage(mig, self._blocks(mig))
        return mig

    def _blocks(self, mig: RequestMigration) -> int:
        return mig.src.instance.pool.blocks_for_tokens(mig.req.num_computed_tokens)

    def _reserve(self, mig: RequestMigration, total_blocks: int) -> bool:
        more = total_blocks - mig.reserved_blocks
        if more > 0:
            if not mig.dst.instance.scheduler.reserve_blocks(mig.req.request_id, more):
                return False
            mig.reserved_blocks = total_blocks
        return True

    def _transfer_s(self, mig: RequestMigration, blocks: int) -> float:
        nbytes = blocks * block_bytes(mig.src)
        mig.bytes_moved += nbytes
        return self.cluster.topology.transfer_s(nbytes, mig.src.gpus, mig.dst.gpus)

    def _copy_stage(self, mig: RequestMigration, total_blocks: int) -> None:
        """Reserve up to ``total_blocks`` on the destination and copy the dirty ones (a pre-copy stage)."""
        if not self._reserve(mig, total_blocks):
            self._abort(mig, "dst_out_of_blocks")
            return
        dirty = total_blocks - mig.clean_blocks
        mig.stage_blocks.append(dirty)
        mig.clean_blocks = mig.req.num_computed_tokens // mig.src.instance.pool.block_size
        done = self.cluster.loop.now + self._transfer_s(mig, dirty)
        self.cluster.loop.at(done, self._stage_done, mig)

    def _gone(self, mig: RequestMigration) -> str | None:
        """Why the request can no longer move (finished, aborted, preempted on the source), or None."""
        req = mig.req
        if req.state is RequestState.ABORTED:
            return "aborted"
        if req.is_finished:
            return "finished"
        if req.num_preemptions != mig.preemptions or not can_migrate(req, mig.src):
            return "preempted"
        return None

    def _stage_done(self, mig: RequestMigration) -> None:
        reason = self._gone(mig)
        if reason is not None:
            self._abort(mig, reason)
            return
        total = self._blocks(mig)
        if total - mig.clean_blocks <= self.last_stage_max_blocks:
            mig.state = STOPPING
            if not mig.src.driver.busy:
                self._stop(mig)
            return  # else at the source's next step boundary (on_step)
        if len(mig.stage_blocks) >= self.max_stages:
            self._abort(mig, "not_converged")
            return
        self._copy_stage(mig, total)

    # -- stop-and-copy and commit ----------------------------------------------------------------
    def on_step(self, m: Member) -> None:
        """A step of ``m`` ended: a migration out of it waiting for a step boundary stops now."""
        if m.index not in self.busy:
            return
        for mig in list(self.active.values()):
            if mig.src is m and mig.state == STOPPING:
                self._stop(mig)

    def _stop(self, mig: RequestMigration) -> None:
        reason = self._gone(mig)
        if reason is not None:
            self._abort(mig, reason)
            return
        req, total = mig.req, self._blocks(mig)
        if not self._reserve(mig, total):
            self._abort(mig, "dst_out_of_blocks")
            return
        now = self.cluster.loop.now
        mig.state, mig.stop_s = FINAL, now
        mig.final_blocks = total - mig.clean_blocks
        mig.src.instance.scheduler.detach(req)
        mig.dst.instance.scheduler.admit_reserved(req, req.num_computed_tokens)
        self.cluster.assignment[req.request_id] = mig.dst.index  # where it lives now (abort finds it)
        link = self.cluster.topology.link_between(mig.src.gpus, mig.dst.gpus)
        pause = self._transfer_s(mig, mig.final_blocks) + default_sync_s(link)
        self.cluster.loop.at(now + pause, self._commit, mig)

    def _move_blocks(self, mig: RequestMigration) -> None:
        """Real executors: copy the KV from the source's held blocks to the destination's block table."""
        src, dst = mig.src.instance.executor, mig.dst.instance.executor
        if not (hasattr(src, "read_blocks") and hasattr(dst, "write_blocks")):
            return  # simulated: the bytes are the stages' time
        held = mig.src.instance.scheduler._held[mig.req.request_id]
        n = self._blocks(mig)
        dst.write_blocks(mig.req.block_ids[:n], src.read_blocks(held[:n]))

    def _commit(self, mig: RequestMigration) -> None:
        rid = mig.req.request_id
        if mig.req.state is RequestState.WAITING_FOR_KV:
            self._move_blocks(mig)
            mig.outcome = "committed"
        else:
            mig.outcome = "aborted"  # by the client during the stop-and-copy: both holds go now
        report_transfers(mig.src.instance, [], [rid])  # the source frees its blocks only now
        report_transfers(mig.dst.instance, [rid], [])  # the request runs on the destination
        self._end(mig)
        self.cluster.wake(mig.dst)
        self.cluster.wake(mig.src)

    def _abort(self, mig: RequestMigration, reason: str) -> None:
        """No copy is in flight: drop the destination's reservation; the request stays on the source."""
        if mig.reserved_blocks:
            report_transfers(mig.dst.instance, [mig.req.request_id], [])
        mig.outcome = reason
        self._end(mig)
        self.cluster.wake(mig.dst)

    def _end(self, mig: RequestMigration) -> None:
        mig.state, mig.end_s = DONE, self.cluster.loop.now
        del self.active[mig.req.request_id]
        self.busy.difference_update((mig.src.index, mig.dst.index))

    # -- reports ---------------------------------------------------------------------------------
    def summary(self) -> dict:
        return summarize_migrations(self.log)

    def check_drained(self) -> None:
        if self.active:
            raise RuntimeError(f"live migration: requests left migrating at the end: {list(self.active)[:5]}")


def summarize_migrations(log: list[RequestMigration]) -> dict:
    """The cluster summary's live-migration figures: committed moves, aborts by reason, bytes, pauses."""
    done = [m for m in log if m.outcome == "committed"]
    pauses = [m.pause_s for m in done]
    return {
        "request_migrations": len(done),
        "request_migration_aborts": dict(sorted(Counter(m.outcome for m in log if m not in done).items())),
        "request_migration_bytes": sum(m.bytes_moved for m in log),
        "request_migration_pause_s_total": sum(pauses),
        "request_migration_pause_s_mean": sum(pauses) / len(pauses) if pauses else 0.0,
        "request_migration_pause_s_max": max(pauses, default=0.0),
    }
