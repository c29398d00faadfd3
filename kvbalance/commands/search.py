"""``kvbalance search``: the cheapest deployment meeting TTFT/TPOT SLOs at a rate, and the cost/goodput front."""

from __future__ import annotations

import json
from pathlib import Path

from kvbalance.commands.sweep import add_backend_args, backend_from_args

DEFAULT_OUT = "runs/search"


def _list(kind):
    def parse(text: str):
        try:
            return [kind(v.strip()) for v in text.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"not a comma-separated list of {kind.__name__}: {text!r}") from None

    return parse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "search", help="cheapest deployment meeting TTFT/TPOT SLOs at a rate (pruned, bisected)"
    )
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--workload", required=True)
    p.add_argument("--rate", type=float, required=True, help="target rate lambda, requests/s")
    p.add_argument("--ttft-slo", type=float, required=True, help="TTFT objective, seconds")
    p.add_argument("--tpot-slo", type=float, required=True, help="TPOT objective, seconds")
    p.add_argument(
        "--attainment", type=float, default=0.9, help="share of requests meeting both (default 0.9)"
    )
    p.add_argument("--gpus", type=_list(str), default=["a100-80gb", "h100-sxm"])
    p.add_argument("--max-gpus", type=int, default=8)
    p.add_argument("--min-gpus", type=int, default=1)
    p.add_argument("--tps", type=_list(int), default=[1, 2, 4, 8], help="tensor-parallel degrees")
    p.add_argument("--modes", type=_list(str), default=["colocated", "disaggregated"])
    p.add_argument("--policies", type=_list(str), default=["sarathi"])
    p.add_argument("--chunk-sizes", type=_list(int), default=[512])
    p.add_argument("--batch-caps", type=_list(int), default=[256], help="max_num_seqs values")
    p.add_argument("--router", default="least_loaded")
    p.add_argument("--prices", default=None, help="YAML price table ($/GPU-hour) over the defaults")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per probe")
    p.add_argument("--min-requests", type=int, default=200)
    p.add_argument("--max-requests", type=int, default=2000)
    p.add_argument("--resolution", type=float, default=0.05, help="bisection stops at hi/lo <= 1 + this")
    p.add_argument("--wave", type=int, default=8, help="candidates per incumbent update (fixed: same result "
                   "on any backend)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--cache", default=None, help="probe cache folder (default OUT/cache)")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--no-confirm", action="store_true", help="skip the full re-simulation of the answer")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")
    add_backend_args(p)


def run(args) -> int:
    from kvbalance.search.bisect import ProbeSettings
    from kvbalance.search.prices import load_prices
    from kvbalance.search.search import SearchSettings, confirm, run_search
    from kvbalance.search.space import enumerate_deployments
    from kvbalance.specs import get_gpu, get_model

    get_model(args.model)
    for g in args.gpus:
        get_gpu(g)
    prices = load_prices(args.prices)
    probe = ProbeSettings(args.ttft_slo, args.tpot_slo, args.attainment, args.duration, args.min_requests,
                          args.max_requests)  # fmt: skip
    settings = SearchSettings(args.model, args.workload, args.rate, probe, seed=args.seed, router=args.router,
                              resolution=args.resolution, wave=args.wave)  # fmt: skip
    deps = enumerate_deployments(args.gpus, args.max_gpus, tps=args.tps, modes=args.modes, policies=args.policies,
                                 chunk_sizes=args.chunk_sizes, batch_caps=args.batch_caps,
                                 min_gpus=args.min_gpus)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = None if args.no_cache else (args.cache or str(out / "cache"))
    backend = backend_from_args(args, str(out))
    try:
        if args.no_progress:
            result = run_search(deps, settings, prices, backend, cache_dir=cache)
        else:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            with Progress(SpinnerColumn(), TextColumn("search: {task.completed} searched, last {task.description}"),
                          TimeElapsedColumn(), transient=True) as bar:  # fmt: skip
                task = bar.add_task("", total=None)
                result = run_search(deps, settings, prices, backend, cache_dir=cache,
                                    on_progress=lambda name: bar.update(task, advance=1, description=name))  # fmt: skip
    finally:
        backend.close()
    check = None if args.no_confirm else confirm(result)
    report = result.to_dict() | {"confirmation": check.to_dict() if check else None}
    (out / "search.json").write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    _write_csv(out / "candidates.csv", result)
    from kvbalance.search.plots import plot_goodput_vs_rate, plot_pareto

    plot_pareto(result, out / "pareto.png")
    plot_goodput_vs_rate(result, out / "goodput_vs_rate.png")
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        _print(result, check, backend.name)
        print(f"wrote {out}/search.json, candidates.csv, pareto.png, goodput_vs_rate.png")
    return 0 if result.best is not None else 1


def _write_csv(path: Path, result) -> None:
    import csv

    cols = ["name", "gpu", "num_gpus", "mode", "policy", "chunk_size", "max_num_seqs", "usd_per_hour", "status",
            "mu_rps", "binding", "floor_rps", "goodput_rps", "probes", "cached_probes", "reason"]  # fmt: skip
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for c in result.candidates:
            d = c.to_dict()
            d["probes"] = len(c.probes)
            w.writerow(["" if d.get(k) is None else d[k] for k in cols])


def _print(result, check, backend: str) -> None:
    from rich.console import Console
    from rich.table import Table

    s = result.settings
    n = result.counts
    table = Table(title=f"Pareto front: {s.model}, {s.workload}, target {s.rate:g} req/s, TTFT <= "
                  f"{s.probe.ttft_slo_s:g} s, TPOT <= {s.probe.tpot_slo_s:g} s ({s.probe.target:.0%})")  # fmt: skip
    table.add_column("deployment", overflow="fold")
    for col in ("GPUs", "$/h", "goodput req/s", "mu bound", "$/h per req/s"):
        table.add_column(col)
    for c in result.front:
        table.add_row(c.deployment.name, str(c.deployment.num_gpus), f"{c.usd_per_hour:.2f}", f"{c.goodput_rps:.3g}" + ("*" if c.status == "at_ceiling" else ""),
                      f"{c.mu_rps:.3g}", f"{c.usd_per_hour / c.goodput_rps:.3g}")  # fmt: skip
    con = Console(width=max(120, Console().width))
    con.print(table)
    if any(c.status == "at_ceiling" for c in result.front):
        con.print("* passed even at the queueing bound mu: a run too short to fill the KV pool (raise --duration and "
                  "--max-requests); the true goodput is at most mu")  # fmt: skip
    con.print(f"{n['candidates']} candidates: {n['infeasible']} infeasible, {n['pruned_by_model']} pruned by the "
              f"queueing model, {n['pruned_by_incumbent']} by the incumbent, {n['simulated_candidates']} simulated "
              f"({result.simulations} probes run, {result.cached} from the cache; {backend} backend)")  # fmt: skip
    b = result.best
    if b is None:
        con.print(f"no deployment meets the SLOs at {s.rate:g} req/s")
        return
    con.print(f"cheapest meeting the SLOs: [bold]{b.deployment.name}[/bold], ${b.usd_per_hour:.2f}/h, goodput "
              f"{b.goodput_rps:.3g} req/s")  # fmt: skip
    if check is not None:
        con.print(f"confirmed by a full simulation at {s.rate:g} req/s: attainment {check.attainment:.3f}, p90 TTFT "
                  f"{check.p90_ttft_s} s, p90 TPOT {check.p90_tpot_s} s -> {'meets' if check.passed else 'MISSES'}")  # fmt: skip
