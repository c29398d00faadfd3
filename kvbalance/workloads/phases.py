"""Loads whose mix or rate changes over time: alternating prefill- and decode-heavy phases, periodic bursts.

A static prefill/decode split is sized for one mix; these loads are where it is wrong part of the time and a
system that moves work (BanaServe's migration, a role flip) has something to track.

- ``phases:P:A-B:C-D:E-F:G-H[:R]``: a cycle of two phases of ``P`` seconds each, first prefill-heavy
  (inputs ``A..B``, outputs ``C..D`` tokens), then decode-heavy (inputs ``E..F``, outputs ``G..H``); the
  second phase's arrival rate is ``R`` times the first's (default 1). ``rate`` is the mean over the cycle.
- ``bursts:P:D:M:A-B:C-D``: every ``P`` seconds a burst of ``D`` seconds at ``M`` times the mean rate, the
  rest of the period slower so that the mean stays ``rate`` (needs ``M x D < P``); lengths uniform.

Arrivals are the chosen process (Poisson, Gamma with ``cv``, constant) at the mean rate, time-warped through
the cycle's cumulative intensity (the time-rescaling theorem: a unit process mapped by the inverse of
``Lambda(t)`` has intensity ``rate x m(t)``). A request's phase is the phase it arrives in and sets its
lengths; ``Request.meta["phase"]`` keeps it (0-based) for per-phase reports. Same seed, same requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvbalance.request import Request, SamplingParams
from kvbalance.workloads.arrivals import arrival_times
from kvbalance.workloads.lengths import JointLengths, PairedLengths, Uniform
from kvbalance.workloads.tokens import unique_prompt

KINDS = ("phases", "bursts")
PRESETS = {
    # 15 s of LongBench-like prompts with short answers, then 15 s of short prompts with long answers at 2.5x
    # the rate: for a 13B model on 8 A100s the first phase wants about 6 prefill GPUs of 8, the second about 6
    # decode GPUs (a prefill GPU takes ~5 of these prompts a second, a decode GPU ~13 of these answers)
    "phases-15": "phases:15:1024-1792:16-64:32-128:256-512:2.5",
    "phases-30": "phases:30:1024-1792:16-64:32-128:256-512:2.5",
    "phases-60": "phases:60:1024-1792:16-64:32-128:256-512:2.5",
    # a 2 s burst at 4x the mean rate every 10 s, ShareGPT-like lengths
    "bursts": "bursts:10:2:4:16-512:16-512",
}


@dataclass(frozen=True)
class Phase:
    duration_s: float
    input: tuple[int, int]
    output: tuple[int, int]
    rate_multiplier: float  # relative; normalised so the cycle's mean is 1


@dataclass(frozen=True)
class PhaseCycle:
    phases: tuple[Phase, ...]

    @property
    def period_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def multipliers(self) -> np.ndarray:
        """Each phase's rate over the mean rate (the cycle's time-weighted mean is 1)."""
        d = np.array([p.duration_s for p in self.phases])
        m = np.array([p.rate_multiplier for p in self.phases])
        return m * d.sum() / float(d @ m)

    def warp(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(arrival times, phase index) for times ``u`` of a mean-rate process (inverse cumulative intensity)."""
        d = np.array([p.duration_s for p in self.phases])
        m = self.multipliers()
        C = self.period_s
        mass = np.concatenate(([0.0], np.cumsum(d * m)))  # Lambda at each phase start, in mean-rate seconds
        starts = np.concatenate(([0.0], np.cumsum(d)))
        k, r = np.divmod(u, C)
        j = np.clip(np.searchsorted(mass, r, side="right") - 1, 0, len(d) - 1)
        return k * C + starts[j] + (r - mass[j]) / m[j], j


def _span(workload: str, text: str, what: str) -> tuple[int, int]:
    parts = text.split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise ValueError(f"workload: {what} in {workload!r} must be N or A-B with 1 <= A <= B, got {text!r}")
    return lo, hi


