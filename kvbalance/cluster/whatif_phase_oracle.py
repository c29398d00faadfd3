"""What-if, not a system: a role-flip policy that knows the load's phase schedule (an oracle).

Used to bound what role flips can give on a phase-shifting load (``workloads/phases.py``): instead of
reading the instances' load (``role_flip.RoleFlipPolicy``), it flips toward a fixed number of prefill
instances in each part of the load's cycle (``schedule``; ``PhaseOracle.phases``: per phase, shifted),
``flips_per_tick`` instances per control tick. With
``MigrationSection(drain_residents=True, drain_free=True)`` a decode instance flipped to prefill hands its
running decodes to the other decode instances at no cost where their KV fits (``resident_drain.py``), so
the schedule is the only thing left to choose: a search over it gives
the best any flip policy could do with that mechanism. No serving system can know the schedule; results
under it are labelled as a what-if wherever reported.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvbalance.cluster.role_flip import FlipDecision, MemberSignal, RoleSignals, role_signals


class PhaseOracle(BaseModel):
    """The schedule over a cycle of ``cycle_s``: from each ``(start_s, n)`` of ``schedule`` (offsets into the
    cycle, ascending) on, ``n`` prefill instances; ``flips_per_tick``: flips a control tick may take (the
    oracle knows where it is going: it need not wait for signals between flips)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cycle_s: float = Field(gt=0)
    schedule: tuple[tuple[float, int], ...]
    flips_per_tick: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _valid(self) -> PhaseOracle:
        starts = [t for t, _ in self.schedule]
        if not self.schedule or starts != sorted(starts) or not 0 <= starts[0] <= starts[-1] < self.cycle_s:
            raise ValueError(f"schedule: (start_s, n) ascending within [0, cycle_s), got {self.schedule!r}")
        if min(n for _, n in self.schedule) < 1:
            raise ValueError(f"schedule: every count >= 1, got {self.schedule!r}")
        return self

    @classmethod
    def phases(cls, period_s: float, prefill: tuple[int, ...], shift_s: tuple[float, ...] | None = None,
               flips_per_tick: int = 1) -> PhaseOracle:  # fmt: skip
        """``prefill[j]`` instances in phase j of ``period_s`` each, from ``shift_s[j]`` seconds after it
        begins (negative: before; the cycle wraps)."""
        n = len(prefill)
        shift = shift_s or (0.0,) * n
        if len(shift) != n:
            raise ValueError(f"shift_s: one per phase, got {shift_s!r}")
        cycle = n * period_s
        sched = sorted(((j * period_s + shift[j]) % cycle, prefill[j]) for j in range(n))
        return cls(cycle_s=cycle, schedule=tuple(sched), flips_per_tick=flips_per_tick)

    def wanted(self, now: float) -> int:
        """Prefill instances the schedule wants at ``now`` (before the cycle's first start: its last entry)."""
        x = now % self.cycle_s
        n = self.schedule[-1][1]
        for t, k in self.schedule:
            if t <= x:
                n = k
        return n


class PhaseOraclePolicy:
    """``RoleFlipPolicy``'s interface (``decide``, ``flipped``) over the known schedule."""

    def __init__(self, oracle: PhaseOracle, ttft_slo_s: float) -> None:
        self.oracle = oracle
        self.ttft_slo_s = ttft_slo_s
        self.last_flip_s: float | None = None
        self._tick_flips = 0  # flips taken at ``last_flip_s``

    def decide(
        self, now: float, members: Sequence[MemberSignal], handoff_util: float = 0.0
    ) -> tuple[FlipDecision, RoleSignals]:
        sig = role_signals(members, self.ttft_slo_s, handoff_util)
        want = self.oracle.wanted(now)
        if sig.num_prefill < want and sig.num_decode > 1:
            cands = [m for m in members if m.role == "decode" and m.flippable]
            if cands:
                pick = min(cands, key=lambda m: (m.requests, m.name))
                return FlipDecision("to_prefill", f"schedule: {want} prefill", pick.name), sig
        if sig.num_prefill > want:
            cands = [m for m in members if m.role == "prefill" and m.flippable]
            if cands:
                pick = min(cands, key=lambda m: (m.queue_s, m.requests, m.name))
                return FlipDecision("to_decode", f"schedule: {want} prefill", pick.name), sig
        return FlipDecision("none", f"schedule: {want} prefill (as is)"), sig

    def flipped(self, now: float) -> None:
        self._tick_flips = self._tick_flips + 1 if now == self.last_flip_s else 1
        self.last_flip_s = now

    def more_flips(self, now: float) -> bool:
        """May another flip be taken at ``now`` (``flips_per_tick``)?"""
        return now != self.last_flip_s or self._tick_flips < self.oracle.flips_per_tick
