"""BanaServe's adaptive migration wired into a cluster: the ``on_tick`` controller and its config section.

Each control tick the controller hands the monitor's utilisation of one GPU per instance (an instance's
TP ranks are equally loaded) to ``AdaptiveMigrator.step`` with candidates priced from the instances'
latest batches (``migration_candidates.py``). A chosen move reserves its bytes on the destination
(``migration_memory.reserve_move``) and lands at its finish time (an event on the cluster's clock):
only then are the bytes committed (``commit_move``) and the source's ``MigratedStepModel`` switched to
the pipeline / attention-split step time (``migrated_step.py``); service never stops meanwhile. An
instance takes part in at most one landed move (as source or helper). Every move is recorded (time,
kind, source, destination, bytes, duration) in ``log``.

Block pools follow a layer move (``migration_memory.layer_move_blocks``): when it starts, the helper's pool
gives up the blocks that will hold the moved weights and the moved layers' part of every source block
(free or idle cached blocks only, at most ``helper_kv_lend_fraction`` of its pool; a layer move the helper
cannot cover is not a candidate); when it lands, the source's pool grows, its blocks now holding ``k`` of
``L`` layers. An attention-level move keeps both pools' sizes (the helper's ledger holds the moved heads'
K/V; the source's blocks keep their full size). The ledger (``memory``) keeps the bytes, per move in ``log``.

With ``role_flip`` (``cluster/role_flip.py``) each tick first asks whether a whole instance should change
role between prefill and decode (the load's mix shifted); a flip and a move are never decided in the same
tick, and an instance engaged in a move does not flip. Every tick is recorded in ``trace``: the utilisation
of each GPU the policy saw, the imbalance signal, the per-role signals, and the decision taken or skipped with
its reason (``trace_dict()`` for results and plots).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvbalance.cluster.migrated_step import AttentionSplit, LayerSplit, MigratedStepModel
from kvbalance.cluster.migration import LAYER, AdaptiveMigrator, Migration, MigrationConfig
from kvbalance.cluster.migration_candidates import GPUState, candidates_from
from kvbalance.cluster.migration_memory import (
    GPUMemory,
    commit_move,
    kv_capacity_tokens,
    layer_move_blocks,
    reserve_move,
)
from kvbalance.cluster.monitor import GPUUtilization
from kvbalance.cluster.resident_drain import ResidentDrain, final_tokens
from kvbalance.cluster.role_flip import MemberSignal, RoleFlipConfig, RoleFlipPolicy
from kvbalance.cluster.whatif_phase_oracle import PhaseOracle, PhaseOraclePolicy

if TYPE_CHECKING:
    from kvbalance.cluster.core import Cluster, Member


_DEFAULTS = MigrationConfig()
_FLIP = RoleFlipConfig()
_SECTION_ONLY = {"window_s", "control_interval_s", "helper_kv_lend_fraction", "role_flip", "moves", "flip_start_util",
                 "flip_decode_start_util", "flip_min_gain", "flip_cooldown_s", "ttft_slo_s", "tpot_slo_s",
                 "drain_residents", "drain_free", "flip_oracle"}  # fmt: skip


class MigrationSection(BaseModel):
    """The ``migration:`` section: ``MigrationConfig``'s thresholds plus the monitor's window and tick."""

    model_config = ConfigDict(extra="forbid")

    # the thresholds' defaults (and why each) live in MigrationConfig, the one source
    start_imbalance: float = _DEFAULTS.start_imbalance
    stop_imbalance: float = _DEFAULTS.stop_imbalance
    layer_imbalance: float = _DEFAULTS.layer_imbalance
    min_gain: float = _DEFAULTS.min_gain
    cooldown_s: float = _DEFAULTS.cooldown_s
    max_transfer_s: float = _DEFAULTS.max_transfer_s
    min_coverage: float = _DEFAULTS.min_coverage
    memory_bound_share: float = _DEFAULTS.memory_bound_share
    min_source_queue: float = _DEFAULTS.min_source_queue
    window_s: float = Field(2.0, gt=0)
    control_interval_s: float = Field(0.5, gt=0)
    # share of a helper's KV pool a layer move may take (moved weights + moved layers' KV): the helper was
    # picked because it is underused, not idle; keeping half lets it absorb a doubling of its own load
    helper_kv_lend_fraction: float = Field(0.5, ge=0, le=1)
    # role flips of whole instances between prefill and decode (cluster/role_flip.py); off by default: the
    # layer- and attention-level moves alone are BanaServe's algorithm as published
    role_flip: bool = Field(
        False, description="flip whole instances between prefill and decode (role_flip.py)"
    )
    moves: bool = Field(True, description="layer- and attention-level moves (False: role flips only)")
    flip_start_util: float = Field(
        _FLIP.start_util, ge=0, description="role flips: the peak role load below which nothing flips"
    )
    flip_decode_start_util: float = Field(
        _FLIP.decode_start_util,
        ge=0,
        description="role flips: the decode pressure a flip to decode waits for",
    )
    flip_min_gain: float = Field(
        _FLIP.min_gain, ge=0, description="role flips: least drop of the peak a flip must give"
    )
    flip_cooldown_s: float = Field(
        _FLIP.cooldown_s, ge=0, description="role flips: seconds between two flips"
    )
    # a decode instance flipped to prefill hands its running decodes (their KV) to decode instances with room
    # (cluster/resident_drain.py); drain_free is a what-if (copies take no time), never a system's setting
    drain_residents: bool = Field(
        False, description="role flips: move a flipped decode instance's residents (resident_drain.py)"
    )
    drain_free: bool = Field(False, description="what-if: resident moves take no time (an upper bound)")
    # what-if: flips follow the load's known phase schedule (whatif_phase_oracle.py), not its measured load
    flip_oracle: PhaseOracle | None = Field(
        None, description="what-if: flip by this known phase schedule (whatif_phase_oracle.py), not by load"
    )
    ttft_slo_s: float | None = Field(
        None,
        gt=0,
        description="TTFT the flip signals are measured against (default: the simulate config's, else 1 s)",
    )
    tpot_slo_s: float | None = Field(
        None,
        gt=0,
        description="TPOT the flip signals are measured against (default: the simulate config's, else 0.1 s)",
    )

    @model_validator(mode="after")
    def _valid(self) -> MigrationSection:
        self.to_config()  # MigrationConfig's checks name the field
        return self

    def to_config(self) -> MigrationConfig:
        return MigrationConfig(**self.model_dump(exclude=_SECTION_ONLY))

    def flip_config(self) -> RoleFlipConfig:
        return RoleFlipConfig(
            start_util=self.flip_start_util,
            min_gain=self.flip_min_gain,
            cooldown_s=self.flip_cooldown_s,
            decode_start_util=self.flip_decode_start_util,
        )


def _step_model(m: Member) -> MigratedStepModel:
    ex = m.instance.executor
    if not isinstance(ex.step_model, MigratedStepModel):
        ex.step_model = MigratedStepModel(ex.cost_model, ex.step_model)
    return ex.step_model


class MigrationController:
    """The cluster's ``on_tick``: decides, starts and lands BanaServe migrations between members."""

    def __init__(self, cluster: Cluster, section: MigrationSection) -> None:
        from kvbalance.cluster.core import gpu_name

        self.cluster = cluster
        self.migrator = AdaptiveMigrator(section.to_config(), window_s=section.window_s)
        self.gpu_of = {gpu_name(m.gpus[0]): m for m in cluster.members}
        # the migrated step models (only where moves can happen: role flips leave step times alone)
        self.models = {m.index: _step_model(m) for m in cluster.members} if section.moves else {}
        self.helper_of: dict[int, Member] = {}  # source member index -> its helper
        self.engaged: set[int] = set()  # members in a landed or in-flight move
        self.memory: dict[str, GPUMemory] = {}
        self.log: list[dict] = []
        self._moved_rids: dict[str, int] = {}
        self._decode_step_s: dict[int, float] = {}  # member index -> start of its latest step with decodes
        self.window_s = section.window_s
        self.lend_fraction = section.helper_kv_lend_fraction
        self._s_per_token: dict[int, float] = {}  # member index -> prefill seconds per token (cost model)
        # source member index -> (its pool size once its layer move lands, the helper's pool size before)
        self._pool_plan: dict[int, tuple[int, int]] = {}
        self.ttft_slo_s = section.ttft_slo_s or 1.0
        self.tpot_slo_s = section.tpot_slo_s or 0.1
        pd = any(m.role != "colocated" for m in cluster.members)
        self.flips = None
        if section.role_flip and pd:
            self.flips = (
                PhaseOraclePolicy(section.flip_oracle, self.ttft_slo_s)
                if section.flip_oracle is not None
                else RoleFlipPolicy(section.flip_config(), self.ttft_slo_s)
            )
        self.moves = section.moves
        self.drain = (
            ResidentDrain(cluster, self.tpot_slo_s, free=section.drain_free)
            if section.drain_residents and self.flips is not None
            else None
        )
        self._seen: set[str] = set()  # requests seen on any member (for ``_handoff_util``)
        self._handoffs: deque[tuple[float, float, float]] = deque()  # (seen at, KV-token-seconds, life s)
        self.trace: list[tuple] = []  # per tick: (t, utils, imbalance, flip signals, action, reason)
        for g, m in self.gpu_of.items():
            cm = m.instance.executor.cost_model
            self.memory[g] = GPUMemory(cm.gpu.mem_capacity_bytes, cm.model.weight_bytes // cm.tp)

    # -- the tick --------------------------------------------------------------------------------------
    def __call__(self, cluster: Cluster, now: float, snap: dict[str, GPUUtilization]) -> None:
        backlog = {m.index: self._backlog_s(m) for m in cluster.members}
        seen = {
            g: replace(snap[g], queue_util=backlog[m.index] / self.window_s) for g, m in self.gpu_of.items()
        }
        utils = {g: u for g, u in seen.items() if self.gpu_of[g].index not in self.engaged}
        signals = None
        if self.flips is not None:
            flip, signals = self._flip(cluster, now, seen, backlog)
            if flip.action != "none":
                self._record(now, seen, None, signals, flip.action, f"{flip.member}: {flip.reason}")
                return
            if not self.moves:
                self._record(now, seen, None, signals, "none", flip.reason)
                return
        if not self.moves:
            self._record(now, seen, None, signals, "none", "layer and attention moves off")
            return
        if len(utils) < 2:
            self._record(now, seen, None, signals, "none", "fewer than two instances free to move")
            return
        d, mig = self.migrator.step(now, utils, lambda: self._candidates(utils), on_finish=self._apply)
        self._record(now, seen, d.imbalance, signals, d.action, d.reason)
        if mig is None:
            return
        c = mig.candidate
        if c.kind == LAYER and not self._lend_blocks(c):  # the helper's free blocks went meanwhile
            self.migrator.cancel(mig, now)
            return
        self.memory[c.dst] = reserve_move(self.memory[c.dst], c.weight_bytes, c.kv_bytes)
        self.engaged |= {self.gpu_of[c.src].index, self.gpu_of[c.dst].index}
        if c.kind != LAYER:
            self._moved_rids = dict(self._snapshot_decodes(self.gpu_of[c.src]))
        cluster.loop.at(mig.finish_s, self.migrator.advance, mig.finish_s)

    def _record(self, now, seen, imbalance, signals, action, reason) -> None:
        sig = None if signals is None else (signals.prefill_queue_s, signals.prefill_util, signals.decode_util,
                                            signals.num_prefill, signals.handoff_util)  # fmt: skip
        self.trace.append((now, [seen[g].combined for g in self.gpu_of], imbalance, sig, action, reason))

    def trace_dict(self) -> dict:
        """The trace as columns: per-GPU utilisation, imbalance, flip signals, decisions and their reasons."""
        t = self.trace
        sig = [x[3] for x in t]
        return {
            "gpus": list(self.gpu_of),
            "instances": [m.name for m in self.gpu_of.values()],
            "t_s": [x[0] for x in t],
            "util": [x[1] for x in t],  # one list per tick, in ``gpus`` order
            "imbalance": [x[2] for x in t],
            "prefill_queue_ttft": [s[0] if s else None for s in sig],
            "prefill_util": [s[1] if s else None for s in sig],
            "decode_util": [s[2] if s else None for s in sig],
            "num_prefill": [s[3] if s else None for s in sig],
            "handoff_util": [s[4] if s else None for s in sig],
            "action": [x[4] for x in t],
            "reason": [x[5] for x in t],
        }

    # -- role flips ----------------------------------------------------------------------------------
    def _decode_pressure(self, m: Member, now: float, kv_util: float) -> float:
        """max(KV occupancy, the occupancy its requests will average from now on, mean step time over the
        window / TPOT SLO, requests there over its batch slots). The second term looks ahead: a request's KV grows linearly from what it holds to
        prompt + output, so the requests there (running and waiting) average ``(held + at the end) / 2``;
        occupancy alone rose only as a decode-heavy period's requests grew, seconds after they arrived, and
        the flips came late. (Counting hand-offs waiting there as full pressure was tried: one usually
        waits a step for admission, and the signal flickered. Without the slots term, on Alpaca bursts the
        decode instances looked idle (KV 5% used) while 480 requests waited for the 256 slots of one, and
        flips to prefill took decode capacity that was needed: 965 vs 1,293 req/s at SLO.)"""
        ld = m.instance.load()
        cap = ld.kv_capacity_tokens or 1
        final = ld.kv_used_tokens + ld.remaining_output_tokens + ld.queued_prefill_tokens
        ahead = (ld.kv_used_tokens + final) / 2 / cap
        # batch slots: short requests bind on the batch size before KV (Alpaca: 256 running, KV a few % used)
        slots = (ld.num_running + ld.num_waiting + ld.num_loading) / m.instance.config.max_num_seqs
        step = self._mean_step_s(m, now) / self.tpot_slo_s
        return max(kv_util, ahead, step, slots)

    def _mean_step_s(self, m: Member, now: float) -> float:
        """``m``'s mean step time over the monitor's window (0 if it did not step)."""
        starts, durs = m.step_starts_s, m.step_durations_s
        total = n = 0
        i = len(starts) - 1
        while i >= 0 and starts[i] >= now - self.window_s:
            total += durs[i]
            n += 1
            i -= 1
        return total / n if n else 0.0

    def _prefill_credit(self, m: Member, now: float) -> float:
        """The share of a prefill instance's prompt throughput decode member ``m`` gives once flipped: its
        residents stay and decode in every step, so a 512-token chunk (``c`` seconds) comes with their decode
        step (``d``, its mean step time now): ``c / (c + d)``; 1 once none is left."""
        ld = m.instance.load()
        if not ld.num_running + ld.num_waiting + ld.num_loading:
            return 1.0
        c = 512 * self._prefill_s_per_token(m)
        return c / (c + self._mean_step_s(m, now))

    def _handoff_util(self, cluster: Cluster, now: float) -> float:
        """Decode pressure per decode instance that the requests of the last window bring in steady state
        (Little's law): a request lives ``max_tokens`` decode steps of the decode role's mean step time,
        holding on average its prompt plus half its output in KV and one batch slot; the KV-seconds and
        slot-seconds arriving per second, over the decode instances' KV and slots. A request counts when it is
        first seen at a tick on any member, most often queued on a prefill member: the hand-offs to come,
        not only those made (at a switch to long prompts the prompts queue, and hand-offs counted as they
        landed lagged the arrivals by seconds: flips left too few decode instances for them). One that came
        and went within a tick is missed (a few tokens' KV)."""
        dec = [m for m in cluster.members if m.role == "decode"]
        steps = [s for s in (self._mean_step_s(m, now) for m in dec) if s > 0]
        step_s = sum(steps) / len(steps) if steps else self.tpot_slo_s
        pd = cluster.pd
        for m in cluster.members:
            sched = m.instance.scheduler
            for r in (*sched.running, *sched.waiting, *sched.loading.values()):
                if r.request_id not in self._seen:
                    self._seen.add(r.request_id)
                    out = pd.output_budget(r) if pd is not None else r.max_tokens
                    life_s = out * step_s
                    self._handoffs.append((now, (r.num_prompt_tokens + out / 2) * life_s, life_s))
        while self._handoffs and self._handoffs[0][0] <= now - self.window_s:
            self._handoffs.popleft()
        if not dec or not self._handoffs:
            return 0.0
        cap = sum(m.instance.load().kv_capacity_tokens for m in dec) or 1
        slots = sum(m.instance.config.max_num_seqs for m in dec)
        kv_s = sum(h[1] for h in self._handoffs) / self.window_s
        slot_s = sum(h[2] for h in self._handoffs) / self.window_s
        return max(kv_s / cap, slot_s / slots)

    def _flip(self, cluster: Cluster, now: float, seen: dict, backlog: dict):
        sigs = []
        for g, m in self.gpu_of.items():
            u = seen[g]
            if m.role == "prefill":
                # queued prompt compute counts up to one window: past it the queue says "short", not how much
                util = u.time_util + min(u.queue_util or 0.0, 1.0)
            else:
                util = self._decode_pressure(m, now, u.kv_util)
            ld = m.instance.load()
            credit = self._prefill_credit(m, now) if m.role == "decode" else 1.0
            sigs.append(MemberSignal(m.name, m.role, util, backlog[m.index],
                                     ld.num_running + ld.num_waiting + ld.num_loading,
                                     m.index not in self.engaged, credit))  # fmt: skip
        if self.drain is not None:
            sigs = self._drained_signals(cluster, now, sigs)
        d, signals = self.flips.decide(now, sigs, self._handoff_util(cluster, now))
        if d.action != "none":
            m = next(x for x in cluster.members if x.name == d.member)
            cluster.set_role(m, "prefill" if d.action == "to_prefill" else "decode", d.reason)
            self.flips.flipped(now)
            if self.drain is not None and m.role == "prefill":
                self.drain.drain(m)
            # the what-if oracle may take several flips in one tick (role_log records each)
            if getattr(self.flips, "more_flips", lambda _: False)(now):
                self._flip(cluster, now, seen, backlog)
        return d, signals

    def _drained_signals(self, cluster: Cluster, now: float, sigs: list[MemberSignal]) -> list[MemberSignal]:
        """With resident drain: the decode instance a flip to prefill would take (the policy's pick) counts for
        the prompt throughput the residents that cannot move leave, and the others for the pressure the
        moved ones bring them (``drain_util``: their KV at the end of their answers and their slots, over the
        others' capacity)."""
        pick = RoleFlipPolicy._pick(sigs, "decode")
        if pick is None:
            return sigs
        m = next(x for x in cluster.members if x.name == pick.name)
        res = self.drain.residents(m)
        if not res:
            return sigs
        where = self.drain.plan(m)
        stay = len(res) - len(where)
        moved = [r for r in res if r.request_id in where]
        rest = self.drain.destinations(m)
        cap = sum(x.instance.kv_capacity_tokens for x in rest) or 1
        slots = sum(x.instance.config.max_num_seqs for x in rest) or 1
        kv = sum((r.num_computed_tokens + final_tokens(r)) / 2 for r in moved)
        drain_util = max(kv / cap, len(moved) / slots)
        credit = pick.prefill_credit if stay else 1.0
        return [replace(s, prefill_credit=credit, drain_util=drain_util) if s is pick else s for s in sigs]

    def _backlog_s(self, m: Member) -> float:
        """Seconds of prefill compute queued on ``m``: prompt tokens not yet computed (waiting requests and
        running chunked prefills) at the cost model's per-token time of a 512-token chunk."""
        sched = m.instance.scheduler
        tokens = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        tokens += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.running)
        if not tokens:
            return 0.0
        return tokens * self._prefill_s_per_token(m)

    def _prefill_s_per_token(self, m: Member) -> float:
        """Prefill seconds per token on ``m``: the cost model's time of a 512-token chunk over 512."""
        if m.index not in self._s_per_token:
            cm = m.instance.executor.cost_model
            self._s_per_token[m.index] = cm.step_seconds([(512, 512, True)]) / 512
        return self._s_per_token[m.index]

    def _state(self, g: str, u: GPUUtilization) -> GPUState:
        m = self.gpu_of[g]
        model = self.models[m.index]
        load = m.instance.load()
        ex = m.instance.executor
        kv_used = int(load.kv_used_tokens * ex.cost_model.kv_bytes_per_token)
        mem = self.memory[g]
        room = mem.capacity_bytes - mem.weight_bytes - mem.reserved_bytes
        mem = GPUMemory(mem.capacity_bytes, mem.weight_bytes, min(kv_used, room), mem.reserved_bytes)
        self.memory[g] = mem
        batch = model.last_seqs
        if self._decode_step_s.get(m.index, -1.0) >= self.cluster.loop.now - self.window_s:
            batch = model.last_decode_seqs  # a recent step with decodes represents a mixed instance
        decodes = [c for n, c, _ in batch if n == 1]
        dur = m.step_durations_s[-1] if m.step_durations_s else 0.0
        return GPUState(
            g,
            ex.cost_model,
            u.combined,
            mem,
            batch,
            kv_tokens=sum(decodes) if decodes else load.kv_used_tokens,
            decode_tokens_per_s=len(decodes) / dur if dur > 0 else 0.0,
        )

    def _candidates(self, utils: dict[str, GPUUtilization]):
        states = {g: self._state(g, u) for g, u in utils.items()}
        hot = max(sorted(utils), key=lambda g: utils[g].combined)
        helpers = [states[g] for g in sorted(states, key=lambda g: utils[g].combined)]
        topo = self.cluster.topology
        out = []
        memo: dict = {}  # prices of the hot batch's moves, per helper hardware and link
        for h in helpers:
            if h.gpu == hot:
                continue
            link = topo.link_between(self.gpu_of[hot].gpus, self.gpu_of[h.gpu].gpus)
            out += candidates_from(states[hot], [h], link, memo)
        return [c for c in out if c.kind != LAYER or self._pool_sizes(c) is not None]

    def _pool_sizes(self, c) -> tuple[int, int] | None:
        """(blocks the helper lends, the source's pool size after) for layer move ``c``, or None."""
        src, dst = self.gpu_of[c.src].instance, self.gpu_of[c.dst].instance
        block_bytes = src.pool.block_size * src.executor.cost_model.kv_bytes_per_token
        return layer_move_blocks(
            src.pool.num_blocks, dst.kv.num_available_blocks, dst.pool.num_blocks, block_bytes, c.weight_bytes,
            c.layers[0], src.executor.cost_model.model.num_layers, self.lend_fraction,
        )  # fmt: skip

    def _lend_blocks(self, c) -> bool:
        """At a layer move's start: the helper's pool gives up its blocks (False: it no longer can)."""
        sizes = self._pool_sizes(c)
        dst = self.gpu_of[c.dst].instance
        before = dst.pool.num_blocks
        if sizes is None or not dst.kv.resize(before - sizes[0]):
            return False
        dst.max_request_blocks = min(dst.max_request_blocks, dst.pool.num_blocks)
        self._pool_plan[self.gpu_of[c.src].index] = (sizes[1], before)
        return True

    def _snapshot_decodes(self, m: Member) -> list[tuple[str, int]]:
        model = self.models[m.index]
        pairs = zip(model.last_decode_rids, model.last_decode_seqs, strict=True)
        return [(rid, c) for rid, (n, c, _) in pairs if n == 1]

    # -- landing -------------------------------------------------------------------------------------
    def _apply(self, mig: Migration) -> None:
        c = mig.candidate
        src, dst = self.gpu_of[c.src], self.gpu_of[c.dst]
        self.memory[c.src], self.memory[c.dst] = commit_move(
            self._owned(c.src, c.kv_bytes), self.memory[c.dst], c.weight_bytes, c.kv_bytes
        )
        link = self.cluster.topology.link_between(src.gpus, dst.gpus)
        helper_cm = dst.instance.executor.cost_model
        model = self.models[src.index]
        pools = (src.instance.pool.num_blocks, dst.instance.pool.num_blocks)
        if c.kind == LAYER:
            model.layer = LayerSplit(helper_cm, c.layers[0], link)
            size, dst_before = self._pool_plan.pop(src.index)
            pools = (pools[0], dst_before)
            if not src.instance.kv.resize(size):  # a block now holds k of L layers: the pool only grows
                raise RuntimeError(f"{src.name}: pool resize to {size} blocks failed after a layer move")
        else:
            kv_on_gpu = max(helper_cm.model.num_kv_heads // helper_cm.tp, 1)
            model.attention = AttentionSplit(helper_cm, c.kv_heads / kv_on_gpu, link, self._moved_rids)
        self.helper_of[src.index] = dst
        cm = src.instance.executor.cost_model
        per_tok = cm.kv_bytes_per_token
        frac_home = c.layers[0] / cm.model.num_layers if c.layers else 1.0
        self.log.append(
            {
                "start_s": mig.start_s,
                "finish_s": mig.finish_s,
                "duration_s": mig.finish_s - mig.start_s,
                "kind": c.kind,
                "src": src.name,
                "dst": dst.name,
                "bytes": c.weight_bytes + c.kv_bytes,
                "weight_bytes": c.weight_bytes,
                "layers": list(c.layers) if c.layers else None,
                "kv_heads": c.kv_heads,
                "src_kv_capacity_tokens": kv_capacity_tokens(self.memory[c.src], per_tok * frac_home),
                "dst_kv_capacity_tokens": kv_capacity_tokens(self.memory[c.dst], per_tok),
                "src_pool_blocks": [pools[0], src.instance.pool.num_blocks],  # before, after
                "dst_pool_blocks": [pools[1], dst.instance.pool.num_blocks],
            }
        )

    def _owned(self, g: str, kv_bytes: int) -> GPUMemory:
        """The source's ledger with at least the moved KV counted as held (it was, when the move began)."""
        mem = self.memory[g]
        if mem.kv_bytes >= kv_bytes:
            return mem
        return GPUMemory(mem.capacity_bytes, mem.weight_bytes, kv_bytes, mem.reserved_bytes)

    # -- the cluster's step hook -----------------------------------------------------------------------
    def on_step(self, m: Member, start_s: float) -> None:
        """Charge the helper GPU its share of ``m``'s step (monitor track and busy time)."""
        from kvbalance.cluster.core import gpu_name

        if self.drain is not None:
            self.drain.on_step(m)
        helper = self.helper_of.get(m.index)
        if not self.moves:
            return
        model = self.models[m.index]
        if model.last_had_decodes:
            self._decode_step_s[m.index] = start_s
        m.waited_s += model.last_wait_s
        share = model.last_helper
        if helper is None or share is None:
            return
        d = share.compute_s + share.memory_s + share.overhead_s + share.comm_s
        helper.helper_durations_s.append(d)
        if helper.driver is not None and helper.driver.busy:
            self.models[helper.index].pending_s += d  # time-shared with the helper's own step
        for g in helper.gpus:
            self.cluster.monitor.record_share(gpu_name(g), start_s, share, d)