def _positive(workload: str, text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"workload: {what} in {workload!r} must be a number > 0, got {text!r}")
    return v


def parse(workload: str) -> PhaseCycle:
    """The cycle of a ``phases``/``bursts`` string or a preset name; ValueError naming ``workload`` else."""
    kind, _, rest = PRESETS.get(workload, workload).partition(":")
    parts = rest.split(":") if rest else []
    if kind == "phases":
        if len(parts) not in (5, 6):
            raise ValueError(f"workload: expected 'phases:P:A-B:C-D:E-F:G-H[:R]', got {workload!r}")
        period = _positive(workload, parts[0], "phase length (s)")
        ratio = _positive(workload, parts[5], "rate ratio") if len(parts) == 6 else 1.0
        first = Phase(period, _span(workload, parts[1], "input"), _span(workload, parts[2], "output"), 1.0)
        second = Phase(period, _span(workload, parts[3], "input"), _span(workload, parts[4], "output"), ratio)
        return PhaseCycle((first, second))
    if kind == "bursts":
        if len(parts) != 5:
            raise ValueError(f"workload: expected 'bursts:P:D:M:A-B:C-D', got {workload!r}")
        period = _positive(workload, parts[0], "period (s)")
        burst = _positive(workload, parts[1], "burst length (s)")
        mult = _positive(workload, parts[2], "burst rate multiplier")
        if not (burst < period and mult * burst < period):
            raise ValueError(
                f"workload: {workload!r} needs burst length < period and multiplier x burst length < period"
            )
        inp, out = _span(workload, parts[3], "input"), _span(workload, parts[4], "output")
        calm = (period - mult * burst) / (period - burst)
        return PhaseCycle((Phase(burst, inp, out, mult), Phase(period - burst, inp, out, calm)))
    raise ValueError(f"workload: {workload!r} is not a phases or bursts workload")


def _joint(p: Phase, max_context: int) -> JointLengths:
    if p.input[0] + 1 > max_context:
        raise ValueError(
            f"workload: inputs from {p.input[0]} tokens do not fit the {max_context}-token context"
        )
    return JointLengths(Uniform(*p.input), Uniform(*p.output), max_context, truncate="output")


def lengths(cycle: PhaseCycle, max_context: int) -> PairedLengths:
    """The mix over a cycle (each phase weighted by its share of requests), as a seeded sample of 8,192 pairs."""
    reqs = build(cycle, "", 8192, 1.0, 0, max_context)
    return PairedLengths([r.num_prompt_tokens for r in reqs], [r.max_tokens for r in reqs])


def build(
    cycle: PhaseCycle, workload: str, num_requests: int, rate: float, seed: int, max_context: int,
    arrival: str = "poisson", cv: float = 1.0, uid_offset: int = 0,
) -> list[Request]:  # fmt: skip
    """``num_requests`` requests, sorted by arrival, ids ``r000000``, ...; ``rate`` is the cycle's mean."""
    len_rng, arr_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    u = arrival_times(arrival, rate, num_requests, arr_rng, cv)
    if math.isinf(rate):
        times, phase = u, np.zeros(num_requests, dtype=np.int64)
    else:
        times, phase = cycle.warp(u * 1.0)
    inputs = np.zeros(num_requests, dtype=np.int64)
    outputs = np.zeros(num_requests, dtype=np.int64)
    for j, p in enumerate(cycle.phases):
        sel = np.flatnonzero(phase == j)
        inputs[sel], outputs[sel] = _joint(p, max_context).sample(len_rng, len(sel))
    out = []
    for i in range(num_requests):
        req = Request(
            f"r{i:06d}",
            unique_prompt(uid_offset + i, int(inputs[i])),
            SamplingParams(max_tokens=max(1, int(outputs[i])), ignore_eos=True),
            arrival_s=float(times[i]),
        )
        req.meta["phase"] = int(phase[i])
        out.append(req)
    return out
