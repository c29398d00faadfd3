"""Llumnix's (OSDI '24) global scheduler over colocated instances: periodic freeness-based pairing and the
choice of the request to migrate, driving ``request_migration.RequestMigrator``.

Every ``pair_interval_s`` (Algorithm of §4.4, its code's ``defrag`` pair policy and ``load`` migrate-out
filter): each instance's freeness (``routers/llumnix.freeness_blocks``) is computed; sources are those below
``migrate_out_threshold_blocks`` or that preempted a request since the last round, destinations those above
it that preempted none; sources sorted least free first and destinations freest first are paired i-th with
i-th. On each pair's source the request to move is chosen by ``request_policy`` among the running requests
past their prompt: ``SR`` (Llumnix's default) the shortest one (fewest tokens: cheapest to move), ``LR``
the longest (frees the most), ``LCR`` the last one to start running. An instance takes part in one
migration at a time (``MAX_MIGRATION_CONCURRENCY`` 1). New requests go to the freest instance (router
``llumnix``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvbalance.cluster.request_migration import RequestMigrator, can_migrate
from kvbalance.cluster.routers.llumnix import freeness_blocks

if TYPE_CHECKING:
    from kvbalance.cluster.core import Cluster, Member
    from kvbalance.request import Request


class LlumnixSection(BaseModel):
    """The ``llumnix:`` section of a cluster config. Defaults are Llumnix's (its ``config/default.py``)."""

    model_config = ConfigDict(extra="forbid")

    # POLLING_INTERVAL 0.05 s x PAIR_MIGRATION_FREQUENCY 1: pair every polling round
    pair_interval_s: float = Field(0.05, gt=0)
    # MIGRATE_OUT_THRESHOLD -3.0 on the load -remaining_steps: freeness below 3 blocks/request migrates out
    migrate_out_threshold_blocks: float = 3.0
    # REQUEST_MIGRATION_POLICY 'SR': the shortest running request
    request_policy: Literal["SR", "LR", "LCR"] = "SR"
    # MIGRATION_MAX_STAGES 3: drop a migration whose pre-copy has not converged after 3 stages
    max_stages: int = Field(3, ge=1)
    # MIGRATION_LAST_STAGE_MAX_BLOCKS 16: stop-and-copy once at most 16 blocks are left to copy
    last_stage_max_blocks: int = Field(16, ge=1)


def choose_request(m: Member, policy: str) -> Request | None:
    """The request ``policy`` migrates out of ``m`` (running, past its prompt), or None."""
    cands = [r for r in m.instance.scheduler.running if can_migrate(r, m)]
    if not cands:
        return None
    if policy == "LCR":
        return cands[-1]
    if policy == "LR":
        return max(cands, key=lambda r: r.num_tokens)  # first of the longest on ties
    return min(cands, key=lambda r: r.num_tokens)


class LlumnixController:
    """Pairs instances and starts migrations every ``pair_interval_s`` on the cluster's clock."""

    def __init__(self, cluster: Cluster, section: LlumnixSection) -> None:
        if any(m.role != "colocated" for m in cluster.members):
            raise ValueError("llumnix: live migration runs between colocated instances only")
        self.cluster = cluster
        self.section = section
        self.migrator = RequestMigrator(cluster, section.last_stage_max_blocks, section.max_stages)
        self._preemptions = {m.index: 0 for m in cluster.members}
        self._ticking = False  # a pairing round is scheduled

    def pairs(self) -> list[tuple[Member, Member]]:
        """This round's (source, destination) pairs among members not already migrating."""
        c, thr = self.cluster, self.section.migrate_out_threshold_blocks
        free: dict[int, float] = {}
        killed: dict[int, bool] = {}
        for m in c.members:
            ld = c.load(m)
            free[m.index] = freeness_blocks(ld, c.block_size)
            killed[m.index] = ld.num_preemptions > self._preemptions[m.index]
            self._preemptions[m.index] = ld.num_preemptions
        idle = [m for m in c.members if m.index not in self.migrator.busy]
        srcs = sorted(
            (m for m in idle if killed[m.index] or free[m.index] < thr), key=lambda m: free[m.index]
        )
        dsts = sorted(
            (m for m in idle if not killed[m.index] and free[m.index] > thr), key=lambda m: -free[m.index]
        )
        return list(zip(srcs, dsts))

    def tick(self) -> None:
        for src, dst in self.pairs():
            req = choose_request(src, self.section.request_policy)
            if req is not None:
                self.migrator.start(req, src, dst)
        c = self.cluster
        # tick while there is something to move; the next step anywhere starts it again (``on_step``), so a
        # run with other periodic events (the utilisation monitor) still ends
        self._ticking = bool(self.migrator.active) or any(m.instance.has_work() for m in c.members)
        if self._ticking:
            c.loop.at(c.loop.now + self.section.pair_interval_s, self.tick)

    def on_step(self, m: Member) -> None:
        self.migrator.on_step(m)
        if not self._ticking:
            self._ticking = True
            self.cluster.loop.at(self.cluster.loop.now, self.tick)

    def summary(self) -> dict:
        return self.migrator.summary()

    def check_drained(self) -> None:
        self.migrator.check_drained()
