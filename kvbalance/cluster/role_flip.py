"""Role flips: move a whole instance between prefill and decode when the load's mix shifts (the coarsest of
BanaServe's "dynamic module migration": all layers and all heads at once).

A P/D split sized for one mix is wrong when the mix changes: in a prefill-heavy period the decode instances
idle while prompts queue, in a decode-heavy one the reverse. Layer- and attention-level moves lend one GPU's
spare compute to another's step and are kept once landed, so they cannot follow a mix that alternates every
few tens of seconds (measured: 0-2 moves per run, none reversed). A flip is cheap and reversible: only where
new work is routed changes (``Cluster.set_role``), the instance's queued and running requests finish there as
they began, so no KV moves and no request stops.

Signals, per role, from the monitor's window and the instances' queues (``RoleSignals``):

- prefill pressure ``prefill_queue_s``: prompt compute queued on the prefill instances (seconds, mean over
  them) over the TTFT SLO, the share of the TTFT budget a new request already waits for;
  ``prefill_util``: their operator-time utilisation plus that queue over the window (mean; > 1 falls behind);
- decode pressure ``decode_util``: mean over decode instances of max(KV occupancy, the occupancy their
  requests will average from now on, mean step time / TPOT SLO, requests over batch slots): a decode instance is busy whenever it holds requests, so busy time says
  nothing; its step time against the TPOT budget and its memory do.

Decision (``decide``), after ``cooldown_s`` since the last flip, with BanaServe's objective (minimise the
peak utilisation): each role's load per instance, ``U_p`` (prefill utilisation) and ``U_d`` (decode
pressure), is what a flip redistributes: prompts spread over the prefill instances at once (their queues
drain in seconds), so a flip from prefill to decode predicts ``max(U_p n_p / (n_p - 1), U_d n_d / (n_d + 1))``;
decodes stay where they run, so a flip from decode to prefill predicts ``max(U_p n_p / (n_p + f), mean
pressure of the other decode instances + h / (n_d - 1))``. ``f`` (``prefill_credit``) is the share of a
prefill instance's prompt throughput the flipped one gives: its residents stay and decode in every step, so
each prompt chunk comes with their decode step (``c / (c + d)``: chunk time ``c``, its decode step ``d``;
1 once none is left). ``h`` (``handoff_util``) is the decode pressure per decode instance that the
requests arriving now will bring once handed off (Little's law: their KV and batch slots over their
lives), so ``h / (n_d - 1)`` is the flipped instance's share of it, taken by the others. Both were missing
at first (the flipped instance counted whole, the others at their present pressure): after a decode-heavy
period on ``phases-15`` five instances holding 102-127 running decodes each flipped to prefill in 4 s and
left one decode instance for every hand-off (figures below). Scaling the others' whole pressure by
``n_d / (n_d - 1)`` (tried before either) kept every flip out for most of a prefill-heavy period after a
decode-heavy one: the residents' KV, which does not move, held the pressure up although new decodes were
few; ``h`` scales only the part that does move. Once the peak ``max(U_p, U_d)``
reaches ``start_util``, the flip that lowers it most is taken if it lowers it by at least ``min_gain``;
otherwise nothing, with the reason (the peak is low: both roles keep up; both are at or past 1: the cluster is
overloaded and a flip only moves the shortage; no flip lowers the peak enough: the roles are balanced; the
decode instances left would be short: a flip to prefill would leave them past 1 with its hand-offs). The
instance that flips is the one with
the least to carry over: for decode -> prefill the decode instance holding the fewest requests (its
residents decode on, interleaved with prefill chunks, while new decodes go elsewhere), for prefill -> decode
the prefill instance with the least queued. At least ``min_per_role`` instances stay in each role.

A decode instance's pressure counts its residents, which a flip does not move: right after a decode-heavy
period, decode pressure is still high while prompts queue, and a rule that needed spare decode capacity
before flipping to prefill (tried first) waited out whole periods; the peak rule flips as soon as the
prompts' queue is the larger shortage. Without the overload rule, on LongBench at twice the max rate the
queued prompts could keep the prefill side the peak while every instance was short (the rule changed
nothing measured here: LongBench at 1.5x and 3x DistServe's max rate, phases-15 at 36 and 42 req/s gave
the same flips; there a flip of the TP-2 decode instance at 0.5 s raised attainment 0.22 -> 0.50 at 1.5x and
halved throughput to the end of the run, 5.4 vs 9.2 req/s: the one decode instance left drains the tail).
Flipping several instances at once (the k that lowers the peak most)
was tried too and did worse (phases-15, llama-13b, 4P + 4D at 42 req/s: SLO attainment 0.53 against 0.79
one at a time): the signals lag the flips, and a jump overshoots.

Flipping to decode early: the peak rule flipped prefill instances to decode as soon as decode pressure
passed ``start_util`` (0.6-0.64 on ``phases-15`` from DistServe's 4P + 2D TP2 at 26.5-32 req/s), evening out
roles that both kept up (static 4P + 2D TP2 meets every SLO of the decode-heavy periods there). The instances
so flipped filled with the decode-heavy period's answers and were missing, or came back carrying them, when
prompts returned. A flip to decode now waits for decode pressure ``decode_start_util`` (0.9): below it KV,
steps and slots are within their limits, and the cost of the flip comes due at the next turn of the mix
(``reproduce banaserve --settings phases-15``: max rate 35.5 -> 37.2 req/s over the run, prefill-heavy
requests alone 25.2 -> 30.6). Prefill gets no such wait: a queue of prompts costs TTFT within seconds.

Where flips lose (measured, llama-13b 8 x A100, ``reproduce banaserve``'s workbench, 60 s of ``phases-15``):
a prefill-heavy period after a decode-heavy one. The decode-heavy period's answers (256-512 tokens at
35-40 ms each: 13.4 s of decoding on average, 21.7 s at the 90th percentile, at 32 req/s) outlive the 15 s
period, so decode capacity lent in it is held into the next.
Before the credit and the hand-off charge above, from 4P + 4D at 36 req/s, five decode instances holding
102-127 running decodes each flipped to prefill in 4 s (7P + 1D at 34.5 s): the one decode instance left
took every hand-off (decode pressure 1.1, "both roles short"), and 205 of the period's 294 requests missed
TPOT, 89 TTFT (attainment 0.848; with both, 6P + 2D, 16 and 97: 0.933). From 4P + 2D TP2 at 32 req/s with
every rule here, the period still costs 55 TTFT misses (attainment 0.971 against static 4P + 2D TP2's
0.985, which misses 29 in the first prefill-heavy period instead and none in this one): one TP-1 prefill
instance went to decode at 26 s (decode pressure 0.90), and at 32 s the TP-2 decode instance that flipped
back held 126 running decodes (67k KV tokens); from 33 to 39 s prefill utilisation stayed at 1.05-1.36 while
a further flip would have left the decode instances short with its hand-offs (the reason in the trace).
On ``phases-30`` (120 s from 4P + 2D TP2) the residents drain within the period, and the trade turns: the
credit, the hand-off charge and the wait for decode pressure lift SLO attainment at 32 req/s (0.925 ->
0.979: that period's TPOT misses 261 -> 1) but lower it near the max rate (36 req/s 0.931 -> 0.900, 38
0.909 -> 0.893): flipping the residents' instances back early costs TPOT for less time than waiting costs
TTFT (at 38 req/s 303 TTFT and 314 TPOT misses before, 485 and 48 after).

Moving the residents instead (``resident_drain.py``, ``MigrationSection.drain_residents``: a flipped instance's
running decodes go, KV and all, to decode instances with room; with it the picked instance counts as a whole
prefill instance for the residents that move, and the others for the pressure they bring, ``drain_util``)
did worse on ``phases-15``: 37.2 -> 35.5 req/s (5% search), the decode instances left fill with the moved
answers and hand-offs wait. A what-if that knows the phase schedule (``whatif_phase_oracle.py``), with or
without free moves, reaches 40.7 req/s, 1.17x the best static split at the same 1% resolution (34.8): the
prefill-heavy period after a decode-heavy one asks 8 GPUs on average, up to 10.5, of a split's 8 (``docs/reproductions.md``,
check (b); ``benchmarks/results/banaserve_phases/flip_bound``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RoleFlipConfig:
    """Thresholds of role flips (why each: the module docstring; fractions unless the name has a unit)."""

    start_util: float = 0.6  # below this peak both roles keep up: no flip (no churn on a light load)
    min_gain: float = 0.1  # a flip must lower the peak by more than the signals' noise
    cooldown_s: float = 1.0  # queues and KV occupancy react at once; half the monitor's 2 s window
    min_per_role: int = 1
    # a flip to decode waits until decode pressure nears its limit (1: KV full, steps at the TPOT SLO): below
    # it decodes meet their SLO, and an instance flipped to decode gains residents that pin it for their
    # answers' length when the mix turns back (module docstring, "Flipping to decode early")
    decode_start_util: float = 0.9

    def __post_init__(self) -> None:
        for f in ("start_util", "min_gain", "cooldown_s", "decode_start_util"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"{f}: must be >= 0, got {getattr(self, f)!r}")
        if self.min_per_role < 1:
            raise ValueError(f"min_per_role: must be >= 1, got {self.min_per_role}")


@dataclass(frozen=True)
class MemberSignal:
    """One instance's load, as the flip policy sees it."""

    name: str
    role: str  # "prefill" or "decode"
    util: float  # operator time + queued compute over the window (prefill), decode pressure (decode)
    queue_s: float  # prompt compute queued there (seconds)
    requests: int  # running + waiting + loading
    flippable: bool = True  # False while it takes part in a layer or attention move
    # a decode instance: the share of a prefill instance's prompt throughput it gives once flipped, its
    # residents decoding on in every step (1: none left); a prefill instance: 1
    prefill_credit: float = 1.0
    # a decode instance whose residents would move once flipped (cluster/resident_drain.py): the decode
    # pressure they bring the other decode instances (their mean); 0 without resident drain
    drain_util: float = 0.0


