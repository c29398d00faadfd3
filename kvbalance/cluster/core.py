"""A cluster of instances on one simulated clock: roles, routing, P/D hand-off, per-instance utilisation.

Each member is a backbone ``Instance`` with a role — ``colocated`` (prefill and decode), ``prefill`` or
``decode`` — on a tuple of GPUs of the ``Topology`` (its tensor-parallel group). New requests go to a
prefill or colocated member chosen by the router (``cluster/routers``) from ``Instance.load()`` snapshots;
on disaggregated deployments a prefilled request's KV moves to a decode member through the P/D connector
(``cluster/disagg.py``); with a global KV store (``kvcache/store.py``) prefill and colocated members save
prompts to it and fetch stored prefixes from it (``cluster/store_connector.py``). All members share one ``EventLoop`` (``sim/loop.py``, which stays single-instance:
one ``InstanceDriver`` per member), so the same seed gives the same run bit for bit.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

from kvbalance.cluster.connector import ClusterConnector
from kvbalance.cluster.lazy_load import LazyLoad
from kvbalance.cluster.member import ROLES, ClusterRun, Member, Role, gpu_name  # noqa: F401 (re-exported)
from kvbalance.cluster.monitor import UtilizationMonitor
from kvbalance.cluster.route_ahead import RouteAhead
from kvbalance.cluster.routers import Router, build_router
from kvbalance.cluster.topology import Topology
from kvbalance.engine import InstanceLoad, StepColumns, StepOutcome
from kvbalance.executor.sim import decode_runs_enabled, fast_paths_enabled
from kvbalance.kvcache.store import GlobalKVStore
from kvbalance.request import Request, RequestState
from kvbalance.sim.loop import EventLoop, InstanceDriver
from kvbalance.sim.run import SimulateConfig, build_sim_instance


class Cluster:
    """Members on one clock behind a router; ``run(requests)`` serves them all and returns a ``ClusterRun``.

    ``router`` picks among prefill and colocated members; ``decode_router`` (default ``least_loaded``)
    among decode members when a prefilled request's KV is handed off. ``pd_options`` go to the P/D
    connector (e.g. ``layerwise_transfer``).
    """

    def __init__(
        self,
        members: Sequence[Member],
        topology: Topology,
        *,
        router: str | Router = "least_loaded",
        router_options: dict[str, Any] | None = None,
        decode_router: str | Router = "least_loaded",
        pd_options: dict[str, Any] | None = None,
        store: GlobalKVStore | None = None,
        check_invariants: bool = False,
        on_finish: Callable[[Request], None] | None = None,
        monitor: UtilizationMonitor | None = None,
        control_interval_s: float = 0.5,
        on_tick: Callable[[Cluster, float, dict], None] | None = None,
        migration: Any = None,
        llumnix: Any = None,
    ) -> None:
        self.members = list(members)
        if not self.members:
            raise ValueError("members: a cluster needs at least one instance")
        self.topology = topology
        for m in self.members:
            for g in m.gpus:
                topology.node_of(g)  # validates the index
        self.loop = EventLoop()
        self._refresh_roles()
        has_prefill = any(m.role == "prefill" for m in self.members)
        if not self.frontends:
            raise ValueError("members: need at least one prefill or colocated instance")
        if has_prefill != bool(self.decoders):
            raise ValueError("members: prefill instances need decode instances and vice versa")
        bs = self.members[0].instance.pool.block_size
        if any(m.instance.pool.block_size != bs for m in self.members):
            raise ValueError("block_size: every instance of a cluster must use the same KV block size")
        self.block_size = bs
        self.router = (
            router if isinstance(router, Router) else build_router(router, bs, **(router_options or {}))
        )
        self.decode_router = (
            decode_router if isinstance(decode_router, Router) else build_router(decode_router, bs)
        )
        self.check_invariants = check_invariants
        self.on_finish = on_finish  # called once per request as it finishes (or is rejected)
        self.assignment: dict[str, int] = {}
        self.decode_assignment: dict[str, int] = {}
        self.pd = None
        if self.decoders:
            from kvbalance.cluster.disagg import PDConnector

            self.pd = PDConnector(self, **(pd_options or {}))
        self.store = None
        if store is not None:
            from kvbalance.cluster.store_connector import StoreConnector

            self.store = StoreConnector(self, store)
        for m in self.members:
            conn = m.instance.scheduler.connector
            if isinstance(conn, ClusterConnector):
                conn.cluster, conn.member = self, m
            elif m.role != "colocated" or self.store is not None:
                raise ValueError(
                    f"members: {m.name} was built without a ClusterConnector (use cluster.core.sim_member)"
                )
        # per-GPU utilisation (``cluster/monitor.py``) sampled every ``control_interval_s``; ``on_tick`` is
        # where a controller acts on it. ``migration`` (a ``MigrationSection``): BanaServe's adaptive
        # migration (``cluster/adaptive.py``) as the on_tick, with its own monitor window and interval.
        self.migration = None
        if migration is not None:
            if on_tick is not None:
                raise ValueError("on_tick: migration brings its own controller; pass one or the other")
            monitor = monitor or UtilizationMonitor(migration.window_s)
            control_interval_s = migration.control_interval_s
        self.monitor = monitor
        self.control_interval_s = control_interval_s
        self.on_tick = on_tick
        if monitor is not None:
            if not control_interval_s > 0:
                raise ValueError(f"control_interval_s: must be > 0, got {control_interval_s}")
            for m in self.members:
                for g in m.gpus:
                    monitor.add_gpu(gpu_name(g))
        if migration is not None:
            from kvbalance.cluster.adaptive import MigrationController

            self.migration = self.on_tick = MigrationController(self, migration)
        self.llumnix = (
            None  # ``llumnix`` (a ``LlumnixSection``): request-level live migration (cluster/llumnix.py)
        )
        if llumnix is not None:
            from kvbalance.cluster.llumnix import LlumnixController

            self.llumnix = LlumnixController(self, llumnix)
        self.role_log: list[dict] = []  # role flips: time, member, from, to, what it held then
        # decode runs (sim/loop.py, exact) where arrivals are all that reads or changes a member from outside: no
        # P/D hand-off, store, monitor or live migration, no per-step invariant checks
        self._arrivals: list[float] = []  # pending arrival times (a heap): the members' horizon
        outside = (self.pd, self.store, self.monitor, self.llumnix)
        runs = decode_runs_enabled() and not check_invariants and all(x is None for x in outside)
        # the decode cohort (scheduler/cohort.py, exact) where nothing else reads a member's running requests
        cohort = (
            fast_paths_enabled() and not runs and not check_invariants and all(x is None for x in outside)
        )
        self._running = False
        self._arrival_times: list[float] = []  # pending and past arrival times, sorted
        self._arrived = 0  # arrivals routed so far
        for m in self.members:
            m.driver = InstanceDriver(
                self.loop, m.instance, on_step=self._step_hook(m), on_finish=self._finish_hook(m),
                horizon=self._next_arrival_s if runs else None,
            )  # fmt: skip
            # a member runs ahead of the clock to its own next arrival where the router says which that is
            # without reading loads (round robin) and nothing is called back on finishes
            if cohort and m.instance.enable_decode_cohort() and on_finish is None and m.role == "colocated":
                m.driver.ahead = self._own_arrival_s(m)
                if self.migration is None and self.llumnix is None:  # the step hook only records
                    m.driver.on_steps = self._steps_recorder(m)
        # behind a router of counts (least_loaded), where every member runs ahead: a member runs past arrivals
        # it can prove go to others, the router reading its counts then (``cluster/route_ahead.py``)
        self.route_ahead: RouteAhead | None = None
        weights = self.router.count_weights
        if weights is not None and len(self.frontends) > 1 and all(m.driver.ahead for m in self.members):
            ra = self.route_ahead = RouteAhead(self, weights)
            for i, m in enumerate(self.frontends):
                m.driver.ahead = ra.horizon(i)
                m.driver.cross = m.driver.cohort_cross = ra.crosser(i)
                m.driver.on_idle = ra.idle(i)

    def _next_arrival_s(self) -> float:
        return self._arrivals[0] if self._arrivals else math.inf

    def _own_arrival_s(self, m: Member) -> Callable[[], float]:
        """The time of the next arrival routed to ``m`` (the next arrival's where the router cannot say), or of
        the next loud event on the loop (``EventLoop.at``: a test's abort, a controller) if that comes first."""
        times = self._arrival_times
        loop = self.loop

        def horizon() -> float:
            i = self._front_pos.get(id(m))  # (by identity: a dataclass's == compares every field)
            k = None if i is None else self.router.arrivals_elsewhere(i, len(self.frontends))
            if k is None:
                own = self._next_arrival_s()
            else:
                j = self._arrived + k
                own = times[j] if j < len(times) else math.inf
            loud = loop.next_loud_time()
            return own if own < loud else loud

        return horizon

    # -- roles ------------------------------------------------------------------
    def _refresh_roles(self) -> None:
        self.frontends = [m for m in self.members if m.role in ("colocated", "prefill")]
        self._front_pos = {id(m): i for i, m in enumerate(self.frontends)}  # a member's place among them
        self.decoders = [m for m in self.members if m.role == "decode"]

    def set_role(self, m: Member, role: Role, reason: str = "") -> None:
        """Flip a P/D member between ``prefill`` and ``decode``. Only where new work goes changes: requests
        already queued or running on ``m`` finish as they began (a prefill begun there is still handed off,
        a hand-off addressed to it is still loaded and decoded there), so nothing moves and no block changes
        hands. At least one member of each role must remain."""
        if m.role == role:
            return
        if {m.role, role} != {"prefill", "decode"}:
            raise ValueError(f"role: only prefill <-> decode flips, not {m.role} -> {role}")
        left = [x for x in self.members if x.role == m.role and x is not m]
        if not left:
            raise ValueError(f"role: {m.name} is the last {m.role} instance")
        load = m.instance.load()
        self.role_log.append({"t_s": self.loop.now, "instance": m.name, "from": m.role, "to": role,
                              "reason": reason, "running": load.num_running, "waiting": load.num_waiting,
                              "kv_used_tokens": load.kv_used_tokens})  # fmt: skip
        m.role = role
        self._refresh_roles()

    # -- loads ------------------------------------------------------------------
    def load(self, m: Member) -> InstanceLoad:
        """``Instance.load()``: requests whose KV is arriving count as ``num_loading`` there. Lazy
        (``cluster/lazy_load.py``): token sums are computed only if the router reads them."""
        return LazyLoad(m.instance)  # type: ignore[return-value]

    def loads(self, members: Sequence[Member]) -> list[InstanceLoad]:
        return [self.load(m) for m in members]

    def hit_rates(self) -> dict[str, float | None]:
        """Prefix-cache hit ratios, each in [0, 1]: ``prefix_hit_rate`` over the admissions that compute a
        prompt (colocated and prefill members, recomputes anywhere): local-cache tokens / tokens admitted;
        ``store_hit_rate``: tokens fetched from the global store over the same; ``decode_local_hit_rate``: of
        the prompt tokens handed off to decode members, those their own cache already held (no transfer).
        A P/D request is admitted twice (prefill, then decode), so pooling both counted its prompt once and
        its hits twice (ratios over 1)."""
        scheds = [m.instance.scheduler for m in self.members]
        hit = sum(s.prefix_hit_tokens for s in scheds)
        admitted = sum(s.admitted_tokens for s in scheds)
        d_hit = self.pd.decode_hit_tokens if self.pd is not None else 0
        d_adm = self.pd.decode_admitted_tokens if self.pd is not None else 0
        computed = admitted - d_adm
        fetched = self.store.fetched_tokens if self.store is not None else 0
        return {
            "prefix_hit_rate": (hit - d_hit) / computed if computed else None,
            "store_hit_rate": fetched / computed if computed and self.store is not None else None,
            "decode_local_hit_rate": d_hit / d_adm if d_adm else None,
        }

    def check_member(self, m: Member) -> None:
        """Block accounting of one member (with the P/D hand-off's holds counted as holders)."""
        m.instance.check_invariants()  # the scheduler counts blocks held for saves and loads

    # -- events -----------------------------------------------------------------
    def _arrive(self, req: Request) -> None:
        heapq.heappop(self._arrivals)
        j = self._arrived
        self._arrived += 1
        ra = self.route_ahead
        # (members that ran past it: their counts then)
        loads = self.loads(self.frontends) if ra is None else ra.loads(j)
        i = self.router.choose(req, loads)
        if ra is not None:
            ra.routed(j, i, req)
        m = self.frontends[i]
        self.assignment[req.request_id] = m.index
        if m.role == "prefill":
            reason = self.pd.rejection_reason(req)
            if reason is not None:
                req.state, req.reject_reason, req.finish_s = RequestState.REJECTED, reason, self.loop.now
                self._finished(req)
                return
            self.pd.begin_prefill(req)
        m.driver.arrive(req)
        if ra is not None:
            ra.refresh(i)  # its bound with the request (where it did not run on and stop)

    def _step_hook(self, m: Member) -> Callable:
        tl = m.timeline
        inst = m.instance
        sched = inst.scheduler

        def on_step(driver: InstanceDriver, outcome: StepOutcome, now: float) -> None:
            m.step_starts_s.append(outcome.start_s)
            m.step_durations_s.append(outcome.result.duration_s)
            tl.record(
                outcome.start_s,
                sched.num_running,
                sched.num_waiting,
                sched.kv_used_tokens,
                inst.kv_capacity_tokens,
                outcome.plan.num_tokens,
                outcome.result.duration_s,
            )
            if self.monitor is not None:
                kv = inst.kv_used_tokens / inst.kv_capacity_tokens if inst.kv_capacity_tokens else 0.0
                for g in m.gpus:
                    self.monitor.record_step(gpu_name(g), outcome.start_s, outcome.result.breakdown,
                                             outcome.result.duration_s)  # fmt: skip
                    self.monitor.record_kv(gpu_name(g), min(1.0, kv))
            if self.migration is not None:
                self.migration.on_step(m, outcome.start_s)
            if self.llumnix is not None:
                self.llumnix.on_step(m)
            if self.pd is not None:
                self.pd.on_step(m, outcome)
            if self.store is not None and m.role != "decode":
                self.store.on_step(m, outcome)
            if self.check_invariants:
                self.check_member(m)

        return on_step

    def _steps_recorder(self, m: Member) -> Callable:
        """The step hook's recording, for steps run ahead as columns (``StepColumns``)."""
        tl = m.timeline
        cap = m.instance.kv_capacity_tokens

        def on_steps(cols: StepColumns) -> None:
            m.step_starts_s.extend(cols.starts_s)
            m.step_durations_s.extend(cols.durations_s)
            tl.record_steps(cols.starts_s, cols.running, cols.waiting, cols.kv_used_tokens, cap,
                            cols.batch_tokens, cols.durations_s)  # fmt: skip

        return on_steps

    def _finish_hook(self, m: Member) -> Callable:
        def on_finish(req: Request) -> None:
            if self.pd is not None and self.pd.handles(req):
                self.pd.prefill_done(m, req)
                return
            self._finished(req)

        return on_finish

    def wake(self, m: Member) -> None:
        """A transfer landed on an idle member: let it step again."""
        if not m.driver.busy and m.instance.has_work():
            m.driver.kick()

    def _finished(self, req: Request) -> None:
        if self.on_finish is not None:
            self.on_finish(req)

    def abort(self, req: Request) -> None:
        """Client abort, wherever the request is: queued or running on its prefill (or colocated) member,
        waiting for or loading its KV on a decode member, or decoding. Blocks a transfer still uses are
        held until it lands; nothing is lost or freed twice."""
        if req.is_finished:
            return
        now = self.loop.now
        rid = req.request_id
        dst = self.decode_assignment.get(rid)
        if dst is not None:
            self.members[dst].instance.abort(req, now)
            if self.pd is not None:
                self.pd.aborted_on_decode(req)
        elif rid in self.assignment:
            src = self.members[self.assignment[rid]]
            src.instance.abort(req, now)
            if self.pd is not None and self.pd.handles(req):
                self.pd.aborted_on_prefill(src, req)
        self._finished(req)

    # -- running ----------------------------------------------------------------
    def _tick(self) -> None:
        """Sample the monitor (kept in its history) and run the controller, while anything is left to do."""
        now = self.loop.now
        snap = self.monitor.sample(now)
        if self.on_tick is not None:
            self.on_tick(self, now, snap)
        if len(self.loop):  # other events pending: the run is not over
            self.loop.at(now + self.control_interval_s, self._tick)

    def submit(self, req: Request) -> None:
        ahead = max(m.driver.run_end_s for m in self.members) if self._running else -math.inf
        if self._running and self.route_ahead is not None:
            ahead = max(ahead, self.route_ahead.passed_until_s())
        if req.arrival_s < ahead:  # a decode run or a run ahead (``InstanceDriver.ahead``) passed it
            raise ValueError(f"arrival_s: {req.request_id} at {req.arrival_s} falls inside a decode run already "
                             f"simulated (to {ahead}); submit arrivals before run(), or unset KVBALANCE_SIM_DECODE_RUNS")  # fmt: skip
        self.loop.at_quiet(req.arrival_s, self._arrive, req)  # the members' horizons account for arrivals
        heapq.heappush(self._arrivals, req.arrival_s)
        index = bisect.bisect_right(self._arrival_times, req.arrival_s)  # (after those at the same time)
        self._arrival_times.insert(index, req.arrival_s)
        if self.route_ahead is not None:
            self.route_ahead.submitted(index, req)

    def run(self, requests: Sequence[Request]) -> ClusterRun:
        reqs = list(requests)
        for req in reqs:
            self.submit(req)
        if self.monitor is not None:
            self.loop.at(self.loop.now, self._tick)
        self._running = True
        if self.route_ahead is not None:
            self.route_ahead.start()
        try:
            self.loop.run()
        finally:
            self._running = False
        drain = self.migration.drain if self.migration is not None else None
        for conn in (self.pd, self.store, self.llumnix, drain):
            if conn is not None:
                conn.check_drained()
        first = min((r.arrival_s for r in reqs), default=0.0)
        last = max((r.finish_s for r in reqs if r.finish_s is not None), default=first)
        span = last - first if last > first else math.inf
        log = list(self.migration.log) if self.migration is not None else []
        return ClusterRun(reqs, self.members, dict(self.assignment), dict(self.decode_assignment), span, log)


def sim_member(
    index: int,
    role: Role,
    gpus: tuple[int, ...],
    sim: SimulateConfig,
    name: str | None = None,
    cost_models: dict | None = None,
) -> Member:
    """A member on the cost model: ``sim``'s instance with ``tp = len(gpus)`` and the cluster's connector.
    ``cost_models``: shared with the other members (``build_sim_instance``)."""
    inst, _ = build_sim_instance(
        sim.model_copy(update={"tp": len(gpus)}), ClusterConnector(None, role), cost_models
    )
    inst.name = name or f"{role}-{index}"
    return Member(index, role, tuple(gpus), inst)
