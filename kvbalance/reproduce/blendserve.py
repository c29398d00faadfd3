"""Reproduce BlendServe (Zhao et al., arXiv 2411.16102): offline batch inference that blends compute- and
memory-heavy requests while keeping prefix sharing, against DFS-ordered vLLM / NanoFlow, SGLang's LPM and
NanoFlow-Balance (a random order).

Simulated on the cost model: llama-3.1-8b on one a100-80gb over the paper's four traces
(``workloads/blendserve_traces.py``: BurstGPT, MMLU and OpenVid mixed to density 1.4 / 0.9 x sharing 35% / 5%,
paper numbering) at the paper's size, 400,000 requests (``--quick``: 16,000, and the report says so).
Experiments, each a set of rows in ``results.json``:

* ``main``: every trace x the paper's systems (vllm-dfs, sglang-lpm, nanoflow-dfs, nanoflow-balance,
  blendserve) and the ablations (density-balance: the dual scan without the prefix tree; blendserve without
  its per-step budgets; without its live admission);
* ``no-host``: nanoflow-dfs and blendserve again with GPU time only (the paper's accounting);
* ``size``: blendserve vs nanoflow-dfs on every trace at 1k / 16k / 64k / 400k requests (quick: 1k / 4k / 16k);
* ``interference``: the overlap engine's interference factor f = 1.0 / 1.1 / 1.2 / 1.3 on trace #1;
* ``70b-tp8``: llama-3.1-70b, TP 8 on 8 x a100-80gb, trace #1;
* ``data-parallel``: blendserve on 1 / 2 / 4 replicas, trace #1;
* ``grid``: blendserve vs nanoflow-dfs over densities x sharing ratios.

Each row carries ``experiment, trace, num_requests, model, planner, variant, throughput_tokens_per_s,
makespan_s, sharing_ratio, optimal_fraction`` (practical optimum / makespan), ``ideal_fraction`` (ideal bound /
makespan) and ``step_imbalance``. Rows are written as they finish; a rerun into the same folder skips the rows
already there (``resume``), so a long run can be stopped and resumed. Same seed -> same numbers.

Run a part: ``python -m kvbalance.reproduce.blendserve --requests 64000 --experiments main,no-host --out DIR``
(``--planners vllm-dfs,nanoflow-dfs,blendserve`` limits the main experiment to those systems).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvbalance.offline.density import DensityConstants, job_density_fn
from kvbalance.offline.plan import PLANNERS, PlanContext
from kvbalance.offline.simulate import OfflineEngineConfig, job_yardsticks, simulate_plan, simulate_ranks
from kvbalance.workloads.blendserve_traces import (
    PAPER_NUM_REQUESTS,
    TRACES,
    TraceConfig,
    build_trace,
    calibrate_datasets,
    paper_trace_config,
    trace_summary,
    tune_trace,
)

MODEL_8B, MODEL_70B, GPU = "llama-3.1-8b", "llama-3.1-70b", "a100-80gb"
SEED = 0
EXPERIMENTS = ("main", "no-host", "size", "interference", "70b-tp8", "data-parallel", "grid")
PAPER_SYSTEMS = ("vllm-dfs", "sglang-lpm", "nanoflow-dfs", "nanoflow-balance", "blendserve")
# (planner, constructor options, variant name) of the ablation rows of the main experiment
ABLATIONS = (
    ("density-balance", {}, "default"),
    ("blendserve", {"enforce_budgets": False}, "no-budgets"),
    ("blendserve", {"live_admission": False}, "static-order"),
)
INTERFERENCE_FACTORS = (1.0, 1.1, 1.2, 1.3)
PLANNERS_70B = ("vllm-dfs", "nanoflow-dfs", "blendserve")
PAIR = ("nanoflow-dfs", "blendserve")
DP_RANKS = (1, 2, 4)


@dataclass(frozen=True)
class Scale:
    num_requests: int
    sizes: tuple[int, ...]
    requests_70b: int
    interference_requests: int
    dp_requests: int
    grid_requests: int
    grid_densities: tuple[float, ...]
    grid_sharings: tuple[float, ...]


QUICK = Scale(16_000, (1_000, 4_000, 16_000), 4_000, 16_000, 16_000, 4_000, (0.9, 1.4), (0.05, 0.35))
FULL = Scale(
    PAPER_NUM_REQUESTS,
    (1_000, 16_000, 64_000, PAPER_NUM_REQUESTS),
    64_000,
    64_000,
    64_000,
    16_000,
    (0.8, 1.0, 1.2, 1.4),
    (0.05, 0.15, 0.25, 0.35),
)


class Progress:
    """One line per finished run (readable in a log file), with a rich bar on a terminal."""

    def __init__(self, total: int) -> None:
        import sys

        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("blendserve {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            )
            self.task = self.bar.add_task("", total=total)
            self.bar.start()

    def step(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=what)
        else:
            print(
                f"blendserve [{self.done}/{self.total}] {what} ({time.perf_counter() - self.t0:.0f} s)",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class Rows:
    """results.json, written after every row; rows already in it (same key) are not run again."""

    KEY = ("experiment", "trace", "num_requests", "model", "planner", "variant")

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        self.rows: list[dict] = json.loads(path.read_text()) if resume and path.exists() else []
        self._keys = {self.key(r) for r in self.rows}

    @classmethod
    def key(cls, row: dict) -> tuple:
        return tuple(row.get(k) for k in cls.KEY)

    def has(self, **key) -> bool:
        return self.key(key) in self._keys

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self._keys.add(self.key(row))
        self.path.write_text(json.dumps(self.rows, indent=1, default=float))


def chain_bound_s(reqs, ctx: PlanContext, engine: OfflineEngineConfig) -> float:
    """The longest request's own serial decode: d steps at batch 1, each at least one decode step of the cost
    model (weights read once per step). No order beats it; at 400k requests it is small next to the
    makespan, at a few thousand it is not."""
    cm = engine.cost_model(ctx)
    r = max(reqs, key=lambda q: q.max_tokens)
    return r.max_tokens * cm.step_seconds([(1, r.num_prompt_tokens + r.max_tokens // 2, True)])


class Jobs:
    """The traces, built once per (model, trace, size): calibrated on Llama-3.1-8B / A100 constants (the
    datasets' lengths do not change with the model), tuned to each trace's density in the model's own."""

    def __init__(self) -> None:
        self._cal = calibrate_datasets(job_density_fn(DensityConstants.for_model(MODEL_8B, GPU)))
        self._jobs: dict[tuple, tuple[list, dict]] = {}

    def get(self, model: str, tp: int, trace: str, n: int, density: float | None = None, sharing=None):
        key = (model, tp, trace, n, density, sharing)
        if key not in self._jobs:
            f = job_density_fn(DensityConstants.for_model(model, GPU, tp))
            if density is None:
                cfg = paper_trace_config(trace, f, n, SEED, self._cal)
            else:
                cfg = tune_trace(
                    TraceConfig(num_requests=n, seed=SEED, calibration=self._cal), f, density, sharing
                )
            self._jobs.clear()  # one job in memory at a time (a 400k-request job is large)
            self._jobs[key] = (build_trace(cfg), trace_summary(cfg, f))
        return self._jobs[key]


def _run_one(
    reqs, summary, planner: str, opts: dict, ctx, engine, extra: dict, ys=None
) -> tuple[dict, object]:
    t0 = time.perf_counter()
    plan = PLANNERS.get(planner)(**opts).plan(reqs, ctx)
    plan_s = time.perf_counter() - t0
    ys = ys or job_yardsticks(reqs, ctx, engine)
    t0 = time.perf_counter()
    res = simulate_plan(reqs, plan, ctx, engine, yardsticks=ys)
    row = {
        **extra,
        "planner": planner,
        **res.row(),
        "plan_s": plan_s,
        "sim_s": time.perf_counter() - t0,
        "job_density": summary["density"],
        "job_dfs_sharing": summary["dfs_sharing"],
        "num_videos": summary["datasets"].get("openvid", {}).get("requests", 0),
        "interference_factor": engine.interference_factor,
        "host_time": engine.host_time,
        "engine_profile": engine.cost_model(ctx).engine.name,
    }
    chain = chain_bound_s(reqs, ctx, engine)
    row["chain_bound_s"] = chain
    row["planned_sharing"] = plan.stats.get("planned_sharing", plan.stats.get("dfs_sharing"))
    if planner == "blendserve":
        for k in ("sharing_kept", "split_leaf_fraction", "estimate_weighted_abs_error", "num_samples"):
            row[k] = plan.stats.get(k)
        for k in (
            "left_prefill_budget_tokens",
            "right_prefill_budget_tokens",
            "m_left_tokens",
            "m_right_tokens",
        ):
            row[k] = plan.stats.get(k)
    return row, res


def _plan_work(
    sc: Scale, exps: Sequence[str], traces: Sequence[str], planners: Sequence[str] | None = None
) -> list[tuple]:
    """Every run as (experiment, model, tp, trace, n, planner, opts, variant, engine changes, grid point).
    ``planners`` limits the main experiment to those systems (its ablations run only if it names
    ``ablations``); None runs them all."""
    work: list[tuple] = []
    main_planners = [(p, {}, "default") for p in PAPER_SYSTEMS] + list(ABLATIONS)
    if planners is not None:
        main_planners = [w for w in main_planners if ("ablations" if w in ABLATIONS else w[0]) in planners]
    for trace in traces:
        if "main" in exps:
            for p, o, v in main_planners:
                work.append(("main", MODEL_8B, 1, trace, sc.num_requests, p, o, v, {}, None))
        if "no-host" in exps:
            for p in PAIR:
                work.append(
                    (
                        "no-host",
                        MODEL_8B,
                        1,
                        trace,
                        sc.num_requests,
                        p,
                        {},
                        "no-host",
                        {"host_time": False},
                        None,
                    )
                )
        if "size" in exps:
            for n in sc.sizes:
                if n == sc.num_requests and "main" in exps:
                    continue  # the main experiment's rows are this size's
                for p in PAIR:
                    work.append(("size", MODEL_8B, 1, trace, n, p, {}, "default", {}, None))
    if "interference" in exps and "trace1" in traces:
        for f in INTERFERENCE_FACTORS:
            for p in PAIR:
                work.append(
                    ("interference", MODEL_8B, 1, "trace1", sc.interference_requests, p, {}, f"f={f}",
                     {"interference_factor": f}, None)
                )  # fmt: skip
    if "70b-tp8" in exps and "trace1" in traces:
        for p in PLANNERS_70B:
            work.append(("70b-tp8", MODEL_70B, 8, "trace1", sc.requests_70b, p, {}, "default", {}, None))
    if "data-parallel" in exps and "trace1" in traces:
        for n in DP_RANKS:
            work.append(
                ("data-parallel", MODEL_8B, 1, "trace1", sc.dp_requests, "blendserve", {}, f"dp{n}", {}, n)
            )
    if "grid" in exps:
        for dens in sc.grid_densities:
            for share in sc.grid_sharings:
                for p in PAIR:
                    work.append(
                        ("grid", MODEL_8B, 1, f"grid-d{dens}-s{share}", sc.grid_requests, p, {}, "default", {},
                         (dens, share))
                    )  # fmt: skip
    return work


def run(
    out_dir: Path,
    quick: bool,
    *,
    scale: Scale | None = None,
    experiments: Sequence[str] = EXPERIMENTS,
    traces: Sequence[str] = tuple(TRACES),
    resume: bool = True,
    planners: Sequence[str] | None = None,
) -> dict:
    from kvbalance.offline.report import write_grid_heatmap, write_readme, write_utilisation_plot

    for e in experiments:
        if e not in EXPERIMENTS:
            raise ValueError(f"experiments: unknown {e!r} (known: {', '.join(EXPERIMENTS)})")
    for t in traces:
        if t not in TRACES:
            raise ValueError(f"traces: unknown {t!r} (known: {', '.join(TRACES)})")
    for p in planners or ():
        if p not in PAPER_SYSTEMS and p != "ablations":
            raise ValueError(f"planners: unknown {p!r} (known: {', '.join(PAPER_SYSTEMS)}, ablations)")
    sc = scale or (QUICK if quick else FULL)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = Rows(out_dir / "results.json", resume)
    work = _plan_work(sc, experiments, traces, planners)
    todo = [w for w in work if not rows.has(**_key(w))]
    bar = Progress(len(todo))
    jobs = Jobs()
    util: dict[str, object] = {}
    ys_cache: dict[tuple, object] = {}
    try:
        for w in sorted(todo, key=lambda w: (w[1], w[3], w[4], w[8].get("host_time", True), str(w[8]))):
            exp, model, tp, trace, n, planner, opts, variant, changes, point = w
            density, sharing = point if exp == "grid" else (None, None)
            reqs, summary = jobs.get(model, tp, trace, n, density, sharing)
            ctx = PlanContext(model=model, gpu=GPU, tp=tp, seed=SEED)
            record = exp == "main" and trace == "trace1" and variant == "default" and planner in PAIR
            engine = OfflineEngineConfig(record_steps=record, **changes)
            extra = {
                **_key(w),
                "gpu": GPU,
                "tp": tp,
                "paper_trace": TRACES[trace].number if trace in TRACES else None,
            }
            if point is not None and exp == "grid":
                extra.update(target_density=density, target_sharing=sharing)
            if exp == "data-parallel":
                planner_obj = PLANNERS.get(planner)()
                plan = planner_obj.plan(reqs, ctx)
                row = {**extra, **simulate_ranks(reqs, plan, ctx, engine, point, planner_obj)}
                base = next(
                    (r for r in rows.rows if r["experiment"] == exp and r.get("data_parallel") == 1 and r["trace"] == trace),
                    None,
                )  # fmt: skip
                if base is not None:
                    row["speedup"] = row["throughput_tokens_per_s"] / base["throughput_tokens_per_s"]
            else:
                yk = (model, tp, trace, n, density, sharing, engine.host_time, engine.interference_factor)
                if yk not in ys_cache:
                    ys_cache.clear()
                    ys_cache[yk] = job_yardsticks(reqs, ctx, engine)
                row, res = _run_one(reqs, summary, planner, opts, ctx, engine, extra, ys_cache[yk])
                if record:
                    util[planner] = res
            rows.add(row)
            bar.step(f"{exp} {trace} n={n} {planner} {variant}: {row['throughput_tokens_per_s']:.0f} tok/s")
    finally:
        bar.close()
    all_rows = rows.rows
    (out_dir / "traces.json").write_text(json.dumps(_trace_table(jobs, sc, traces), indent=1, default=float))
    if any(r["experiment"] == "grid" for r in all_rows):
        write_grid_heatmap(out_dir / "grid_heatmap.png", all_rows)
    if util:
        write_utilisation_plot(out_dir / "utilisation.png", util)
    write_readme(out_dir / "README.md", all_rows, sc, quick)
    return {"rows": len(all_rows), "summary": summary_table(all_rows)}


def _key(w: tuple) -> dict:
    exp, model, _, trace, n, planner, _, variant, _, _ = w
    return {
        "experiment": exp,
        "trace": trace,
        "num_requests": n,
        "model": model,
        "planner": planner,
        "variant": variant,
    }


def _trace_table(jobs: Jobs, sc: Scale, traces: Sequence[str]) -> dict:
    """What each trace is made of at the main size (per dataset: requests, lengths, densities)."""
    f = job_density_fn(DensityConstants.for_model(MODEL_8B, GPU))
    out = {"calibration": jobs._cal.output_mean_tokens, "dataset_density": jobs._cal.density}
    for t in traces:
        out[t] = trace_summary(paper_trace_config(t, f, sc.num_requests, SEED, jobs._cal), f)
    return out


def summary_table(rows: list[dict]) -> dict:
    """Per trace and size: blendserve over each baseline, % of the practical optimum, sharing vs DFS."""
    out: dict = {}
    for r in rows:
        if (
            r["experiment"] not in ("main", "size")
            or r["planner"] != "blendserve"
            or r["variant"] != "default"
        ):
            continue
        same = [
            q
            for q in rows
            if q["experiment"] in ("main", "size")
            and q["trace"] == r["trace"]
            and q["num_requests"] == r["num_requests"]
            and q["variant"] == "default"
        ]
        by = {q["planner"]: q for q in same}
        entry = {
            "optimal_fraction": r["optimal_fraction"],
            "ideal_fraction": r["ideal_fraction"],
        }
        for base in ("nanoflow-dfs", "vllm-dfs", "sglang-lpm", "nanoflow-balance"):
            if base in by:
                entry[f"vs_{base}"] = r["throughput_tokens_per_s"] / by[base]["throughput_tokens_per_s"]
        if "vllm-dfs" in by and by["vllm-dfs"]["sharing_ratio"] > 0:
            entry["sharing_vs_dfs"] = r["sharing_ratio"] / by["vllm-dfs"]["sharing_ratio"]
        elif "nanoflow-dfs" in by and by["nanoflow-dfs"]["sharing_ratio"] > 0:
            entry["sharing_vs_dfs"] = r["sharing_ratio"] / by["nanoflow-dfs"]["sharing_ratio"]
        out[f"{r['trace']}@{r['num_requests']}"] = entry
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvbalance.reproduce.blendserve", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--requests", type=int, default=None, help="main-experiment size (default: 400000, quick 16000)"
    )
    ap.add_argument("--sizes", default=None, help="size sweep, comma-separated (default: the scale's)")
    ap.add_argument("--experiments", default=",".join(EXPERIMENTS))
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument(
        "--planners",
        default=None,
        help="main experiment's systems, comma-separated, 'ablations' for its ablation rows (default: all)",
    )
    ap.add_argument("--engine", default=None, help="engine profile for the cost models (default: vllm-v1)")
    ap.add_argument("--no-resume", action="store_true")
    args = ap.parse_args(argv)
    sc = QUICK if args.quick else FULL
    if args.requests is not None:
        if args.requests < 1:
            raise SystemExit(f"requests: must be >= 1, got {args.requests}")
        sc = replace(sc, num_requests=args.requests)
    if args.sizes:
        sc = replace(sc, sizes=tuple(int(x) for x in args.sizes.split(",")))
    from kvbalance.perf.engines import default_engine

    with default_engine(args.engine):
        res = run(
            Path(args.out),
            args.quick,
            scale=sc,
            experiments=[e for e in args.experiments.split(",") if e],
            traces=[t for t in args.traces.split(",") if t],
            resume=not args.no_resume,
            planners=[p for p in args.planners.split(",") if p] if args.planners else None,
        )
    print(json.dumps(res, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
