"""Run an offline plan on the simulator: every request at time 0, fed in plan order to one ``Instance`` over the
cost model (sequential or overlap step times), FCFS admission following the plan.

Throughput = (input + output tokens) / makespan; sharing ratio = prompt tokens served from the prefix cache at a
request's first admission / all prompt tokens; ``optimal_fraction`` = practical optimum / makespan and
``ideal_fraction`` = ideal bound / makespan (``optimum.py``); ``step_imbalance`` = the duration-weighted mean
over steps of 1 - min(c, m) / max(c, m), with c and m the step's FLOPs / peak and bytes / bandwidth (0: every
step uses both resources equally, 1: every step uses one only).

``OfflineEngineConfig.host_time=False`` runs the cost model under an engine profile with no host time at all
(``NO_HOST_TIME``: GPU time only, the paper's accounting, which excludes CPU time for every system); otherwise
the steps pay the host time of ``engine`` (a profile name of ``perf.engines``; None: the cost model's default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbalance.engine import Instance, InstanceConfig, build_instance
from kvbalance.executor.sim import SimExecutor
from kvbalance.offline.admission import InBatchPrefixDefer
from kvbalance.offline.optimum import practical_optimum
from kvbalance.offline.plan import OfflinePlan, PlanContext
from kvbalance.offline.planners._common import (
    MAX_NUM_SEQS,
    budget_lens,
    constants,
    job_stats,
    kv_tokens,
    prompt_lens,
)
from kvbalance.offline.tree import PrefixTree
from kvbalance.perf.cost import CostModel
from kvbalance.perf.engines import EngineProfile
from kvbalance.perf.overlap import DEFAULT_INTERFERENCE_FACTOR, step_model
from kvbalance.request import Request, RequestState, SamplingParams

NO_HOST_TIME = EngineProfile(
    "no-host-time",
    "none: GPU time only (BlendServe's accounting excludes CPU time for every system)",
    description="every host-time parameter zero: a step lasts its kernels and all-reduces",
    sources={"*": "BlendServe (arXiv 2411.16102) section 6: CPU time excluded for all systems"},
)


@dataclass(frozen=True)
class OfflineEngineConfig:
    """The engine every planner runs on (the same for all: baselines at their best)."""

    max_num_seqs: int = MAX_NUM_SEQS
    interference_factor: float = DEFAULT_INTERFERENCE_FACTOR
    record_steps: bool = False  # keep per-step compute / memory utilisation (for plots)
    in_batch_prefix_check: bool = True  # SGLang-style: no two requests prefill one uncached prefix together
    host_time: bool = True  # False: GPU time only (NO_HOST_TIME)
    engine: str | None = None  # the engine profile whose host time the steps pay (None: the default)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if not self.interference_factor >= 1.0:
            raise ValueError(f"interference_factor: must be >= 1, got {self.interference_factor}")

    def cost_model(self, ctx: PlanContext) -> CostModel:
        return CostModel(ctx.model, ctx.gpu, ctx.tp, engine=self.engine if self.host_time else NO_HOST_TIME)


@dataclass
class OfflineRunResult:
    planner: str
    mode: str
    makespan_s: float
    input_tokens: int
    output_tokens: int
    sharing_ratio: float
    ideal_bound_s: float
    practical_optimum_s: float
    num_steps: int
    num_preemptions: int
    step_imbalance: float = 0.0
    rejected: list[str] = field(default_factory=list)
    compute_util: np.ndarray | None = None  # per step: FLOPs / (duration x peak)
    memory_util: np.ndarray | None = None  # per step: bytes / (duration x bandwidth)
    step_end_s: np.ndarray | None = None

    @property
    def throughput_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def optimal_fraction(self) -> float:
        """Practical optimum / makespan (the paper's "% of optimal")."""
        return self.practical_optimum_s / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def ideal_fraction(self) -> float:
        return self.ideal_bound_s / self.makespan_s if self.makespan_s > 0 else 0.0

    def row(self) -> dict:
        return {
            "planner": self.planner,
            "mode": self.mode,
            "throughput_tokens_per_s": self.throughput_tokens_per_s,
            "makespan_s": self.makespan_s,
            "sharing_ratio": self.sharing_ratio,
            "optimal_fraction": self.optimal_fraction,
            "practical_optimum_s": self.practical_optimum_s,
            "ideal_fraction": self.ideal_fraction,
            "ideal_bound_s": self.ideal_bound_s,
            "step_imbalance": self.step_imbalance,
            "num_steps": self.num_steps,
            "num_preemptions": self.num_preemptions,
            "num_rejected": len(self.rejected),
        }


@dataclass(frozen=True)
class JobYardsticks:
    ideal_bound_s: float
    practical_optimum_s: float
    dfs_sharing: float


def job_yardsticks(
    requests: Sequence[Request], ctx: PlanContext, engine: OfflineEngineConfig | None = None
) -> JobYardsticks:
    """The ideal bound and the practical optimum (overlap mode, ``engine``'s host time) of a job."""
    engine = engine or OfflineEngineConfig()
    tree = PrefixTree.from_requests(requests, ctx.block_size)
    stats = job_stats(requests, tree, constants(ctx))
    opt = practical_optimum(
        prompt_lens(requests),
        budget_lens(requests),
        stats["dfs_sharing"],
        engine.cost_model(ctx),
        kv_tokens(ctx, engine.max_num_seqs),
        engine.max_num_seqs,
        ctx.chunk_tokens,
        "overlap",
        engine.interference_factor,
    )
    return JobYardsticks(stats["ideal_bound_s"], opt.makespan_s, stats["dfs_sharing"])


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
    cm = engine.cost_model(ctx)
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
    yardsticks: JobYardsticks | None = None,
    on_step: Callable[[int], None] | None = None,
) -> OfflineRunResult:
    """Simulate ``plan`` over fresh copies of ``requests``; ``on_step(num_finished)`` reports progress.
    ``yardsticks`` (default: computed, ``job_yardsticks``) are the job's ideal bound and practical optimum."""
    engine = engine or OfflineEngineConfig()
    inst = build_offline_instance(ctx, plan.mode, engine)
    if yardsticks is None:
        yardsticks = job_yardsticks(requests, ctx, engine)
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
    imbalance = 0.0
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
        if dur > 0:
            b = out.result.breakdown
            c, m = b.flops / (dur * peak), b.bytes / (dur * bw)
            hi = c if c > m else m
            if hi > 0:
                imbalance += dur * (1.0 - (m if c > m else c) / hi)
            if engine.record_steps:
                cu.append(c)
                mu.append(m)
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
        ideal_bound_s=yardsticks.ideal_bound_s,
        practical_optimum_s=yardsticks.practical_optimum_s,
        num_steps=inst.num_steps,
        num_preemptions=inst.scheduler.num_preemptions,
        step_imbalance=imbalance / now if now > 0 else 0.0,
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
    planner=None,
) -> dict:
    """Data parallelism: ``plan.ranks(n)`` on ``n`` replicas, each its own instance from time 0. Makespan is
    the slowest replica's; the yardsticks are the job's / n; throughput counts every replica's tokens.
    ``planner`` (a planner object) re-plans each rank's requests on their own, live admission included (a
    feeding admission is planned over the whole job); without it a rank follows its slice of the order."""
    ys = job_yardsticks(requests, ctx, engine)
    per_rank = JobYardsticks(ys.ideal_bound_s / n, ys.practical_optimum_s / n, ys.dfs_sharing)
    results = []
    for rank in plan.ranks(n):
        if not rank:
            continue
        sub = [requests[i] for i in rank]
        if planner is not None:
            sub_plan = planner.plan(sub, ctx)
        else:
            # a feeding admission is planned over the whole job: a rank follows its own static order instead
            adm = None if getattr(plan.admission, "feeds", False) else plan.admission
            sub_plan = OfflinePlan(plan.planner, list(range(len(sub))), mode=plan.mode, admission=adm)
        results.append(simulate_plan(sub, sub_plan, ctx, engine, yardsticks=per_rank))
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
        "optimal_fraction": per_rank.practical_optimum_s / makespan,
        "practical_optimum_s": per_rank.practical_optimum_s,
        "ideal_fraction": per_rank.ideal_bound_s / makespan,
        "ideal_bound_s": per_rank.ideal_bound_s,
        "num_steps": sum(r.num_steps for r in results),
        "num_preemptions": sum(r.num_preemptions for r in results),
        "num_rejected": sum(len(r.rejected) for r in results),
    }
