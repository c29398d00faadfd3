"""Issue 24, check (b): an upper bound on what role flips can give BanaServe on ``phases-15`` (a what-if,
simulator only), beside the systems, on the same requests and seed as ``kvbalance reproduce banaserve``.

Configs (all from the ``phases-15`` setting of ``reproduce/banaserve.py``: llama-13b, 8 x A100-80GB,
TTFT 1 s, TPOT 0.1 s, 60 s of Poisson arrivals, seed 0):

- ``distserve``: the static splits (4P + 2D TP2, DistServe's choice, and 4P + 4D, tied with it);
- ``banaserve``: the system (role flips by measured load, ``cluster/role_flip.py``), from 4P + 2D TP2 and
  from 4P + 4D; ``+drain``: with resident drain (``cluster/resident_drain.py``, copies at the link's cost),
  ``+drain-free``: the same with copies taking no time (what-if);
- ``whatif-oracle k0/k1``: what-if, flips by the known phase schedule (``cluster/whatif_phase_oracle.py``):
  k0 prefill instances of the 8 (TP 1) in prefill-heavy periods, k1 in decode-heavy ones, flipped as each
  period begins (one instance per 0.5 s tick), with or without free resident drain.

Max rate at SLO (90% of requests within both SLOs) by the project's search (``Workbench.max_rate_at_slo``)
at 5% for the grid, then 1% for the configs that matter; per-phase max rates (SLO over each phase's
requests) at 5%; at 40.6 req/s (1.2x DistServe's 33.8) one full run each, with per-period misses and the
time series plotted (``flip_bound.png``).

    PYTHONPATH=. python benchmarks/banaserve_flip_bound.py --out benchmarks/results/banaserve_phases/flip_bound
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
from pathlib import Path

import numpy as np

from kvbalance.cluster.adaptive import MigrationSection
from kvbalance.cluster.evaluate import Workbench
from kvbalance.cluster.systems import BANASERVE_MIGRATION, system_config
from kvbalance.cluster.whatif_phase_oracle import PhaseOracle
from kvbalance.metrics.summary import meets_slo
from kvbalance.reproduce.banaserve import ARRIVALS, GPU, SEED, SETTINGS

ST = next(s for s in SETTINGS if s.name == "phases-15")
PERIOD_S = 15.0
DISTSERVE = 33.784244  # its max rate at SLO in benchmarks/results/banaserve_phases/after (5% search)
TARGET = 1.2 * DISTSERVE


def workbench(resolution: float, phase: int | None = None) -> Workbench:
    return Workbench(ST.model, GPU, ST.workload, *ARRIVALS[ST.arrival], ST.ttft_slo_s, ST.tpot_slo_s,
                     duration_s=ST.span_s[1], min_requests=ST.requests[0], max_requests=ST.requests[1], seed=SEED,
                     resolution=resolution, slo_meta=None if phase is None else ("phase", phase))  # fmt: skip


def banaserve(split, drain: str | None = None):
    cfg = system_config("banaserve", 8, split)
    if drain is None:
        return cfg
    mig = BANASERVE_MIGRATION.model_copy(update={"drain_residents": True, "drain_free": drain == "free"})
    return cfg.model_copy(update={"migration": mig})


def oracle(k0: int, k1: int, drain: bool):
    mig = MigrationSection(role_flip=True, moves=False, drain_residents=drain, drain_free=drain,
                           flip_oracle=PhaseOracle.phases(PERIOD_S, (k0, k1)))  # fmt: skip
    return system_config("banaserve", 8, (4, 4, 1, 1)).model_copy(update={"migration": mig})


# schedules over the 30 s cycle (start in the cycle, prefill instances of the 8): per-phase counts flipped early
# or late, and counts that change inside a period
SCHEDULES = (
    ((0.0, 6), (15.0, 2)),
    ((0.0, 6), (14.0, 2)),
    ((0.0, 6), (16.0, 2)),
    ((15.0, 2), (29.0, 6)),
    ((1.0, 6), (15.0, 2)),
    ((0.0, 5), (3.0, 6), (15.0, 2)),
    ((0.0, 7), (3.0, 6), (15.0, 2)),
    ((0.0, 6), (10.0, 5), (15.0, 2)),
    ((0.0, 6), (15.0, 3), (20.0, 2)),
    ((0.0, 6), (15.0, 2), (25.0, 3)),
    ((0.0, 6), (15.0, 2), (27.0, 4)),
    ((0.0, 6), (15.0, 3)),
)


def schedule_oracle(sched, drain: bool, flips_per_tick: int = 1):
    mig = MigrationSection(role_flip=True, moves=False, drain_residents=drain, drain_free=drain,
                           flip_oracle=PhaseOracle(cycle_s=2 * PERIOD_S, schedule=sched,
                                                   flips_per_tick=flips_per_tick))  # fmt: skip
    return system_config("banaserve", 8, (4, 4, 1, 1)).model_copy(update={"migration": mig})


def demand(res, bin_s: float = 1.0) -> dict:
    """What the load asks of the GPUs each second, in TP-1 GPUs (a fluid estimate from the run's requests and
    the cost model, for the plot): prompts arriving (their tokens x a 512-token chunk's seconds per token),
    and the decodes running (requests between their first token and their end, over the most a TP-1 GPU
    decodes within the TPOT SLO at their mean context, or their KV over its pool, whichever is more)."""
    cl = res.cluster
    cm = next(m for m in cl.members if len(m.gpus) == 1).instance.executor.cost_model
    cap = next(m for m in cl.members if len(m.gpus) == 1).instance.kv_capacity_tokens
    s_per_token = cm.step_seconds([(512, 512, True)]) / 512
    reqs = res.run.requests
    end = max(r.finish_s for r in reqs if r.finish_s is not None)
    t = np.arange(0.0, end + bin_s, bin_s)
    prefill = np.zeros(len(t))
    for r in reqs:
        prefill[int(r.arrival_s // bin_s)] += r.num_prompt_tokens * s_per_token / bin_s
    decode = np.zeros(len(t))
    live = [r for r in reqs if r.first_token_s is not None and r.finish_s is not None]
    for j, x in enumerate(t):
        now = [r for r in live if r.first_token_s <= x < r.finish_s]
        if not now:
            continue
        ctx = [r.num_prompt_tokens + bisect.bisect_right(r.token_times_s, x) for r in now]  # KV held at x
        mean = int(sum(ctx) / len(ctx))
        n = 1
        while n < 512 and cm.step_seconds([(1, mean, False)] * (n + 1)) <= ST.tpot_slo_s:
            n += 1
        decode[j] = max(len(now) / n, sum(ctx) / cap)
    return {"demand_prefill_gpus": prefill.tolist(), "demand_decode_gpus": decode.tolist()}


def configs() -> dict:
    out = {
        "distserve 4P+2D(tp2)": system_config("distserve", 8, (4, 2, 1, 2)),
        "distserve 4P+4D": system_config("distserve", 8, (4, 4, 1, 1)),
        "banaserve 4P+2D(tp2)": banaserve((4, 2, 1, 2)),
        "banaserve 4P+2D(tp2) +drain": banaserve((4, 2, 1, 2), "link"),
        "banaserve 4P+2D(tp2) +drain-free (what-if)": banaserve((4, 2, 1, 2), "free"),
        "banaserve 4P+4D": banaserve((4, 4, 1, 1)),
        "banaserve 4P+4D +drain": banaserve((4, 4, 1, 1), "link"),
    }
    for k0, k1 in ((5, 2), (5, 3), (6, 2), (6, 3), (6, 4), (7, 2)):
        for drain in (False, True):
            out[f"whatif-oracle {k0}/{k1}" + (" +drain-free" if drain else "")] = oracle(k0, k1, drain)
    return out


def per_period(wb: Workbench, reqs) -> list[dict]:
    out: dict[int, dict] = {}
    for q in reqs:
        d = out.setdefault(
            int(q.arrival_s // PERIOD_S), {"requests": 0, "ok": 0, "ttft_miss": 0, "tpot_miss": 0}
        )
        d["requests"] += 1
        if meets_slo(q, wb.ttft_slo_s, wb.tpot_slo_s):
            d["ok"] += 1
        elif q.ttft_s is None or q.ttft_s > wb.ttft_slo_s:
            d["ttft_miss"] += 1
        else:
            d["tpot_miss"] += 1
    return [out[k] | {"period": k, "phase": k % 2} for k in sorted(out)]


def series(res, wb: Workbench, bin_s: float = 1.0) -> dict:
    """Per second: requests arriving then that miss TTFT / TPOT, prefill instances, KV held per role."""
    cl = res.cluster
    end = max(r.finish_s for r in res.run.requests if r.finish_s is not None)
    t = np.arange(0.0, end + bin_s, bin_s)
    miss_ttft, miss_tpot = np.zeros(len(t)), np.zeros(len(t))
    for q in res.run.requests:
        i = int(q.arrival_s // bin_s)
        if not meets_slo(q, wb.ttft_slo_s, wb.tpot_slo_s):
            if q.ttft_s is None or q.ttft_s > wb.ttft_slo_s:
                miss_ttft[i] += 1
            else:
                miss_tpot[i] += 1
    first: dict[str, str] = {}
    for f in cl.role_log:  # each member's role before its first flip
        first.setdefault(f["instance"], f["from"])
    roles = {
        m.name: [(0.0, first.get(m.name, m.role))]
        + [(f["t_s"], f["to"]) for f in cl.role_log if f["instance"] == m.name]
        for m in cl.members
    }

    def role_at(name, x):
        r = roles[name][0][1]
        for s, to in roles[name]:
            if s <= x:
                r = to
        return r

    gpus = {m.name: len(m.gpus) for m in cl.members}
    n_prefill_gpus = [sum(g for n, g in gpus.items() if role_at(n, x) == "prefill") for x in t]
    kv = {"prefill": np.zeros(len(t)), "decode": np.zeros(len(t))}
    running = {"prefill": np.zeros(len(t)), "decode": np.zeros(len(t))}
    for m in cl.members:
        ts, used, run = (m.timeline.column(c) for c in ("time_s", "kv_used_tokens", "running"))
        if not len(ts):
            continue
        idx = np.searchsorted(ts, t, side="right") - 1
        for j, x in enumerate(t):
            if idx[j] >= 0:
                kv[role_at(m.name, x)][j] += used[idx[j]]
                running[role_at(m.name, x)][j] += run[idx[j]]
    return {"t_s": t.tolist(), "ttft_miss": miss_ttft.tolist(), "tpot_miss": miss_tpot.tolist(),
            "prefill_gpus": n_prefill_gpus, "kv_tokens_on_prefill": kv["prefill"].tolist(),
            "kv_tokens_on_decode": kv["decode"].tolist(), "running_on_prefill": running["prefill"].tolist(),
            "running_on_decode": running["decode"].tolist()}  # fmt: skip


def plot(out: Path, runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.2 * len(runs)), sharex=True)
    for ax, (name, r) in zip(np.atleast_1d(axes), runs.items()):
        s = r["series"]
        t = np.array(s["t_s"])
        for k in range(0, int(t[-1] // PERIOD_S) + 1, 2):
            ax.axvspan(k * PERIOD_S, (k + 1) * PERIOD_S, color="0.92", lw=0)
        ax.bar(
            t,
            s["ttft_miss"],
            width=1.0,
            align="edge",
            color="tab:red",
            alpha=0.6,
            label="TTFT misses (by arrival)",
        )
        ax.bar(t, s["tpot_miss"], width=1.0, align="edge", bottom=s["ttft_miss"], color="tab:orange", alpha=0.6,
               label="TPOT misses")  # fmt: skip
        ax.set_ylabel("misses / s")
        ax2 = ax.twinx()
        ax2.step(t, s["prefill_gpus"], where="post", color="k", label="prefill GPUs")
        ax2.plot(t, np.array(s["kv_tokens_on_decode"]) / 62480, color="tab:blue",
                 label="KV on decode instances (TP-1 GPUs' worth)")  # fmt: skip
        ax2.plot(t, np.array(s["kv_tokens_on_prefill"]) / 62480, color="tab:green",
                 label="KV on prefill instances (GPUs' worth)")  # fmt: skip
        if "demand_prefill_gpus" in s:
            dem = np.array(s["demand_prefill_gpus"]) + np.array(s["demand_decode_gpus"])
            ax2.plot(t[: len(dem)], dem[: len(t)], color="tab:purple", ls="--",
                     label="demand: prompts arriving + decodes running (TP-1 GPUs, fluid estimate)")  # fmt: skip
            ax2.axhline(8, color="tab:purple", lw=0.5)
        ax2.set_ylim(0, 12)
        ax2.set_ylabel("GPUs")
        ax.set_title(f"{name}: attainment {r['slo_attainment']:.3f} at {r['rate_rps']:.1f} req/s "
                     "(grey: prefill-heavy periods)")  # fmt: skip
        if ax is np.atleast_1d(axes)[0]:
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=7, ncol=2)
    np.atleast_1d(axes)[-1].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(out / "flip_bound.png", dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfgs = configs()
    coarse = workbench(0.05)
    result: dict = {"setting": ST.key, "workload": ST.workload, "slo": [ST.ttft_slo_s, ST.tpot_slo_s],
                    "distserve_max_rate": DISTSERVE, "target_1_2x": TARGET, "max_rate_5pct": {}}  # fmt: skip
    for name, cfg in cfgs.items():
        result["max_rate_5pct"][name] = coarse.max_rate_at_slo(cfg, DISTSERVE, 1.05)
        print(f"{name}: {result['max_rate_5pct'][name]:.2f}", flush=True)
    best_oracle = max((n for n in cfgs if n.startswith("whatif")), key=lambda n: result["max_rate_5pct"][n])
    fine_names = ["distserve 4P+2D(tp2)", "distserve 4P+4D", "banaserve 4P+2D(tp2)", "banaserve 4P+2D(tp2) +drain",
                  best_oracle,
                  best_oracle + " +drain-free" if "drain" not in best_oracle else best_oracle.split(" +")[0]]  # fmt: skip
    fine = workbench(0.01)
    result["max_rate_1pct"] = {}
    for name in fine_names:
        lo = result["max_rate_5pct"][name]
        result["max_rate_1pct"][name] = fine.max_rate_at_slo(cfgs[name], lo or DISTSERVE, 1.01)
        print(f"1%: {name}: {result['max_rate_1pct'][name]:.2f}", flush=True)
    best_static = max(result["max_rate_1pct"][n] for n in fine_names if n.startswith("distserve"))
    result["best_static_1pct"] = best_static
    rates = (TARGET, 1.2 * best_static)
    result["schedules"] = {"rates_rps": rates, "attainment": {}}
    for sched in SCHEDULES:
        for drain in (False, True):
            name = "; ".join(f"{n}P from {t:g} s" for t, n in sched) + (" +drain-free" if drain else "")
            cfg = schedule_oracle(sched, drain)
            result["schedules"]["attainment"][name] = [
                coarse.run(cfg, r).summary["slo_attainment"] for r in rates
            ]
            print(f"schedule {name}: {result['schedules']['attainment'][name]}", flush=True)
    result["per_phase_max_rate_5pct"] = {}
    for name in ("distserve 4P+2D(tp2)", "banaserve 4P+2D(tp2)", best_oracle, fine_names[-1]):
        result["per_phase_max_rate_5pct"][name] = [
            workbench(0.05, j).max_rate_at_slo(cfgs[name], DISTSERVE, 1.05) for j in (0, 1)
        ]
        print(f"per phase: {name}: {result['per_phase_max_rate_5pct'][name]}", flush=True)
    runs = {}
    for name in ("distserve 4P+2D(tp2)", "banaserve 4P+2D(tp2)", "banaserve 4P+2D(tp2) +drain", best_oracle,
                 fine_names[-1]):  # fmt: skip
        res = coarse.run(cfgs[name], TARGET)
        s = res.summary
        runs[name] = {"rate_rps": TARGET, "slo_attainment": s["slo_attainment"], "role_flips": s["role_flips"],
                      "drain_moved": s.get("drain_moved"), "preemptions": s["preemptions"],
                      "per_period": per_period(coarse, res.run.requests), "role_log": s["role_log"],
                      "series": series(res, coarse) | demand(res)}  # fmt: skip
        print(f"at {TARGET:.1f}: {name}: {s['slo_attainment']:.4f}", flush=True)
    result["at_1_2x"] = runs
    result["configs"] = {n: c.model_dump(exclude_defaults=True) for n, c in cfgs.items()}
    result["wall_s"] = time.perf_counter() - t0
    (args.out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    plot(
        args.out,
        {n: runs[n] for n in ("distserve 4P+2D(tp2)", "banaserve 4P+2D(tp2)", best_oracle, fine_names[-1])},
    )


if __name__ == "__main__":
    main()
