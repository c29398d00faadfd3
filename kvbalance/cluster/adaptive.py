"""BanaServe's adaptive migration wired into a cluster: the ``on_tick`` controller and its config section.

Each control tick the controller hands the monitor's utilisation of one GPU per instance (an instance's
TP ranks are equally loaded) to ``AdaptiveMigrator.step`` with candidates priced from the instances'
latest batches (``migration_candidates.py``). A chosen move reserves its bytes on the destination
(``migration_memory.reserve_move``) and lands at its finish time (an event on the cluster's clock):
only then are the bytes committed (``commit_move``) and the source's ``MigratedStepModel`` switched to
the pipeline / attention-split step time (``migrated_step.py``); service never stops meanwhile. An
instance takes part in at most one landed move (as source or helper). Every move is recorded (time,
kind, source, destination, bytes, duration) in ``log``.

Not modelled: the block pools keep their size after a layer move; the ledger (``memory``) holds what
each GPU's KV capacity becomes (``kv_capacity_tokens``), reported per move.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvbalance.cluster.migrated_step import AttentionSplit, LayerSplit, MigratedStepModel
from kvbalance.cluster.migration import LAYER, AdaptiveMigrator, Migration, MigrationConfig
from kvbalance.cluster.migration_candidates import GPUState, candidates_from
from kvbalance.cluster.migration_memory import GPUMemory, commit_move, kv_capacity_tokens, reserve_move
from kvbalance.cluster.monitor import GPUUtilization

if TYPE_CHECKING:
    from kvbalance.cluster.core import Cluster, Member


class MigrationSection(BaseModel):
    """The ``migration:`` section: ``MigrationConfig``'s thresholds plus the monitor's window and tick."""

    model_config = ConfigDict(extra="forbid")

    start_imbalance: float = 0.25
    stop_imbalance: float = 0.10
    layer_imbalance: float = 0.50
    min_gain: float = 0.05
    cooldown_s: float = 4.0
    max_transfer_s: float = 2.0
    min_coverage: float = 1.0
    memory_bound_share: float = 0.5
    window_s: float = Field(2.0, gt=0)
    control_interval_s: float = Field(0.5, gt=0)

    @model_validator(mode="after")
    def _valid(self) -> MigrationSection:
        self.to_config()  # MigrationConfig's checks name the field
        return self

    def to_config(self) -> MigrationConfig:
        return MigrationConfig(**self.model_dump(exclude={"window_s", "control_interval_s"}))


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
        self.models = {m.index: _step_model(m) for m in cluster.members}
        self.helper_of: dict[int, Member] = {}  # source member index -> its helper
        self.engaged: set[int] = set()  # members in a landed or in-flight move
        self.memory: dict[str, GPUMemory] = {}
        self.log: list[dict] = []
        self._moved_rids: dict[str, int] = {}
        self._decode_step_s: dict[int, float] = {}  # member index -> start of its latest step with decodes
        self.window_s = section.window_s
        for g, m in self.gpu_of.items():
            cm = m.instance.executor.cost_model
            self.memory[g] = GPUMemory(cm.gpu.mem_capacity_bytes, cm.model.weight_bytes // cm.tp)

    # -- the tick --------------------------------------------------------------------------------------
    def __call__(self, cluster: Cluster, now: float, snap: dict[str, GPUUtilization]) -> None:
        utils = {g: snap[g] for g, m in self.gpu_of.items() if m.index not in self.engaged}
        if len(utils) < 2:
            return
        _, mig = self.migrator.step(now, utils, lambda: self._candidates(utils), on_finish=self._apply)
        if mig is None:
            return
        c = mig.candidate
        self.memory[c.dst] = reserve_move(self.memory[c.dst], c.weight_bytes, c.kv_bytes)
        self.engaged |= {self.gpu_of[c.src].index, self.gpu_of[c.dst].index}
        if c.kind != LAYER:
            self._moved_rids = dict(self._snapshot_decodes(self.gpu_of[c.src]))
        cluster.loop.at(mig.finish_s, self.migrator.advance, mig.finish_s)

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
        for h in helpers:
            if h.gpu == hot:
                continue
            link = topo.link_between(self.gpu_of[hot].gpus, self.gpu_of[h.gpu].gpus)
            out += candidates_from(states[hot], [h], link)
        return out

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
        if c.kind == LAYER:
            model.layer = LayerSplit(helper_cm, c.layers[0], link)
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
                "layers": list(c.layers) if c.layers else None,
                "kv_heads": c.kv_heads,
                "src_kv_capacity_tokens": kv_capacity_tokens(self.memory[c.src], per_tok * frac_home),
                "dst_kv_capacity_tokens": kv_capacity_tokens(self.memory[c.dst], per_tok),
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

        helper = self.helper_of.get(m.index)
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
