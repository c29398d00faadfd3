"""A cluster's members (an ``Instance`` with a role on a tuple of GPUs) and what one run of them returns
(``ClusterRun``: finished requests, per-instance rows, busy fractions over time, hot-spot ratios)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvbalance.cluster.utilization import busy_fraction, busy_fraction_series, hot_spot_ratio
from kvbalance.engine import Instance
from kvbalance.metrics.timeline import Timeline
from kvbalance.request import Request
from kvbalance.sim.loop import InstanceDriver

Role = Literal["colocated", "prefill", "decode"]


def gpu_name(g: int) -> str:
    """The monitor's name of GPU ``g``."""
    return f"gpu{g}"


ROLES = ("colocated", "prefill", "decode")


@dataclass
class Member:
    """One instance of the cluster, its role and GPUs, and what it did (steps, for busy fractions)."""

    index: int
    role: Role
    gpus: tuple[int, ...]
    instance: Instance
    timeline: Timeline = field(init=False)
    step_starts_s: list[float] = field(default_factory=list)
    step_durations_s: list[float] = field(default_factory=list)
    helper_durations_s: list[float] = field(default_factory=list)  # its share of a migrated member's steps
    waited_s: float = 0.0  # of its steps' time, spent waiting on a helper GPU (not busy here)
    driver: InstanceDriver | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.gpus:
            raise ValueError(f"gpus: member {self.index} has no GPU")
        self.timeline = Timeline(self.instance.name)

    @property
    def name(self) -> str:
        return self.instance.name


@dataclass
class ClusterRun:
    """Result of ``Cluster.run``: the requests, the members, and where each request was routed."""

    requests: list[Request]
    members: list[Member]
    assignment: dict[str, int]  # request id -> member index of its prefill (or colocated) instance
    decode_assignment: dict[str, int]  # request id -> member index of its decode instance (P/D only)
    span_s: float  # first arrival -> last finish
    migrations: list[dict] = field(default_factory=list)  # landed migrations (cluster/adaptive.py's log)

    @property
    def timelines(self) -> list[Timeline]:
        return [m.timeline for m in self.members]

    def busy_fractions(self) -> dict[str, float]:
        return {
            m.name: busy_fraction(m.step_durations_s + m.helper_durations_s, self.span_s)
            - (m.waited_s / self.span_s if self.span_s > 0 else 0.0)
            for m in self.members
        }

    def hot_spot_ratio(self) -> dict[str, float]:
        """max / min busy fraction across members of the same role."""
        return hot_spot_ratio(self.busy_fractions(), {m.name: m.role for m in self.members})

    def busy_series(self, window_s: float) -> dict[str, tuple[Any, Any]]:
        """Per member: (window start times, busy fraction per window) over the run."""
        end = max((r.finish_s or 0.0) for r in self.requests) if self.requests else 0.0
        return {
            m.name: busy_fraction_series(m.step_starts_s, m.step_durations_s, end, window_s)
            for m in self.members
        }

    def instance_rows(self) -> list[dict[str, Any]]:
        busy = self.busy_fractions()
        rows = []
        for m in self.members:
            served = sum(1 for i in self.assignment.values() if i == m.index)
            served += sum(1 for i in self.decode_assignment.values() if i == m.index)
            rows.append(
                {
                    "instance": m.name,
                    "role": m.role,
                    "gpus": list(m.gpus),
                    "requests": served,
                    "steps": m.instance.num_steps,
                    "busy_fraction": busy[m.name],
                    "kv_usage_mean": m.timeline.kv_usage_mean() if len(m.timeline) else 0.0,
                    "preemptions": m.instance.load().num_preemptions,
                }
            )
        return rows
