"""Per-GPU utilisation over a sliding window, the signal BanaServe's adaptive migration acts on.

Each step a GPU runs is recorded with its start time and its :class:`~kvbalance.batch.StepBreakdown`;
over the window ``[now - window_s, now]`` the monitor sums the compute-bound and the memory-bound
seconds of the steps (a step straddling the window's edge counts pro rata) and divides by the window's
wall time. The combined utilisation is ``max(compute + memory time fraction + queue, KV occupancy)``: a
GPU is as loaded as its scarcer resource, its time on operators or its KV memory. ``queue_util`` (set by
the migration controller, ``None`` when unknown) is the work queued there, in seconds of compute over the
window: busy time saturates at 1 on any GPU that has a request (continuous batching steps back to back),
so it cannot tell a GPU that keeps up from one that falls behind; the queue can.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvbalance.batch import StepBreakdown


@dataclass(frozen=True, slots=True)
class GPUUtilization:
    """One GPU over the window. Fractions of the window's wall time (``covered_s``)."""

    gpu: str
    compute_util: float  # seconds of compute-bound operators / window
    memory_util: float  # seconds of memory-bound operators / window
    busy_util: float  # seconds in any step (operators, overheads, communication) / window
    kv_util: float  # latest KV occupancy reported (0 when none)
    covered_s: float  # wall time the window spans (less than window_s while warming up)
    queue_util: float | None = None  # seconds of queued work / window (None: not measured)

    @property
    def time_util(self) -> float:
        return self.compute_util + self.memory_util

    @property
    def combined(self) -> float:
        """BanaServe's U_g: the binding resource, operator time (plus queued work) or KV memory."""
        return max(self.time_util + (self.queue_util or 0.0), self.kv_util)

    @property
    def memory_share(self) -> float:
        """Share of operator time that is memory-bound (0.5 when idle: neither side dominates)."""
        t = self.time_util
        return self.memory_util / t if t > 0 else 0.5

    @property
    def memory_bound(self) -> bool:
        """Memory is binding: memory-bound operators dominate or KV occupancy sets the combined value."""
        return self.memory_share > 0.5 or (self.kv_util > 0 and self.kv_util >= self.combined)


@dataclass(slots=True)
class _Step:
    start_s: float
    end_s: float
    compute_s: float
    memory_s: float


@dataclass
class _Track:
    since_s: float
    steps: deque = field(default_factory=deque)  # in start order
    kv_util: float = 0.0
    last_start_s: float | None = None  # of the latest step recorded with ``record_step``


class UtilizationMonitor:
    """Sliding-window utilisation of each GPU. Record steps in start order per GPU."""

    def __init__(self, window_s: float = 2.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s: must be > 0, got {window_s!r}")
        self.window_s = window_s
        self._tracks: dict[str, _Track] = {}
        self.history: list[tuple[float, dict[str, GPUUtilization]]] = []  # from sample(): plots, reports

    @property
    def gpus(self) -> list[str]:
        return list(self._tracks)

    def add_gpu(self, gpu: str, now: float = 0.0) -> None:
        """Start watching ``gpu`` at ``now`` (idle time from then on counts as idle)."""
        if gpu in self._tracks:
            raise ValueError(f"gpu: {gpu!r} is already monitored")
        self._tracks[gpu] = _Track(since_s=now)

    def _track(self, gpu: str) -> _Track:
        if gpu not in self._tracks:
            raise ValueError(f"gpu: {gpu!r} is not monitored (known: {', '.join(self._tracks) or 'none'})")
        return self._tracks[gpu]

    def record_step(
        self, gpu: str, start_s: float, breakdown: StepBreakdown, duration_s: float | None = None
    ) -> None:
        """A step on ``gpu`` from ``start_s`` lasting ``duration_s`` (default: the breakdown's parts)."""
        tr = self._track(gpu)
        d = (
            breakdown.compute_s
            + breakdown.memory_s
            + breakdown.overhead_s
            + breakdown.comm_s
            + breakdown.transfer_s
            if duration_s is None
            else duration_s
        )
        if d < 0 or breakdown.compute_s < 0 or breakdown.memory_s < 0:
            raise ValueError(f"duration_s: a step cannot take negative time ({d}, breakdown {breakdown})")
        if tr.last_start_s is not None and start_s < tr.last_start_s:
            raise ValueError(
                f"start_s: {start_s} is before the previous step's start {tr.last_start_s} on {gpu!r}"
            )
        tr.last_start_s = start_s
        self._insert(gpu, tr, start_s, d, breakdown)

    def record_share(self, gpu: str, start_s: float, breakdown: StepBreakdown, duration_s: float) -> None:
        """Work ``gpu`` does for another instance's step (a migration's helper): any order in time."""
        if duration_s < 0 or breakdown.compute_s < 0 or breakdown.memory_s < 0:
            raise ValueError(f"duration_s: a share cannot take negative time ({duration_s}, {breakdown})")
        self._insert(gpu, self._track(gpu), start_s, duration_s, breakdown)

    @staticmethod
    def _insert(gpu: str, tr: _Track, start_s: float, d: float, breakdown: StepBreakdown) -> None:
        if start_s < tr.since_s:
            raise ValueError(f"start_s: {start_s} is before {gpu!r} was added at {tr.since_s}")
        step = _Step(start_s, start_s + d, breakdown.compute_s, breakdown.memory_s)
        i = len(tr.steps)
        while i > 0 and tr.steps[i - 1].start_s > start_s:
            i -= 1  # recorded steps arrive nearly in order: few to walk past
        tr.steps.insert(i, step)

    def record_kv(self, gpu: str, kv_utilization: float) -> None:
        """Latest KV occupancy of ``gpu`` (used / capacity of its KV pool, e.g. ``InstanceLoad.kv_utilization``)."""
        if not 0 <= kv_utilization <= 1:
            raise ValueError(f"kv_utilization: must be in [0, 1], got {kv_utilization!r}")
        self._track(gpu).kv_util = kv_utilization

    def utilization(self, gpu: str, now: float) -> GPUUtilization:
        tr = self._track(gpu)
        lo = max(now - self.window_s, tr.since_s)
        while tr.steps and tr.steps[0].end_s <= now - self.window_s:
            tr.steps.popleft()  # wholly before every window still to come (queries move forward)
        span = max(now - lo, 0.0)
        compute = memory = busy = 0.0
        for s in tr.steps:
            if s.start_s >= now:
                break
            overlap = min(s.end_s, now) - max(s.start_s, lo)
            if overlap <= 0:
                continue
            length = s.end_s - s.start_s
            frac = overlap / length if length > 0 else 0.0
            compute += s.compute_s * frac
            memory += s.memory_s * frac
            busy += overlap
        if span == 0:
            return GPUUtilization(gpu, 0.0, 0.0, 0.0, tr.kv_util, 0.0)
        return GPUUtilization(gpu, compute / span, memory / span, busy / span, tr.kv_util, span)

    def snapshot(self, now: float) -> dict[str, GPUUtilization]:
        return {g: self.utilization(g, now) for g in self._tracks}

    def sample(self, now: float) -> dict[str, GPUUtilization]:
        """A snapshot, also kept in ``history`` (utilisation over time)."""
        snap = self.snapshot(now)
        self.history.append((now, snap))
        return snap