@dataclass(frozen=True)
class RoleSignals:
    prefill_queue_s: float  # mean over prefill instances, in TTFT SLOs
    prefill_util: float
    decode_util: float
    num_prefill: int
    num_decode: int
    # decode pressure per decode instance that new hand-offs bring at their present rate, once in steady state
    # (their KV and batch slots over a request's life, Little's law): what a flipped one leaves to the others
    handoff_util: float = 0.0


@dataclass(frozen=True)
class FlipDecision:
    action: str  # "none", "to_prefill" or "to_decode"
    reason: str
    member: str | None = None


def role_signals(
    members: Sequence[MemberSignal], ttft_slo_s: float, handoff_util: float = 0.0
) -> RoleSignals:
    pre = [m for m in members if m.role == "prefill"]
    dec = [m for m in members if m.role == "decode"]

    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0

    return RoleSignals(
        prefill_queue_s=mean([m.queue_s for m in pre]) / ttft_slo_s,
        prefill_util=mean([m.util for m in pre]),
        decode_util=mean([m.util for m in dec]),
        num_prefill=len(pre),
        num_decode=len(dec),
        handoff_util=handoff_util,
    )


@dataclass
class RoleFlipPolicy:
    config: RoleFlipConfig
    ttft_slo_s: float
    last_flip_s: float | None = None

    def decide(
        self, now: float, members: Sequence[MemberSignal], handoff_util: float = 0.0
    ) -> tuple[FlipDecision, RoleSignals]:
        cfg = self.config
        sig = role_signals(members, self.ttft_slo_s, handoff_util)
        if self.last_flip_s is not None and now < self.last_flip_s + cfg.cooldown_s:
            return FlipDecision("none", "cooling down after a flip"), sig
        up, ud, n_p, n_d = sig.prefill_util, sig.decode_util, sig.num_prefill, sig.num_decode
        peak = max(up, ud)
        if peak < cfg.start_util:
            return FlipDecision("none", f"both roles keep up (peak {peak:.2f})"), sig
        if min(up, ud) >= 1.0:  # every instance is short: a flip moves the shortage and costs what it carries
            return FlipDecision("none", f"both roles short (prefill {up:.2f}, decode {ud:.2f})"), sig
        options = []
        short = "no instance can be spared"
        if n_d > cfg.min_per_role:
            # the flipped decode instance keeps its residents: it adds only the prompt throughput they leave
            # (``prefill_credit``), and the others keep theirs and take the hand-offs it would have taken (its
            # share of ``handoff_util``, spread over them)
            pick = self._pick(members, "decode")
            rest = [m.util for m in members if m.role == "decode" and m is not pick]
            if pick is not None:
                d_after = sum(rest) / len(rest) + pick.drain_util + sig.handoff_util / (n_d - 1)
                if d_after < 1.0:  # they keep room for new hand-offs
                    p_after = up * n_p / (n_p + pick.prefill_credit)
                    options.append((max(p_after, d_after), "to_prefill", "decode"))
                else:
                    short = f"the decode instances left would be short ({d_after:.2f} with its hand-offs)"
        to_decode = ud >= cfg.decode_start_util and n_p > cfg.min_per_role
        if to_decode and self._pick(members, "prefill") is not None:
            options.append((max(up * n_p / (n_p - 1), ud * n_d / (n_d + 1)), "to_decode", "prefill"))
        if not options:
            return FlipDecision("none", short), sig
        after, action, role = min(options)
        if peak - after < cfg.min_gain:
            return FlipDecision("none", f"no flip lowers the peak enough ({peak:.2f} -> {after:.2f})"), sig
        cands = [m for m in members if m.role == role and m.flippable]
        key = (
            (lambda m: (m.requests, m.util, m.name))
            if role == "decode"
            else (lambda m: (m.queue_s, m.requests, m.name))
        )
        pick = min(cands, key=key)
        return FlipDecision(
            action, f"peak {peak:.2f} -> {after:.2f} (prefill {up:.2f}, decode {ud:.2f})", pick.name
        ), sig

    @staticmethod
    def _pick(members: Sequence[MemberSignal], role: str) -> MemberSignal | None:
        """The instance of ``role`` with the least to carry over (fewest requests / least queued)."""
        cands = [m for m in members if m.role == role and m.flippable]
        if not cands:
            return None
        if role == "decode":
            return min(cands, key=lambda m: (m.requests, m.util, m.name))
        return min(cands, key=lambda m: (m.queue_s, m.requests, m.name))

    def flipped(self, now: float) -> None:
        self.last_flip_s = now
