"""Run an offline plan on the simulator: every request at time 0, fed in plan order to one ``Instance`` over the
cost model (sequential or overlap step times), FCFS admission following the plan.

Throughput = (input + output tokens) / makespan; sharing ratio = prompt tokens served from the prefix cache at a
request's first admission / all prompt tokens; optimal fraction = T_opt / makespan with T_opt the practical
optimum max((1 - s_opt) T_comp, T_mem) (``density.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbalance.engine import Instance, InstanceConfig, build_instance
from kvbalance.executor.sim import SimExecutor
from kvbalance.offline.admission import InBatchPrefixDefer
from kvbalance.offline.plan import OfflinePlan, PlanContext
from kvbalance.offline.planners._common import MAX_NUM_SEQS, constants, job_stats, kv_tokens
from kvbalance.offline.tree import PrefixTree
from kvbalance.perf.cost import CostModel
from kvbalance.perf.overlap import DEFAULT_INTERFERENCE_FACTOR, step_model
from kvbalance.request import Request, RequestState, SamplingParams


@dataclass(frozen=True)
class OfflineEngineConfig:
    """The engine every planner runs on (the same for all: baselines at their best)."""

    max_num_seqs: int = MAX_NUM_SEQS
    interference_factor: float = DEFAULT_INTERFERENCE_FACTOR
    record_steps: bool = False  # keep per-step compute / memory utilisation (for plots)
    in_batch_prefix_check: bool = True  # SGLang-style: no two requests prefill one uncached prefix together

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")


@dataclass
class OfflineRunResult:
    planner: str
    mode: str
    makespan_s: float
    input_tokens: int
    output_tokens: int
    sharing_ratio: float
    optimal_makespan_s: float
    num_steps: int
    num_preemptions: int
    rejected: list[str] = field(default_factory=list)
    compute_util: np.ndarray | None = None  # per step: FLOPs / (duration x peak)
    memory_util: np.ndarray | None = None  # per step: bytes / (duration x bandwidth)
    step_end_s: np.ndarray | None = None

    @property
    def throughput_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def optimal_fraction(self) -> float:
        return self.optimal_makespan_s / self.makespan_s if self.makespan_s > 0 else 0.0

    def row(self) -> dict:
        return {
            "planner": self.planner,
            "mode": self.mode,
            "throughput_tokens_per_s": self.throughput_tokens_per_s,
            "makespan_s": self.makespan_s,
            "sharing_ratio": self.sharing_ratio,
            "optimal_fraction": self.optimal_fraction,
            "optimal_makespan_s": self.optimal_makespan_s,
            "num_steps": self.num_steps,
            "num_preemptions": self.num_preemptions,
            "num_rejected": len(self.rejected),
        }


def clone_request(r: Request) -> Request:
    """A fresh copy (same id, prompt and sampling) for another run of the same job."""
    sp = r.sampling
    c = Request(
        r.request_id,
        r.prompt_token_ids,
        SamplingParams(
            max_tokens=sp.max_tokens, ignore_eos=sp.ignore_eos, stop_token_ids=list(sp.stop_token_ids)
        ),
        eos_token_id=r.eos_token_id,
    )
    c.meta = dict(r.meta)
    return c


def build_offline_instance(ctx: PlanContext, mode: str, engine: OfflineEngineConfig) -> Instance:
    cm = CostModel(ctx.model, ctx.gpu, ctx.tp)
    executor = SimExecutor(cm, step_model=step_model(cm, mode, engine.interference_factor))
    config = InstanceConfig(
        kv_tokens=kv_tokens(ctx, engine.max_num_seqs),
        block_size=ctx.block_size,
        policy="sarathi",
        chunk_size=ctx.chunk_tokens,
        max_num_seqs=engine.max_num_seqs,
        max_context=cm.model.max_context,
    )
    return build_instance(config, executor)


def simulate_plan(
    requests: Sequence[Request],
    plan: OfflinePlan,
    ctx: PlanContext,
    engine: OfflineEngineConfig | None = None,
    *,
    optimal_makespan_s: float | None = None,
    on_step: Callable[[int], None] | None = None,
) -> OfflineRunResult:
    """Simulate ``plan`` over fresh copies of ``requests``; ``on_step(num_finished)`` reports progress."""
    engine = engine or OfflineEngineConfig()
    inst = build_offline_instance(ctx, plan.mode, engine)
    if optimal_makespan_s is None:
        tree = PrefixTree.from_requests(requests, ctx.block_size)
        optimal_makespan_s = job_stats(requests, tree, constants(ctx))["optimal_makespan_s"]
    clones = [clone_request(r) for r in requests]
    reqs = [clones[i] for i in plan.order]
    admission = plan.admission.bind(clones) if plan.admission is not None else None
    feeds = admission is not None and getattr(admission, "feeds", False)
    hooks = [h for h in (admission, InBatchPrefixDefer() if engine.in_batch_prefix_check else None) if h]
    if not feeds:
        for r in reqs:
            inst.add_request(r, 0.0)
    seen: set[str] = set()
    hits = 0
    now = 0.0
    finished = 0
    peak = inst.executor.cost_model.gpu.peak_flops
    bw = inst.executor.cost_model.gpu.mem_bandwidth_bytes_s
    cu: list[float] = []
    mu: list[float] = []
    ends: list[float] = []
    while inst.has_work() or (feeds and admission.pending):
        for h in hooks:
            h.before_step(inst, now)
        out = inst.step(now)
        for h in hooks:
            if hasattr(h, "after_step"):
                h.after_step(inst, now)
        if out is None and feeds and not inst.has_work():
            continue  # everything released so far was rejected: release more
        if out is None:  # pragma: no cover - a scheduler bug, not an input error
            raise RuntimeError(f"{plan.planner}: the engine has work but planned an empty step")
        for s in out.plan.seqs:
            req = s.request
            if req.request_id not in seen:
                seen.add(req.request_id)
                hits += min(s.start, req.num_prompt_tokens)
        dur = out.result.duration_s
        now += dur
        done = inst.complete(out, now)
        if engine.record_steps and dur > 0:
            b = out.result.breakdown
            cu.append(b.flops / (dur * peak))
            mu.append(b.bytes / (dur * bw))
            ends.append(now)
        if done and on_step is not None:
            finished += len(done)
            on_step(finished)
    rejected = [r.request_id for r in reqs if r.state is RequestState.REJECTED]
    unfinished = [r.request_id for r in reqs if r.state not in (RequestState.FINISHED, RequestState.REJECTED)]
    if unfinished:
        raise RuntimeError(f"{plan.planner}: {len(unfinished)} requests neither finished nor rejected")
    served = [r for r in reqs if r.state is RequestState.FINISHED]
    prompt = sum(r.num_prompt_tokens for r in served)
    return OfflineRunResult(
        planner=plan.planner,
        mode=plan.mode,
        makespan_s=now,
        input_tokens=prompt,
        output_tokens=sum(r.num_output_tokens for r in served),
        sharing_ratio=hits / prompt if prompt else 0.0,
        optimal_makespan_s=optimal_makespan_s,
        num_steps=inst.num_steps,
        num_preemptions=inst.scheduler.num_preemptions,
        rejected=rejected,
        compute_util=np.asarray(cu) if engine.record_steps else None,
        memory_util=np.asarray(mu) if engine.record_steps else None,
        step_end_s=np.asarray(ends) if engine.record_steps else None,
    )


def simulate_ranks(
    requests: Sequence[Request],
    plan: OfflinePlan,
    ctx: PlanContext,
    engine: OfflineEngineConfig | None,
    n: int,
) -> dict:
    """Data parallelism: ``plan.ranks(n)`` on ``n`` replicas, each its own instance from time 0. Makespan is
    the slowest replica's; the optimum is the job's T_opt / n; throughput counts every replica's tokens."""
    tree = PrefixTree.from_requests(requests, ctx.block_size)
    t_opt = job_stats(requests, tree, constants(ctx))["optimal_makespan_s"]
    results = []
    for rank in plan.ranks(n):
        if not rank:
            continue
        sub = [requests[i] for i in rank]
        # a feeding admission is planned over the whole job: a rank follows its own static order instead
        adm = None if getattr(plan.admission, "feeds", False) else plan.admission
        sub_plan = OfflinePlan(plan.planner, list(range(len(sub))), mode=plan.mode, admission=adm)
        results.append(simulate_plan(sub, sub_plan, ctx, engine, optimal_makespan_s=t_opt / n))
    makespan = max(r.makespan_s for r in results)
    tokens = sum(r.input_tokens + r.output_tokens for r in results)
    prompt = sum(r.input_tokens for r in results)
    return {
        "planner": plan.planner,
        "mode": plan.mode,
        "data_parallel": n,
        "throughput_tokens_per_s": tokens / makespan,
        "makespan_s": makespan,
        "rank_makespans_s": [r.makespan_s for r in results],
        "sharing_ratio": sum(r.sharing_ratio * r.input_tokens for r in results) / prompt,
        "optimal_fraction": (t_opt / n) / makespan,
        "optimal_makespan_s": t_opt / n,
        "num_steps": sum(r.num_steps for r in results),
        "num_preemptions": sum(r.num_preemptions for r in results),
        "num_rejected": sum(len(r.rejected) for r in results),
    }
