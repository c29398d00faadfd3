"""Pruning by the queueing model: an upper bound on the rate a deployment can sustain, so that a target rate
at or above it is dropped without simulating (the stability paper: unstable for lambda >= mu).

Per instance, three ceilings (``theory.measure.throughput_bounds``'s, each with the batch time at its floor
so that it bounds from above instead of estimating):

* memory: mu = M / (b E[g]) — KV capacity M tokens, E[g] the memory-time area a request holds (token x
  batch steps), b no shorter than the quickest step this instance can run (one token: the weights are read
  once per step, plus the host overhead);
* token budget: a step computes at most the budget s_hat, and computing T tokens takes at least the quickest
  step of T tokens; a request needs E[s + o - 1] computed tokens, so rate <= max_T (T / t(T)) / E[s + o - 1];
* batch cap: at most ``max_num_seqs`` requests share a step, each for E[ceil(s / s_hat) + o - 1] steps
  (Little's law), so rate <= max_num_seqs / (b E[steps]).

A colocated deployment sustains at most ``count`` x its instance's bound. A disaggregated one at most the
smaller of its prefill side (prompt tokens, prompt area ``prefill_area(s)``, prefill steps) and its decode
side (o - 1 decode tokens, area ``decode_area(s, o - 1)``, o - 1 steps). Workloads that share prompt prefixes
(``prefix:``, ``mooncake``) can beat the prompt terms through the prefix cache, so for them only the
decode-side terms bound. Step times come from the instance's own executor (the cost model, whatever engine
profile it runs), so the bound follows the simulator.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from kvbalance.theory.area import decode_area, memory_time_area, prefill_area

SHARED_PREFIX_KINDS = ("prefix", "mooncake")


@dataclass(frozen=True)
class InstanceCeilings:
    """What one instance of a config can do at best: capacity, budget, cap and its quickest steps."""

    kv_capacity_tokens: int
    token_budget: int
    max_num_seqs: int
    b_min_s: float  # the quickest step (one token)
    tokens_per_s_max: float  # max over T <= budget of T / (quickest step of T tokens)


@dataclass(frozen=True)
class Bound:
    """A deployment's upper bound on sustainable rate (requests/s) and which ceiling sets it."""

    mu_rps: float
    binding: str  # "<role>:<ceiling>"
    per_role: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"mu_rps": self.mu_rps, "binding": self.binding, "per_role": self.per_role}


def _plan_seconds(executor, seqs: list[tuple[int, int, bool]]) -> float:
    """Duration the executor gives a step of ``seqs`` = [(new tokens, context after, samples)]."""
    from kvbalance.batch import BatchPlan, ScheduledSeq
    from kvbalance.request import Request, SamplingParams
    from kvbalance.workloads.tokens import unique_prompt

    plan = BatchPlan()
    for i, (n, ctx, sample) in enumerate(seqs):
        req = Request(f"bound{i}", unique_prompt(i, ctx), SamplingParams(max_tokens=1))
        plan.seqs.append(ScheduledSeq(req, ctx - n, n, sample))
    return executor.execute(plan).duration_s


def quickest_step_s(executor, tokens: int, max_num_seqs: int) -> float:
    """A floor on any step computing ``tokens`` tokens: the cheaper of one prompt chunk of that size and as
    many decodes as the batch cap allows (context 1, the rest in one chunk)."""
    chunk = _plan_seconds(executor, [(tokens, tokens, False)])
    dec = min(tokens, max_num_seqs)
    rest = tokens - dec + 1 if tokens > dec else 0
    seqs = [(1, 1, True)] * (dec - (1 if rest else 0)) + ([(rest, rest, False)] if rest else [])
    return min(chunk, _plan_seconds(executor, seqs))


@lru_cache(maxsize=512)
def _ceilings(sim_json: str) -> InstanceCeilings:
    from kvbalance.sim.run import SimulateConfig, build_sim_instance

    inst, _ = build_sim_instance(SimulateConfig(**json.loads(sim_json)))
    cfg = inst.scheduler.config
    budget, cap = cfg.max_num_batched_tokens, cfg.max_num_seqs
    budget = min(budget, inst.max_context)  # vllm's budget covers any prompt; no step computes more
    sizes = sorted({1 << k for k in range(budget.bit_length()) if 1 << k <= budget} | {budget})
    best = max(t / quickest_step_s(inst.executor, t, cap) for t in sizes)
    return InstanceCeilings(
        inst.kv_capacity_tokens, budget, cap, quickest_step_s(inst.executor, 1, cap), best
    )


