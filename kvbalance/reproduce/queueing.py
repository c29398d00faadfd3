"""Reproduce the queueing-stability paper: mu = M / (b E[g(s, o)]) from theory vs the simulator's saturation.

Setup as in the paper's vLLM check: Llama-3-8B on A100, chunked prefill s_hat = 512 (sarathi policy), KV
memory M = 131,000 tokens, max_num_seqs high (512) so that memory, not the sequence cap, binds. Settings:
P/D length ratios 1:1 (s, o ~ U(10, 1600)), 2:1 (U(10, 2133), U(10, 1066)), 1:2 (U(10, 1066), U(10, 2133)),
a 50/50 mixture of 2:1 and 1:2, a LongBench-like long-context set, and 8 data-parallel replicas at 1:1
(mu_8 = 8 mu). For each, one saturated run (all requests at time 0) gives both the simulator's throughput
(completions/s between the 10th and 90th percentile completion times) and b (the paper's estimator over the
steps in that window), so theory and simulation share b. E[g] is exact over the length pmfs (eq. for g:
sum_{k=1}^{ceil(s/s_hat)} min(k s_hat, s) + sum_{j=1}^{o} (s + j)). Then the 1:1 queue is simulated at
0.8 mu (below mu (1 - delta): bounded), 1.2 mu (above mu: grows about linearly at lambda - mu_sim), and at
0.8 mu computed with the plain median b, to show what that estimator does here. Nothing in the simulator is
tuned to the theory.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvbalance.cluster.replicas import measure_saturation, simulate_replicas
from kvbalance.metrics.report import plot_lines, write_table_csv
from kvbalance.metrics.summary import to_json_value
from kvbalance.sim.run import SimulateConfig
from kvbalance.theory.measure import (
    WorkloadArea,
    mixed_requests,
    mixture_area,
    queue_growth,
    throughput_bounds,
    workload_area,
)
from kvbalance.theory.stability import memory_time_area, stability_margin, stable_service_rate
from kvbalance.workloads.presets import build_requests

MODEL = "llama-3-8b"
GPU = "a100-40gb"
KV_TOKENS = 131_000
CHUNK = 512
MAX_NUM_SEQS = 512
MAX_CONTEXT = 8192  # Llama-3-8B
SEED = 0
RATIO_WORKLOADS = {
    "1:1": "uniform:10-1600:10-1600",
    "2:1": "uniform:10-2133:10-1066",
    "1:2": "uniform:10-1066:10-2133",
}
MIXED = ("uniform:10-2133:10-1066", "uniform:10-1066:10-2133")
REPLICAS = 8

# requests per saturated run (per instance for the replicas), and per queue run
SIZES = {
    True: {"1:1": 600, "2:1": 300, "1:2": 300, "mixed": 300, "longbench": 200, "replicas": 300, "queue": 400},
    False: {
        "1:1": 2000,
        "2:1": 2000,
        "1:2": 2000,
        "mixed": 2000,
        "longbench": 1000,
        "replicas": 1000,
        "queue": 2000,
    },
}


def _config(workload: str, rate: float, num_requests: int) -> SimulateConfig:
    return SimulateConfig(
        model=MODEL,
        gpu=GPU,
        workload=workload,
        rate=rate,
        num_requests=num_requests,
        kv_tokens=KV_TOKENS,
        chunk_size=CHUNK,
        max_num_seqs=MAX_NUM_SEQS,
        policy="sarathi",
        seed=SEED,
    )


def _gap(theory: float, sim: float) -> float:
    return abs(theory - sim) / sim


def _row(setting: str, area: WorkloadArea, sat, replicas: int = 1) -> dict[str, Any]:
    """Theory vs simulation for one saturated run; mu is per instance times ``replicas``."""
    m = sat.run.instances[0].kv_capacity_tokens
    b = sat.b

    def mu(bs: float) -> float:
        return replicas * stable_service_rate(m, bs, area.expected_area)  # mu = M / (b E[g]), per instance

    sim = sat.throughput_rps
    reqs = sat.run.requests
    s = np.array([r.num_prompt_tokens for r in reqs])
    o = np.array([r.num_output_tokens for r in reqs])
    eg_sample = float(np.mean(memory_time_area(s, o, CHUNK)))
    bounds = throughput_bounds(
        area, kv_capacity_tokens=m, batch_time_s=b["auto"], chunk_size=CHUNK, max_num_seqs=MAX_NUM_SEQS
    )
    return {
        "setting": setting,
        "mu_theory_rps": mu(b["auto"]),
        "mu_sim_rps": sim,
        "gap": _gap(mu(b["auto"]), sim),
        "b_method": b["auto_method"],
        "b_s": b["auto"],
        "b_median_s": b["median"],
        "b_trimmed_mean_s": b["trimmed_mean"],
        "b_mean_s": b["mean"],
        "mu_theory_median_b_rps": mu(b["median"]),
        "gap_median_b": _gap(mu(b["median"]), sim),
        "mu_theory_mean_b_rps": mu(b["mean"]),
        "gap_mean_b": _gap(mu(b["mean"]), sim),
        "expected_area": area.expected_area,
        "sample_area": eg_sample,
        "delta": stability_margin(area.max_total_tokens, m),
        "mean_input_tokens": area.mean_input_tokens,
        "mean_output_tokens": area.mean_output_tokens,
        "kv_capacity_tokens": m,
        "replicas": replicas,
        "num_requests": len(reqs),
        "window_steps": b["count"],
        "kv_usage_window": sat.kv_usage_window,
        "running_median": sat.running_median,
        "preemptions": sat.preemptions,
        "binding": bounds["binding"],
        "token_budget_bound_rps": replicas * bounds["token_budget_bound_rps"],
    }


def _saturation_rows(sizes: dict[str, int], log) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows = []
    keep: dict[str, Any] = {}
    for setting, workload in RATIO_WORKLOADS.items():
        t = time.perf_counter()
        sat = measure_saturation(_config(workload, math.inf, sizes[setting]))
        rows.append(_row(setting, workload_area(workload, CHUNK, MAX_CONTEXT), sat))
        keep[setting] = sat
        log(setting, rows[-1], time.perf_counter() - t)

    t = time.perf_counter()
    reqs = mixed_requests(MIXED, sizes["mixed"], math.inf, SEED, MAX_CONTEXT)
    area = mixture_area([workload_area(w, CHUNK, MAX_CONTEXT) for w in MIXED], [0.5, 0.5])
    sat = measure_saturation(_config(MIXED[0], math.inf, sizes["mixed"]), reqs)
    rows.append(_row("mixed 2:1+1:2", area, sat))
    log("mixed", rows[-1], time.perf_counter() - t)

    t = time.perf_counter()
    sat = measure_saturation(_config("longbench", math.inf, sizes["longbench"]))
    rows.append(_row("longbench", workload_area("longbench", CHUNK, MAX_CONTEXT), sat))
    log("longbench", rows[-1], time.perf_counter() - t)

    t = time.perf_counter()
    w = RATIO_WORKLOADS["1:1"]
    n = sizes["replicas"] * REPLICAS
    reqs = build_requests(w, n, math.inf, SEED, MAX_CONTEXT)
    sat = measure_saturation(_config(w, math.inf, n), reqs, num_instances=REPLICAS, router="least_loaded")
    rows.append(_row(f"1:1 x{REPLICAS} replicas", workload_area(w, CHUNK, MAX_CONTEXT), sat, REPLICAS))
    log("replicas", rows[-1], time.perf_counter() - t)
    return rows, keep


def _queue_runs(base: dict[str, Any], num_requests: int, log) -> list[dict[str, Any]]:
    """The 1:1 queue at 0.8 mu, 1.2 mu (mu with the paper's b) and 0.8 mu computed from the median b."""
    w = RATIO_WORKLOADS["1:1"]
    mu, mu_median, mu_sim, delta = (
        base["mu_theory_rps"],
        base["mu_theory_median_b_rps"],
        base["mu_sim_rps"],
        base["delta"],
    )
    cases = [
        ("0.8 mu", 0.8 * mu, mu),
        ("1.2 mu", 1.2 * mu, mu),
        ("0.8 mu (median b)", 0.8 * mu_median, mu_median),
    ]
    out = []
    for label, rate, mu_used in cases:
        t = time.perf_counter()
        cfg = _config(w, rate, num_requests)
        run = simulate_replicas(cfg, num_instances=1)
        arrivals = [r.arrival_s for r in run.requests]
        times, waiting = run.waiting()
        g = queue_growth(times, waiting, min(arrivals), max(arrivals))
        region = "stable" if rate < mu_used * (1 - delta) else ("unstable" if rate >= mu_used else "margin")
        out.append(
            {
                "label": label,
                "rate_rps": rate,
                "rate_over_mu": rate / mu_used,
                "rate_over_mu_sim": rate / mu_sim,
                "theory_region": region,
                "expected_slope_rps": max(0.0, rate - mu_sim),  # fluid limit: queue grows at lambda - mu
                **{k: v for k, v in g.items() if k not in ("grid_s", "queue")},
                "_grid": g["grid_s"],
                "_queue": g["queue"],
                "completed": run.summary["completed"],
                "preemptions": run.summary["preemptions"],
            }
        )
        log(label, out[-1], time.perf_counter() - t)
    return out


def _bar_plot(path: Path, rows: list[dict[str, Any]]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    names = [r["setting"] for r in rows]
    x = np.arange(len(rows))
    series = [
        ("theory, paper's b", "mu_theory_rps"),
        ("theory, median b", "mu_theory_median_b_rps"),
        ("simulated saturation", "mu_sim_rps"),
    ]
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        vals = [r[key] for r in rows]
        bars = ax.bar(x + (i - 1) * width, vals, width, label=label)
        if key == "mu_theory_rps":
            for bar, r in zip(bars, rows):
                ax.annotate(
                    f"{100 * r['gap']:.1f}%",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
    ax.set_xticks(x, names, rotation=15)
    ax.set_yscale("log")
    ax.set_ylabel("requests/s")
    ax.set_title(f"mu = M / (b E[g]) vs simulated saturation ({MODEL}, {GPU}, M={KV_TOKENS}, s_hat={CHUNK})")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.savefig(path, dpi=100)


def _markdown(rows: list[dict[str, Any]], queue: list[dict[str, Any]]) -> str:
    lines = [
        "| setting | mu theory (rps) | b method | mu sim (rps) | gap | gap, median b | gap, mean b | KV used | preempt |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['mu_theory_rps']:.3f} | {r['b_method']} | {r['mu_sim_rps']:.3f} "
            f"| {100 * r['gap']:.2f}% | {100 * r['gap_median_b']:.2f}% | {100 * r['gap_mean_b']:.2f}% "
            f"| {100 * r['kv_usage_window']:.1f}% | {r['preemptions']} |"
        )
    lines += [
        "",
        "| queue run | rate (rps) | rate / mu | rate / mu_sim | theory | slope (rps) | expected slope | "
        "first 1/4 | last 1/4 | growing |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for q in queue:
        lines.append(
            f"| {q['label']} | {q['rate_rps']:.3f} | {q['rate_over_mu']:.2f} | {q['rate_over_mu_sim']:.2f} "
            f"| {q['theory_region']} | {q['slope_rps']:.3f} | {q['expected_slope_rps']:.3f} "
            f"| {q['first_quarter_mean']:.1f} | {q['last_quarter_mean']:.1f} | {q['growing']} |"
        )
    return "\n".join(lines) + "\n"


def run(out_dir: Path, quick: bool) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = SIZES[bool(quick)]
    start = time.perf_counter()

    def log(name: str, row: dict[str, Any], wall_s: float) -> None:
        if "gap" in row:
            print(
                f"[queueing] {name}: theory {row['mu_theory_rps']:.3f} rps, sim {row['mu_sim_rps']:.3f} rps, "
                f"gap {100 * row['gap']:.2f}% ({wall_s:.1f} s)",
                flush=True,
            )
        else:
            print(
                f"[queueing] queue at {name} = {row['rate_rps']:.3f} rps: slope {row['slope_rps']:.3f} rps, "
                f"growing={row['growing']} ({wall_s:.1f} s)",
                flush=True,
            )

    rows, _ = _saturation_rows(sizes, log)
    queue = _queue_runs(rows[0], sizes["queue"], log)

    columns = list(rows[0])
    write_table_csv(out_dir / "table.csv", rows, columns=columns)
    write_table_csv(
        out_dir / "queue.csv", [{k: v for k, v in q.items() if not k.startswith("_")} for q in queue]
    )
    _bar_plot(out_dir / "theory_vs_sim.png", rows)
    plot_lines(
        out_dir / "queue_length.png",
        {
            f"{q['label']} = {q['rate_rps']:.2f} rps": (q["_grid"].tolist(), q["_queue"].tolist())
            for q in queue
        },
        "time (s)",
        "waiting requests",
        f"1:1 waiting queue, mu = {rows[0]['mu_theory_rps']:.2f} rps, mu_sim = {rows[0]['mu_sim_rps']:.2f} rps",
        markers=False,
    )
    md = _markdown(rows, queue)
    (out_dir / "table.md").write_text(md)
    results = to_json_value(
        {
            "experiment": "queueing",
            "quick": bool(quick),
            "config": {
                "model": MODEL,
                "gpu": GPU,
                "kv_tokens": KV_TOKENS,
                "chunk_size": CHUNK,
                "max_num_seqs": MAX_NUM_SEQS,
                "policy": "sarathi",
                "seed": SEED,
                "sizes": sizes,
                "b": "steps between the 10th and 90th percentile completion times of a saturated run; "
                "median, or the 10%-trimmed mean when the mean exceeds the median by > 10% (paper's rule)",
                "mu_sim": "steady_throughput_rps of the same run (completions/s between p10 and p90 completion)",
            },
            "rows": rows,
            "queue": [{k: v for k, v in q.items() if not k.startswith("_")} for q in queue],
            "wall_s": time.perf_counter() - start,
        }
    )
    with open(out_dir / "results.json", "w") as f:
        json.dump(results, f, indent=2, sort_keys=True)
        f.write("\n")
    print(md)
    return results
