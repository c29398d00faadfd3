"""Discrete-event simulation: an event heap on a simulated clock, and the single-instance driver.

Time advances by the executor's predicted step durations. Events at the same time run in the
order they were scheduled, so the same seed and config give the same result bit for bit.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvbalance.engine import Instance, StepColumns, StepOutcome
from kvbalance.executor.sim import decode_runs_enabled, fast_paths_enabled
from kvbalance.request import Request, RequestState


class EventLoop:
    """A heap of (time, order, callback, args).

    Events scheduled with :meth:`at_quiet` promise to read or change only what their scheduler tracks itself
    (an instance driver's own steps, a cluster's arrivals); every other event (:meth:`at`) is "loud": it may
    touch any instance, and :meth:`next_loud_time` says when the next one comes (an instance running ahead of
    the clock stops before it)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._order = itertools.count()
        self._loud: list[tuple[float, int]] = []  # (time, order) of pending loud events
        self.loud_done = 0  # loud events run so far

    def at(self, time_s: float, fn: Callable, *args) -> None:
        if time_s < self.now:
            raise ValueError(f"time_s: event at {time_s} is in the past (now {self.now})")
        order = next(self._order)
        heapq.heappush(self._heap, (time_s, order, fn, args))
        heapq.heappush(self._loud, (time_s, order))

    def at_quiet(self, time_s: float, fn: Callable, *args) -> None:
        """:meth:`at` for an event that touches only what its scheduler accounts for itself."""
        if time_s < self.now:
            raise ValueError(f"time_s: event at {time_s} is in the past (now {self.now})")
        heapq.heappush(self._heap, (time_s, next(self._order), fn, args))

    def next_time(self) -> float:
        """Time of the earliest pending event (inf: none)."""
        return self._heap[0][0] if self._heap else math.inf

    def next_loud_time(self) -> float:
        """Time of the earliest pending loud event (inf: none)."""
        return self._loud[0][0] if self._loud else math.inf

    def run(self, until: float | None = None) -> None:
        """Run the events in time order (those at or before ``until``, if given).

        Python's cyclic garbage collector is paused meanwhile (``gc.disable``, its state restored after): a
        simulation allocates millions of short-lived objects while it keeps every request it has seen, so each
        full collection rescans a heap that only grows (a fifth of a 100k-request, 16-instance run's time:
        benchmarks/sim_speed.py cluster16). The few reference cycles it makes are collected once the collector
        runs again."""
        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            self._run(until)
        finally:
            if paused:
                gc.enable()

    def _run(self, until: float | None) -> None:
        heap = self._heap
        loud = self._loud
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            t, order, fn, args = heapq.heappop(heap)
            if loud and loud[0][1] == order:
                heapq.heappop(loud)
                self.loud_done += 1
            self.now = t
            fn(*args)

    def __len__(self) -> int:
        return len(self._heap)


@dataclass
class SimRun:
    requests: list[Request]
    makespan_s: float
    num_steps: int
    step_times_s: list[float] = field(default_factory=list)
    unfinished: list[Request] = field(default_factory=list)


