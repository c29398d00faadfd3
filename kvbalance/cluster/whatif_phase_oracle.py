"""What-if, not a system: a role-flip policy that knows the load's phase schedule (an oracle).

Used to bound what role flips can give on a phase-shifting load (``workloads/phases.py``): instead of
reading the instances' load (``role_flip.RoleFlipPolicy``), it flips toward a fixed number of prefill
instances per phase, ``shift_s[j]`` seconds after phase j begins (negative: before it), one instance per
control tick. With
``MigrationSection(drain_residents=True, drain_free=True)`` a decode instance flipped to prefill hands its
running decodes to the other decode instances at no cost where their KV fits (``resident_drain.py``), so
the schedule is the only thing left to choose: a search over it (``prefill`` and ``shift_s`` per phase) gives
the best any flip policy could do with that mechanism. No serving system can know the schedule; results
under it are labelled as a what-if wherever reported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvbalance.cluster.role_flip import FlipDecision, MemberSignal, RoleSignals, role_signals


class PhaseOracle(BaseModel):
    """The schedule: phases of ``period_s`` each, in a cycle; ``prefill[j]`` prefill instances in phase j."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    period_s: float = Field(gt=0)
    prefill: tuple[int, ...]
    shift_s: tuple[float, ...] | None = None  # per phase; None: 0 each (flip as the phase begins)

    @model_validator(mode="after")
    def _valid(self) -> PhaseOracle:
        if not self.prefill or min(self.prefill) < 1:
            raise ValueError(f"prefill: one count >= 1 per phase, got {self.prefill!r}")
        if self.shift_s is not None and (
            len(self.shift_s) != len(self.prefill) or max(map(abs, self.shift_s)) >= self.period_s / 2
        ):
            raise ValueError(f"shift_s: one per phase, each within half a period, got {self.shift_s!r}")
        return self

    def wanted(self, now: float) -> int:
        """Prefill instances the schedule wants at ``now``: those of the phase whose (shifted) start was last."""
        n, p = len(self.prefill), self.period_s
        shifts = self.shift_s or (0.0,) * n
        cycle = n * p
        starts = [j * p + shifts[j] + cycle * math.floor((now - j * p - shifts[j]) / cycle) for j in range(n)]
        return self.prefill[max(range(n), key=lambda j: starts[j])]


class PhaseOraclePolicy:
    """``RoleFlipPolicy``'s interface (``decide``, ``flipped``) over the known schedule."""

    def __init__(self, oracle: PhaseOracle, ttft_slo_s: float) -> None:
        self.oracle = oracle
        self.ttft_slo_s = ttft_slo_s
        self.last_flip_s: float | None = None

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
        self.last_flip_s = now
