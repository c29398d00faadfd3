"""Reproduce BanaServe's comparison: vLLM, DistServe and BanaServe (with ablations) on 8 x A100-80GB.

Setup as in the paper: LLaMA-13B and OPT-13B; Alpaca (short prompts) and LongBench (long prompts, truncated to
the models' 2048-token context); Poisson and bursty (Gamma, cv 4) arrivals; every system on the same GPUs,
requests and seed. Per (model, workload, arrival) and system: ``max_rate_at_slo_rps`` (highest rate at which
90% of requests meet both SLOs, DistServe's SLO attainment), ``throughput_rps`` and ``total_time_s`` (one fixed
request set at an overload rate, twice the best max rate found, the same for every system),
``mean_latency_s`` / ``p99_latency_s`` (end-to-end, at vLLM's max rate at SLO: the same load for all),
``hot_spot_ratio`` (max / min busy fraction over instances of a role, at the overload rate) and
``migrations``. Baselines run at their best: vLLM under the best of its routers, DistServe under the split
(and per-phase TP in the full run) with the highest max rate at SLO, chosen on Poisson arrivals and kept for
the bursty ones (a static plan). BanaServe starts from DistServe's split and adds adaptive layer- and
attention-level migration (``cluster/adaptive.py``); ``banaserve-no-migration`` is the ablation. Every
system of ``cluster/systems.SYSTEMS`` runs, Llumnix (request-level live migration between colocated instances,
``cluster/llumnix.py``) included; ``NOT_YET`` ones, if any, are listed as not run with the reason.

Cost: the max-rate search (``cluster/evaluate.py``) brackets, then bisects geometrically to a stated
resolution (quick 10%, full 3%), and each probe stops once its verdict is certain (exact). DistServe's splits
are searched even split first and vLLM's routers from DistServe's rate, so the rest are settled in a probe or
two; the other systems start from DistServe's rate. ``--quick``: llama-13b only, TP 1, splits with 2-6
prefill GPUs; arrivals over 1 s (Alpaca, 100-4000 requests) and 8 s (LongBench, 40-240 requests), against 20 s
and 60 s in the full run: quick max rates are those of a short burst, comparable across systems, not
steady-state figures.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from kvbalance.cluster.evaluate import Workbench
from kvbalance.cluster.systems import (
    NOT_YET,
    SYSTEMS,
    VLLM_ROUTERS,
    distserve_splits,
    pd_config,
    system_config,
    vllm_config,
)
from kvbalance.metrics.summary import to_json_value

GPU = "a100-80gb"
NUM_GPUS = 8
SEED = 0
# SLOs (TTFT s, TPOT s). Alpaca: DistServe's chat SLO for OPT-13B (0.25 s / 0.1 s). LongBench: prompts up to
# ~2000 tokens prefill in ~0.2-0.3 s alone on one A100; 1.5 s TTFT allows a few queued prefills (DistServe's
# summarisation SLOs are loose on TTFT for the same reason), TPOT stays 0.1 s (reading speed).
SLOS = {"alpaca": (0.25, 0.1), "longbench": (1.5, 0.1)}
ARRIVALS = {"poisson": ("poisson", 1.0), "bursty": ("gamma", 4.0)}
START_RPS = {"alpaca": 256.0, "longbench": 8.0}  # the first search's start: only its cost depends on it
PAPER = {  # BanaServe's reported ranges
    "throughput_vs_vllm": "1.2-3.9x",
    "throughput_vs_distserve": "1.1-2.8x",
    "total_time_reduction_vs_vllm": "3.9-78.4%",
    "latency_reduction_vs_distserve": "1.4-70.1%",
}


def _sizes(quick: bool) -> dict[str, Any]:
    # per workload: (arrival span s, min requests, max requests); "prefill": GPUs given to prefill tried;
    # "resolution": of the max-rate search (the threshold lies in [rate, rate x (1 + resolution)])
    if quick:
        n = {"alpaca": (1.0, 100, 4000), "longbench": (8.0, 40, 240)}
        return {"models": ("llama-13b",), "n": n, "resolution": 0.1, "tps": (1,), "prefill": range(2, 7)}
    n = {"alpaca": (20.0, 200, 8000), "longbench": (60.0, 100, 1000)}
    return {
        "models": ("llama-13b", "opt-13b"),
        "n": n,
        "resolution": 0.03,
        "tps": (1, 2),
        "prefill": range(1, 8),
    }


def _measure(
    wb: Workbench, system: str, cfg, max_rate: float, load_rate: float, overload_rate: float
) -> dict:
    at_load = wb.run(cfg, load_rate).summary
    over = wb.run(cfg, overload_rate)
    s = over.summary
    return {
        "system": system,
        "config": f"{cfg.describe()} router={cfg.router}" + (" store" if cfg.store else ""),
        "max_rate_at_slo_rps": max_rate,
        "throughput_rps": s["throughput_rps"],
        "total_time_s": s["makespan_s"],
        "mean_latency_s": at_load["e2e_s"]["mean"],
        "p99_latency_s": at_load["e2e_s"]["p99"],
        "ttft_p90_s": at_load["ttft_s"]["p90"],
        "tpot_p90_s": at_load["tpot_s"]["p90"],
        "load_rate_rps": load_rate,
        "overload_rate_rps": overload_rate,
        "hot_spot_ratio": s["hot_spot_ratio"],
        "hot_spot_ratio_by_role": s["hot_spot_ratio_by_role"],
        "migrations": s["migrations"],
        "migration_log": s.get("migration_log", []),
        "store_fetched_blocks": s["store_fetched_blocks"],
        "preemptions": s["preemptions"],
        "busy_series": {
            k: [list(map(float, t)), list(map(float, f))]
            for k, (t, f) in over.run.busy_series(max(s["makespan_s"] / 40, 1e-3)).items()
        },  # fmt: skip
    }


def _one_setting(model, workload, arrival, sizes, split, tick) -> tuple[list[dict], tuple, dict]:
    kind, cv = ARRIVALS[arrival]
    ttft, tpot = SLOS[workload]
    span, lo, hi = sizes["n"][workload]
    wb = Workbench(model, GPU, workload, kind, cv, ttft, tpot, duration_s=span, min_requests=lo, max_requests=hi,
                   seed=SEED, resolution=sizes["resolution"], on_run=tick)  # fmt: skip
    start = START_RPS[workload]
    notes: dict[str, Any] = {}
    if split is None:  # DistServe's search: every split and per-phase TP of the budget
        splits = [sp for sp in distserve_splits(NUM_GPUS, sizes["tps"]) if sp[0] * sp[2] in sizes["prefill"]]
        # the even split first (the likely winner: then the others are pruned in a probe or two)
        splits.sort(key=lambda sp: (abs(2 * sp[0] * sp[2] - NUM_GPUS), sp))
        i, _, rates = wb.best_of([pd_config(*sp) for sp in splits], start)
        split = splits[i]
        notes["distserve_search"] = [
            {"split": sp, "max_rate_at_slo_rps": r or None} for sp, r in zip(splits, rates)
        ]
    ds = wb.max_rate_at_slo(system_config("distserve", NUM_GPUS, split), start)  # searched above if split was
    routers = list(VLLM_ROUTERS)
    j, _, rates = wb.best_of([vllm_config(NUM_GPUS, r) for r in routers], ds or start)
    notes["vllm_routers"] = {r: (x or None) for r, x in zip(routers, rates)}
    cfgs = {s: system_config(s, NUM_GPUS, split, routers[j] if s == "vllm" else None) for s in SYSTEMS}
    # the others start from DistServe's rate (they share its split), first bracket step 1 + resolution: a
    # system within the resolution of it costs two probes
    max_rates = {s: wb.max_rate_at_slo(c, ds or start, 1 + sizes["resolution"]) for s, c in cfgs.items()}
    load_rate = max_rates["vllm"] or start / 4
    overload = 2 * max(max(max_rates.values()), load_rate)
    rows = []
    for s, c in cfgs.items():
        row = {
            "model": model,
            "workload": workload,
            "arrival": arrival,
            **_measure(wb, s, c, max_rates[s], load_rate, overload),
        }
        row["slo_probes"] = sorted(wb.probes.get(wb.key(c), []))
        rows.append(row)
    for s, why in NOT_YET.items():
        rows.append({"model": model, "workload": workload, "arrival": arrival, "system": s, "not_run": why})
    notes.update({"split": split, "slo_ttft_s": ttft, "slo_tpot_s": tpot, "arrival_span_s": wb.duration_s,
                  "requests_at_overload": wb.requests_for(overload)})  # fmt: skip
    return rows, split, notes


def run(out_dir: Path, quick: bool = False, models: tuple[str, ...] | None = None) -> dict:
    """Run the reproduction into ``out_dir``; ``models`` overrides the mode's models (e.g. opt-13b quick)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvbalance.reproduce.banaserve_report import write_plots, write_readme

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sizes = _sizes(quick)
    if models is not None:
        sizes["models"] = tuple(models)
    settings = [(m, w, a) for m in sizes["models"] for w in SLOS for a in ARRIVALS]
    t0, c0, load0 = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    rows: list[dict] = []
    notes: dict[str, Any] = {}
    runs = [0]
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    ) as bar:
        task = bar.add_task("banaserve", total=len(settings))
        sim_task = bar.add_task("simulated runs", total=None)

        def tick() -> None:
            runs[0] += 1
            bar.update(sim_task, completed=runs[0])

        splits: dict[tuple[str, str], tuple] = {}
        for model, workload, arrival in settings:
            bar.update(task, description=f"{model} {workload} {arrival}")
            r, split, n = _one_setting(model, workload, arrival, sizes, splits.get((model, workload)), tick)
            splits[(model, workload)] = split
            rows += r
            notes[f"{model}/{workload}/{arrival}"] = n
            bar.advance(task)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    load = f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    meta = {"quick": quick, "gpu": GPU, "num_gpus": NUM_GPUS, "seed": SEED, "wall_s": wall, "cpu_s": cpu,
            "load_average": load, "simulated_runs": runs[0], "paper": PAPER, "settings": notes,
            "sizes": {"n": sizes["n"], "resolution": sizes["resolution"]}}  # fmt: skip
    (out / "results.json").write_text(json.dumps(to_json_value(rows), indent=1, default=str))
    (out / "meta.json").write_text(json.dumps(to_json_value(meta), indent=1, default=str))
    write_plots(out, rows)
    write_readme(out, rows, meta)
    return {"rows": len(rows), "wall_s": wall, "cpu_s": cpu, "simulated_runs": runs[0], "out": str(out)}