class InstanceDriver:
    """Drives one Instance on an EventLoop: arrivals join its queue; it steps back to back while busy.

    With ``horizon`` (a function giving the time of the next event that can read or change this instance:
    an arrival, a transfer, a controller's tick), runs of decode-only steps that nothing can change before
    it are simulated in one event (``Instance.decode_run``, exact: the same result as step by step); the
    ``on_step`` hook still sees every step. None (the default) steps one event at a time.

    With ``ahead`` (a function giving the time of the next event that can read or change this instance, where
    nothing else shares state with it but through ``on_step`` and ``on_finish`` hooks that only record), every
    step that ends before it runs in the same event, as its own event would (exact: the same result as step
    by step; only the order of hook calls across instances differs).
    """

    def __init__(
        self,
        loop: EventLoop,
        instance: Instance,
        *,
        on_step: Callable[[InstanceDriver, StepOutcome, float], None] | None = None,
        on_finish: Callable[[Request], None] | None = None,
        horizon: Callable[[], float] | None = None,
        ahead: Callable[[], float] | None = None,
        on_steps: Callable[..., None] | None = None,
    ) -> None:
        self.loop = loop
        self.instance = instance
        self.busy = False
        self.on_step = on_step
        self.on_finish = on_finish
        self.horizon = horizon
        self.ahead = ahead
        # with ``ahead``: a recorder of steps as columns (``StepColumns``), called once per event, instead of
        # ``on_step`` for the steps run ahead (for an ``on_step`` that only records)
        self.on_steps = on_steps
        self.run_end_s = -math.inf  # end of the last decode run simulated ahead of the clock
        # with ``ahead``: ``cross(start_s, end_s, running, waiting, loading)``, asked when a planned step would end
        # at or after the horizon (its counts those during the step): a later horizon where the instance
        # provably has no part in what the horizon stands for (an arrival routed elsewhere, ``Cluster``), the
        # step then run and the run going on, or None (the step's end an event of its own); ``cohort_cross``
        # the same for the cohort's steps (``Scheduler.cohort_run``)
        self.cross: Callable[..., float | None] | None = None
        self.cohort_cross: Callable[[float, float, int], float | None] | None = None
        self.on_idle: Callable[[], None] | None = None  # with ``ahead``: told when a run ahead ends idle
        self.decode_run_steps = 0

    def arrive(self, req: Request) -> None:
        if not self.instance.add_request(req, self.loop.now):
            if self.on_finish:
                self.on_finish(req)
            return
        if not self.busy:
            self.kick()

    def kick(self) -> None:
        if self.ahead is not None:
            self._kick_ahead()
            return
        if self.horizon is not None:
            end = self.instance.decode_run(self.loop.now, self.horizon(), self._run_step)
            if end is not None:
                self.busy = True
                self.run_end_s = end
                self.loop.at_quiet(end, self.kick)
                return
        outcome = self.instance.step(self.loop.now)
        if outcome is None:
            self.busy = False
            return
        self.busy = True
        self.loop.at_quiet(self.loop.now + outcome.result.duration_s, self._done, outcome)

    def _kick_ahead(self) -> None:
        inst = self.instance
        t = self.loop.now
        horizon = self.ahead()
        on_step, on_finish = self.on_step, self.on_finish

        def run_step(outcome: StepOutcome, end_s: float) -> None:
            if on_step:
                on_step(self, outcome, end_s)

        def run_finish(req: Request) -> None:
            if on_finish:
                on_finish(req)

        cohort = inst.scheduler.cohort_size is not None
        cols = StepColumns() if self.on_steps is not None else None
        sched = inst.scheduler
        cross, cohort_cross = self.cross, self.cohort_cross
        try:
            while True:
                begun = False
                if cohort:
                    # the step that ends at or after the horizon begun without a plan if it is the cohort's
                    t_run, outcome = inst.cohort_run_begin(
                        t, horizon, run_step, run_finish, cols, cohort_cross
                    )
                    if t_run != t:
                        self.busy = True
                        self.run_end_s = t = t_run
                        if cohort_cross is not None:  # the run may have gone past the horizon
                            horizon = self.ahead()
                    if outcome is None:
                        outcome = inst.step(t)
                    else:
                        begun = True
                else:
                    outcome = inst.step(t)
                if outcome is None:
                    self.busy = False
                    if self.on_idle is not None:
                        self.on_idle()
                    return
                end = t + outcome.result.duration_s
                if not end < horizon:
                    h = None
                    if cross is not None and not begun:  # (a begun step was asked in the run)
                        h = cross(t, end, sched.num_running, sched.num_waiting, sched.num_loading)
                    if h is None:  # the step's end is an event of its own, after what comes before it
                        self.busy = True
                        self.loop.at_quiet(end, self._done, outcome)
                        return
                    horizon = h
                self.busy = True
                self.run_end_s = end
                finished = inst.complete(outcome, end)
                if cols is not None:
                    cols.add(outcome.start_s, outcome.result.duration_s, outcome.plan.num_tokens,
                             sched.num_running, sched.num_waiting, sched.kv_used_tokens)  # fmt: skip
                elif on_step:
                    on_step(self, outcome, end)
                if on_finish:
                    for req in finished:
                        on_finish(req)
                t = end
        finally:
            if cols:
                self.on_steps(cols)

    def _run_step(self, outcome: StepOutcome, end_s: float) -> None:
        self.decode_run_steps += 1
        if self.on_step:
            self.on_step(self, outcome, end_s)

    def _done(self, outcome: StepOutcome) -> None:
        now = self.loop.now
        finished = self.instance.complete(outcome, now)
        if self.on_step:
            self.on_step(self, outcome, now)
        if self.on_finish:
            for req in finished:
                self.on_finish(req)
        self.kick()


def simulate_instance(
    instance: Instance,
    requests: Iterable[Request],
    *,
    on_step: Callable | None = None,
    on_finish: Callable[[Request], None] | None = None,
    check_invariants: bool = False,
    decode_runs: bool | None = None,
    decode_cohort: bool | None = None,
) -> SimRun:
    """Replay ``requests`` (with their ``arrival_s``) against one instance until all are done.

    ``decode_runs`` (default: ``KVBALANCE_SIM_DECODE_RUNS=1``, see ``executor.sim.decode_runs_enabled``; off
    with ``check_invariants``, which checks after every step): decode-only steps between arrivals in one event
    per run, exactly. ``decode_cohort`` (default: the fast paths on, ``KVBALANCE_SIM_FAST``, without decode runs
    or ``check_invariants``): plain decodes as a cohort (``Instance.enable_decode_cohort``), exactly; ``on_step``
    hooks then read the instance's counts, not its running requests' token lists."""
    if decode_runs is None:
        decode_runs = decode_runs_enabled()
    if decode_cohort is None:
        decode_cohort = fast_paths_enabled() and not decode_runs and not check_invariants
    loop = EventLoop()
    ahead = None
    if decode_cohort and instance.enable_decode_cohort():
        ahead = loop.next_time  # nothing but arrivals and this driver's steps on this loop
    reqs = list(requests)
    step_times: list[float] = []

    def _on_step(driver, outcome, now):
        step_times.append(outcome.result.duration_s)
        if check_invariants:
            driver.instance.check_invariants()
        if on_step:
            on_step(driver, outcome, now)

    horizon = loop.next_time if decode_runs and not check_invariants else None
    driver = InstanceDriver(
        loop, instance, on_step=_on_step, on_finish=on_finish, horizon=horizon, ahead=ahead
    )
    for req in reqs:
        loop.at(req.arrival_s, driver.arrive, req)
    loop.run()
    first = min((r.arrival_s for r in reqs), default=0.0)
    last = max((r.finish_s for r in reqs if r.finish_s is not None), default=first)
    unfinished = [
        r for r in reqs if r.state not in (RequestState.FINISHED, RequestState.REJECTED, RequestState.ABORTED)
    ]
    return SimRun(reqs, last - first, instance.num_steps, step_times, unfinished)