def instance_ceilings(sim) -> InstanceCeilings:
    """Ceilings of the instance ``sim`` (a SimulateConfig) builds; ValueError if it cannot be built."""
    return _ceilings(json.dumps(sim.model_dump(exclude={"rate", "num_requests", "seed"}), sort_keys=True))


@lru_cache(maxsize=256)
def _moments(workload: str, max_context: int, chunk: int) -> dict[str, float]:
    from kvbalance.workloads.presets import describe_workload

    model = describe_workload(workload, max_context)["lengths"]

    def e(fn) -> float:
        return float(model.expect(fn))

    return {
        "tokens": e(lambda s, o: s + o - 1),
        "area": e(lambda s, o: memory_time_area(s, o, chunk)),
        "steps": e(lambda s, o: -(-s // chunk) + o - 1),
        "prompt_tokens": e(lambda s, o: s + 0 * o),
        "prompt_area": e(lambda s, o: prefill_area(s, chunk) + 0 * o),
        "prompt_steps": e(lambda s, o: -(-s // chunk) + 0 * o),
        "decode_tokens": e(lambda s, o: o - 1 + 0 * s),
        "decode_area": e(lambda s, o: decode_area(s, np.maximum(o - 1, 0))),
        "decode_steps": e(lambda s, o: o - 1 + 0 * s),
        "output_tokens": e(lambda s, o: o + 0 * s),
    }


def shares_prefixes(workload: str) -> bool:
    from kvbalance.workloads.presets import parse_workload

    return parse_workload(workload).kind in SHARED_PREFIX_KINDS


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.inf


def role_bounds(
    c: InstanceCeilings, m: dict[str, float], role: str, shared_prefixes: bool
) -> dict[str, float]:
    """Requests/s one instance of ``role`` can sustain at most, per ceiling."""
    if role == "colocated":
        tokens, area, steps = (m["output_tokens"], None, m["decode_steps"] + 1) if shared_prefixes else (
            m["tokens"], m["area"], m["steps"])  # fmt: skip
    elif role == "prefill":
        if shared_prefixes:
            return {"batch_cap": _ratio(c.max_num_seqs, c.b_min_s)}  # at least one step per request
        tokens, area, steps = m["prompt_tokens"], m["prompt_area"], m["prompt_steps"]
    else:
        tokens, area, steps = m["decode_tokens"], m["decode_area"], m["decode_steps"]
    out = {
        "token_budget": _ratio(c.tokens_per_s_max, tokens),
        "batch_cap": _ratio(c.max_num_seqs, c.b_min_s * steps),
    }
    if area is not None:
        out["memory"] = _ratio(c.kv_capacity_tokens, c.b_min_s * area)
    return out


def deployment_bound(dep, base_sim: dict[str, Any], workload: str) -> Bound:
    """Upper bound on the rate ``dep`` (a ``space.Deployment``) sustains on ``workload``; ``base_sim`` holds
    the other ``SimulateConfig`` fields (model, block size, memory utilisation, ...)."""
    from kvbalance.sim.run import SimulateConfig
    from kvbalance.specs import get_model

    shared = shares_prefixes(workload)
    sides: dict[str, float] = {}
    per_role: dict[str, dict[str, float]] = {}
    for role, count, tp in dep.groups:
        sim = SimulateConfig(**(base_sim | dep.sim_fields() | {"tp": tp}))
        c = instance_ceilings(sim)
        max_context = min(sim.max_context or 1 << 30, get_model(sim.model).max_context)
        chunk = c.token_budget if sim.policy != "sarathi" else sim.chunk_size
        bounds = role_bounds(c, _moments(workload, max_context, chunk), role, shared)
        per_role[role] = {k: v * count for k, v in bounds.items()}
        sides[role] = min(per_role[role].values())
    role = min(sides, key=sides.get)
    ceiling = min(per_role[role], key=per_role[role].get)
    return Bound(sides[role], f"{role}:{ceiling}", per_role)
