"""One simulated serving run: config -> workload -> instance on the cost model -> metrics and files.

``SimulateConfig`` (``sim/config.py``, re-exported here) is the typed config of ``kvbalance simulate``;
``run_simulation`` is what the CLI and the experiments call.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvbalance.engine import Instance, InstanceConfig, build_instance
from kvbalance.executor.sim import SimExecutor
from kvbalance.kvcache.connector import KVConnector
from kvbalance.kvcache.elastic import ElasticConfig
from kvbalance.metrics.summary import summarize, write_requests_csv, write_summary_json
from kvbalance.metrics.timeline import Timeline
from kvbalance.perf.cost import CostModel
from kvbalance.perf.memory import engine_activation_reserve_bytes, kv_capacity_tokens
from kvbalance.request import Request
from kvbalance.scheduler import POLICIES
from kvbalance.sim.config import SimulateConfig, config_error_message  # noqa: F401 (re-exported)
from kvbalance.sim.loop import SimRun, simulate_instance
from kvbalance.specs import get_model
from kvbalance.workloads.presets import build_requests


@dataclass
class SimulationResult:
    config: SimulateConfig
    summary: dict
    run: SimRun
    timeline: Timeline
    instance: Instance

    @property
    def requests(self) -> list[Request]:
        return self.run.requests


def build_sim_instance(
    cfg: SimulateConfig, connector: KVConnector | None = None, cost_models: dict | None = None
) -> tuple[Instance, CostModel]:
    """The instance a simulated run serves with: KV capacity from the GPU memory left after weights and
    the activation reserve at the policy's token budget (or ``kv_tokens``), on the cost model.
    ``connector``: the KV connector's scheduler half (a cluster's P/D or store connector; none by default).
    ``cost_models``: cost models by (model, GPU, TP, engine) to share with other instances of the same (a cost
    model is a pure function of those; sharing shares its memos), added to where missing."""
    model = get_model(cfg.model)
    key = (cfg.model, cfg.gpu, cfg.tp, cfg.engine)
    cost = cost_models.get(key) if cost_models is not None else None
    if cost is None:
        cost = CostModel(model, cfg.gpu, cfg.tp, engine=cfg.engine)
        if cost_models is not None:
            cost_models[key] = cost
    max_context = min(cfg.max_context or model.max_context, model.max_context)
    budget = POLICIES.get(cfg.policy).token_budget(cfg.chunk_size, max_context)
    if cfg.kv_tokens is not None:
        kv_tokens = cfg.kv_tokens
    else:
        reserve = engine_activation_reserve_bytes(model, cfg.tp, budget, cfg.max_num_seqs)
        kv_tokens = kv_capacity_tokens(model, cfg.gpu, cfg.tp, cfg.gpu_memory_utilization, reserve)
    elastic = None
    if cfg.elastic != "off":
        elastic = ElasticConfig.for_model(
            model, budget, cfg.tp, cfg.block_size, cfg.max_num_seqs, mode=cfg.elastic
        )
    icfg = InstanceConfig(
        kv_tokens=kv_tokens,
        block_size=cfg.block_size,
        policy=cfg.policy,
        chunk_size=cfg.chunk_size,
        max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=cfg.enable_prefix_caching,
        max_context=max_context,
        elastic=elastic,
        prefix_caching_hash_algo=cfg.prefix_caching_hash_algo,
    )
    return build_instance(icfg, SimExecutor(cost), connector), cost


def config_requests(cfg: SimulateConfig, max_context: int) -> list[Request]:
    """The request set a config describes (workload, count, rate, arrivals, seed), capped at ``max_context``."""
    return build_requests(
        cfg.workload,
        cfg.num_requests,
        cfg.rate,
        cfg.seed,
        max_context,
        arrival=cfg.arrival,
        cv=cfg.cv,
        time_scale=cfg.time_scale,
    )


def run_simulation(
    cfg: SimulateConfig,
    *,
    out_dir: str | Path | None = None,
    progress: bool = False,
    requests: list[Request] | None = None,
    report: bool = True,
) -> SimulationResult:
    inst, _ = build_sim_instance(cfg)
    if requests is None:
        requests = config_requests(cfg, inst.max_context)
    timeline = Timeline(inst.name)
    cap = inst.kv_capacity_tokens

    def on_step(driver, outcome, now):
        timeline.record(
            outcome.start_s,
            inst.num_running,
            inst.num_waiting,
            inst.kv_used_tokens,
            cap,
            outcome.plan.num_tokens,
            outcome.result.duration_s,
        )

    with _progress_bar(len(requests) if progress else None) as on_finish:
        run = simulate_instance(inst, requests, on_step=on_step, on_finish=on_finish)
    summary = _summarize_run(cfg, inst, run, timeline, cap)
    if out_dir is not None:
        _write_run_files(cfg, Path(out_dir), run, summary, timeline, report)
    return SimulationResult(cfg, summary, run, timeline, inst)


@contextmanager
def _progress_bar(total: int | None):
    """A rich progress bar over ``total`` finished requests, yielding its ``on_finish`` hook (None: no bar)."""
    if total is None:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    )
    task = bar.add_task("sim", total=total)
    done = [0]

    def on_finish(req):
        done[0] += 1
        if done[0] % 50 == 0 or done[0] == total:
            bar.update(task, completed=done[0])

    bar.start()
    try:
        yield on_finish
    finally:
        bar.stop()


def _summarize_run(
    cfg: SimulateConfig, inst: Instance, run: SimRun, timeline: Timeline, start_kv_capacity_tokens: int
) -> dict:
    """The run's metrics (``summarize`` on the instance's own counters) plus the config keys that name it;
    ``start_kv_capacity_tokens`` is the capacity before the run (an elastic reserve moves it during the run)."""
    load = inst.load()
    extra: dict = {}
    if inst.elastic is not None:
        extra["elastic"] = inst.elastic.stats(run.makespan_s)
    return summarize(
        run.requests,
        kv_capacity_tokens=start_kv_capacity_tokens,
        timeline=timeline,
        ttft_slo_s=cfg.ttft_slo_s,
        tpot_slo_s=cfg.tpot_slo_s,
        prefix_hit_tokens=load.prefix_hit_tokens,
        prompt_tokens_total=load.admitted_tokens,
        preemptions=load.num_preemptions,
        extra=extra
        | {
            "model": cfg.model,
            "gpu": cfg.gpu,
            "engine": inst.executor.cost_model.engine.name,
            "tp": cfg.tp,
            "workload": cfg.workload,
            "rate": cfg.rate if math.isfinite(cfg.rate) else "inf",
            "policy": cfg.policy,
            "seed": cfg.seed,
            "num_steps": run.num_steps,
        },
    )


def _write_run_files(
    cfg: SimulateConfig, out: Path, run: SimRun, summary: dict, timeline: Timeline, report: bool
) -> None:
    """summary.json, requests.csv, timeline.csv and (with ``report``) report.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_summary_json(out / "summary.json", summary)
    write_requests_csv(out / "requests.csv", run.requests)
    timeline.to_csv(out / "timeline.csv", max_rows=20_000)
    if report:
        from kvbalance.metrics.report import write_report_png

        write_report_png(
            out / "report.png",
            run.requests,
            timeline,
            f"{cfg.model} on {cfg.gpu} x{cfg.tp}, {cfg.workload}",
        )
