"""Reproduce BanaServe's comparison on 8 x A100-80GB, in the paper's set-up and in today's, and find where its
gains come from: vLLM (2024 and today), DistServe, Llumnix, BanaServe (+ ablations) and this project's policy.

Settings (``SETTINGS``), one group each:

- ``paper``: the paper's workloads: LLaMA-13B (and OPT-13B, full run) on Alpaca (short prompts) and LongBench
  (long prompts, truncated to the 2,048-token context), Poisson and bursty (Gamma, cv 4) arrivals.
- ``reuse``: the loads BanaServe's global store and load-aware routing are for: shared documents with Zipf or
  uniform popularity (``docqa-*``: a working set that fits the GPUs' caches, and one that does not), multi-turn
  conversations (``chat``), the Mooncake conversation trace (full run; Llama-3.1-8B: its prompts average 12k
  tokens, beyond LLaMA-13B's context).
- ``phases``: loads whose mix shifts: prefill-heavy and decode-heavy periods of 15 s (30 s in the full run),
  and periodic bursts (full run): where a static prefill/decode split is wrong part of the time.

Per setting and system (``cluster/systems.SYSTEMS``): ``max_rate_at_slo_rps`` (highest rate at which 90% of
requests meet both SLOs, DistServe's SLO attainment), ``throughput_rps`` and ``total_time_s`` (one request set
at an overload rate, twice the best max rate found, the same for every system), ``mean_latency_s`` /
``p99_latency_s`` (end-to-end, at vLLM's max rate at SLO: the same load for all), ``hot_spot_ratio`` (max / min
busy fraction over instances of a role, at the overload rate), ``migrations`` and ``role_flips``, hit ratios,
and each system's whole configuration. Baselines run at their best: vLLM (today's, with chunked prefill, and
2024's without) under the best of its routers, DistServe under the split (and per-phase TP in the full run)
with the highest max rate at SLO, chosen on Poisson arrivals and kept for the bursty ones (a static plan);
Llumnix at its own defaults. BanaServe starts from DistServe's split.

Also per setting (``meta.json`` ``settings``): the max rate of every split DistServe searched and of every
vLLM router; goodput and throughput against the rate for the main systems (``curves``); every vLLM router's
hot-spot ratio at vLLM's max rate (``router_hot_spot``); on phase-shifting loads, each static split's and
each main system's max rate over the requests of each phase alone (``per_phase``); and the adaptive
controller's trace (per-GPU utilisation, imbalance, decisions and their reasons) in the ``banaserve*`` rows.

Cost: the max-rate search (``cluster/evaluate.py``) brackets, then bisects geometrically to a stated
resolution (quick 10%, full 5%), and each probe stops once its verdict is certain (exact). Results are
written after every setting; a rerun into the same folder skips the settings already there.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
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
from kvbalance.workloads.presets import parse_workload

GPU = "a100-80gb"
NUM_GPUS = 8
SEED = 0
# per-run time series: kept in series.json beside results.json, which holds the rows' figures (the series are
# megabytes on a full run; the plots show them, and a run's folder reads without them: those plots then leave
# the rows without series out)
SERIES_KEYS = ("busy_series", "controller_trace")
ARRIVALS = {"poisson": ("poisson", 1.0), "bursty": ("gamma", 4.0)}
PAPER = {  # BanaServe's reported ranges
    "throughput_vs_vllm": "1.2-3.9x",
    "throughput_vs_distserve": "1.1-2.8x",
    "total_time_reduction_vs_vllm": "3.9-78.4%",
    "latency_reduction_vs_distserve": "1.4-70.1%",
}
# the systems whose goodput is traced against the rate, and whose max rate is found per phase (with every
# static split DistServe searched)
MAIN = ("vllm", "distserve", "banaserve", "banaserve-paper", "kvbalance")
CURVE_FACTORS = (0.5, 0.75, 1.0, 1.25)  # x vLLM's max rate at SLO
# the systems of each group (the simulator's time on this machine is the budget): every one on the paper's
# workloads; on the others, vLLM 2024 under its best router only and the ablations that bear on them
SKIP = {
    "paper": (),
    "reuse": ("vllm-v0-round-robin", "vllm-v0-cache-aware"),
    "phases": ("vllm-round-robin", "vllm-cache-aware", "vllm-v0-round-robin", "vllm-v0-cache-aware",
               "banaserve-no-store", "banaserve-cache-aware"),
}  # fmt: skip


@dataclass(frozen=True)
class Setting:
    """One workload of the comparison. ``span_s``: (quick, full) seconds of arrivals at any rate."""

    group: str
    name: str  # the results' ``workload``
    workload: str  # the workload string (``workloads/presets.py``)
    arrival: str
    model: str
    ttft_slo_s: float
    tpot_slo_s: float
    span_s: tuple[float, float]
    requests: tuple[int, int]  # (min, max) requests of a run
    start_rps: float  # the first search's start: only its cost depends on it
    quick: bool = True  # in the quick run too

    @property
    def key(self) -> str:
        return f"{self.model}/{self.name}/{self.arrival}"


PHASES = "phases-{}"  # workloads/phases.py PRESETS


def _settings() -> list[Setting]:
    # SLOs (TTFT s, TPOT s). Alpaca: DistServe's chat SLO for OPT-13B (0.25 / 0.1). LongBench: prompts up to
    # ~2000 tokens prefill in ~0.2-0.3 s alone on one A100; 1.5 s allows a few queued prefills. Documents:
    # 1.5k-token contexts with a short question, 0.5 s. Conversations and phases: 1 s. Mooncake: 12k-token
    # prompts on average (up to 126k), 5 s. TPOT 0.1 s (reading speed) everywhere.
    def paper(model: str, quick: bool) -> list[Setting]:
        out = []
        for arr in ARRIVALS:
            out.append(Setting("paper", "alpaca", "alpaca", arr, model, 0.25, 0.1, (1.0, 2.0), (100, 4000), 256.0,
                               quick))  # fmt: skip
            out.append(Setting("paper", "longbench", "longbench", arr, model, 1.5, 0.1, (8.0, 16.0), (40, 1000), 8.0,
                               quick))  # fmt: skip
        return out

    out = paper("llama-13b", True)
    out += [
        Setting("reuse", "docqa-zipf", "docqa-zipf", "poisson", "llama-13b", 0.5, 0.1, (10.0, 15.0), (100, 4000), 64.0),
        Setting("reuse", "docqa-uniform", "docqa-uniform", "poisson", "llama-13b", 0.5, 0.1, (10.0, 15.0), (100, 4000),
                64.0),
        Setting("reuse", "docqa-large", "docqa-large", "poisson", "llama-13b", 0.5, 0.1, (10.0, 15.0), (100, 4000),
                32.0, quick=False),
        Setting("reuse", "chat", "chat", "poisson", "llama-13b", 1.0, 0.1, (20.0, 30.0), (100, 4000), 16.0),
        Setting("reuse", "mooncake", "mooncake", "poisson", "llama-3.1-8b", 5.0, 0.1, (60.0, 60.0), (50, 1500), 4.0,
                quick=False),
        Setting("phases", "phases-15", PHASES.format(15), "poisson", "llama-13b", 1.0, 0.1, (60.0, 60.0),
                (100, 6000), 32.0),
        Setting("phases", "phases-30", PHASES.format(30), "poisson", "llama-13b", 1.0, 0.1, (120.0, 120.0),
                (100, 8000), 32.0, quick=False),
        Setting("phases", "bursts", "bursts", "poisson", "llama-13b", 0.5, 0.1, (20.0, 20.0), (100, 4000), 16.0,
                quick=False),
    ]  # fmt: skip
    return out + paper("opt-13b", False)  # last: the same picture as llama-13b's in the earlier quick runs


# the most telling first (a long run is written setting by setting): the paper's Poisson loads, the reuse and
# phase-shifting ones, then bursty arrivals, the long-context trace, bursts and OPT-13B
_ORDER = ("llama-13b/alpaca/poisson", "llama-13b/longbench/poisson", "llama-13b/docqa-zipf/poisson",
          "llama-13b/docqa-uniform/poisson", "llama-13b/phases-15/poisson", "llama-13b/chat/poisson",
          "llama-13b/docqa-large/poisson", "llama-13b/phases-30/poisson")  # fmt: skip
SETTINGS = sorted(_settings(), key=lambda s: _ORDER.index(s.key) if s.key in _ORDER else len(_ORDER))


def _sizes(quick: bool) -> dict[str, Any]:
    # "prefill": GPUs given to prefill that DistServe's search tries (quick: the middle half, 2-6 of 8)
    if quick:
        edge = max(1, NUM_GPUS // 4)
        return {"resolution": 0.1, "tps": (1,), "prefill": range(edge, NUM_GPUS - edge + 1)}
    return {"resolution": 0.05, "tps": (1, 2), "prefill": range(1, NUM_GPUS)}


def _measure(
    wb: Workbench, system: str, cfg, max_rate: float, load_rate: float, overload_rate: float
) -> dict:
    at_load = wb.run(cfg, load_rate).summary
    over = wb.run(cfg, overload_rate)
    s = over.summary
    return {
        "system": system,
        "config": cfg.summary_line(),
        "config_detail": cfg.model_dump(exclude_defaults=True),
        "max_rate_at_slo_rps": max_rate,
        "throughput_rps": s["throughput_rps"],
        "total_time_s": s["makespan_s"],
        "mean_latency_s": at_load["e2e_s"]["mean"],
        "p99_latency_s": at_load["e2e_s"]["p99"],
        "ttft_p90_s": at_load["ttft_s"]["p90"],
        "tpot_p90_s": at_load["tpot_s"]["p90"],
        "slo_attainment_at_load": at_load["slo_attainment"],
        "load_rate_rps": load_rate,
        "overload_rate_rps": overload_rate,
        "hot_spot_ratio": s["hot_spot_ratio"],
        "hot_spot_ratio_by_role": s["hot_spot_ratio_by_role"],
        "hot_spot_ratio_at_load": at_load["hot_spot_ratio"],
        "migrations": s["migrations"],
        "role_flips": at_load["role_flips"],
        "migration_log": s.get("migration_log", []),
        "migrations_at_load": at_load["migrations"],
        "migration_log_at_load": at_load.get("migration_log", []),
        "role_log": at_load["role_log"],
        "controller_trace": at_load["controller_trace"],  # at vLLM's max rate: the load the SLO is met at
        "store_fetched_blocks": s["store_fetched_blocks"],
        "prefix_hit_rate": at_load["prefix_hit_rate"],
        "store_hit_rate": at_load["store_hit_rate"],
        "decode_local_hit_rate": at_load["decode_local_hit_rate"],
        "preemptions": s["preemptions"],
        "busy_series": {
            k: [list(map(float, t)), list(map(float, f))]
            for k, (t, f) in wb.run(cfg, load_rate)
            .run.busy_series(max(at_load["makespan_s"] / 60, 1e-3))
            .items()
        },  # fmt: skip
    }


def _per_phase(wb: Workbench, st: Setting, cfgs: dict, start: float) -> dict:
    """Max rate at SLO over the requests of each phase alone, per config (probes stop once their verdict on
    that phase's requests is certain)."""
    phases = range(len(parse_workload(st.workload).options.phases))
    out: dict[str, list[float]] = {}
    for j in phases:
        pw = Workbench(st.model, GPU, st.workload, *ARRIVALS[st.arrival], st.ttft_slo_s, st.tpot_slo_s,
                       duration_s=wb.duration_s, min_requests=wb.min_requests, max_requests=wb.max_requests,
                       seed=SEED, resolution=wb.resolution, slo_meta=("phase", j), on_run=wb.on_run,
                       _cache=wb._cache)  # fmt: skip
        for name, cfg in cfgs.items():
            out.setdefault(name, []).append(pw.max_rate_at_slo(cfg, start, 1 + wb.resolution))
    return out


def _one_setting(st: Setting, quick: bool, split, tick) -> tuple[list[dict], tuple, dict]:
    sizes = _sizes(quick)
    kind, cv = ARRIVALS[st.arrival]
    lo, hi = st.requests
    wb = Workbench(st.model, GPU, st.workload, kind, cv, st.ttft_slo_s, st.tpot_slo_s,
                   duration_s=st.span_s[0 if quick else 1], min_requests=lo, max_requests=hi, seed=SEED,
                   resolution=sizes["resolution"], on_run=tick)  # fmt: skip
    start, step = st.start_rps, 1 + sizes["resolution"]
    notes: dict[str, Any] = {"group": st.group, "workload_string": st.workload}
    splits = [sp for sp in distserve_splits(NUM_GPUS, sizes["tps"]) if sp[0] * sp[2] in sizes["prefill"]]
    # the even split first (the likely winner: then the others are pruned in a probe or two)
    splits.sort(key=lambda sp: (abs(2 * sp[0] * sp[2] - NUM_GPUS), sp))
    if split is None:  # DistServe's search: every split and per-phase TP of the budget
        i, _, rates = wb.best_of([pd_config(*sp) for sp in splits], start)
        split = splits[i]
        notes["distserve_search"] = [
            {"split": sp, "max_rate_at_slo_rps": r or None} for sp, r in zip(splits, rates)
        ]
    ds = wb.max_rate_at_slo(system_config("distserve", NUM_GPUS, split), start)  # searched above if split was
    best_router = {}
    for fam, v0 in (("vllm", False), ("vllm-v0", True)):
        j, _, rates = wb.best_of([vllm_config(NUM_GPUS, r, v0=v0) for r in VLLM_ROUTERS], ds or start)
        best_router[fam] = VLLM_ROUTERS[j]
        notes[f"{fam}_routers"] = {r: (x or None) for r, x in zip(VLLM_ROUTERS, rates)}
    cfgs = {
        s: system_config(s, NUM_GPUS, split, best_router.get(s))
        for s in SYSTEMS
        if s not in NOT_YET and s not in SKIP[st.group]
    }
    # the others start from DistServe's rate (most share its split), first bracket step 1 + resolution
    max_rates = {s: wb.max_rate_at_slo(c, ds or start, step) for s, c in cfgs.items()}
    load_rate = max_rates["vllm"] or start / 4
    overload = 2 * max(max(max_rates.values()), load_rate)
    rows = []
    for s, c in cfgs.items():
        row = {"model": st.model, "workload": st.name, "arrival": st.arrival, "group": st.group,
               **_measure(wb, s, c, max_rates[s], load_rate, overload)}  # fmt: skip
        row["slo_probes"] = sorted(wb.probes.get(wb.key(c), []))
        rows.append(row)
    for s, why in NOT_YET.items():
        rows.append(
            {"model": st.model, "workload": st.name, "arrival": st.arrival, "system": s, "not_run": why}
        )
    notes["curves"] = {
        s: [
            {"rate_rps": f * load_rate, **{k: wb.run(cfgs[s], f * load_rate).summary[k]
                                           for k in ("goodput_rps", "throughput_rps", "slo_attainment")}}
            for f in CURVE_FACTORS
        ]
        for s in MAIN
    }  # fmt: skip
    notes["router_hot_spot"] = {
        r: wb.run(vllm_config(NUM_GPUS, r), load_rate).summary["hot_spot_ratio"] for r in VLLM_ROUTERS
    }
    notes["router_hot_spot"]["store_aware (kvbalance)"] = wb.run(cfgs["kvbalance"], load_rate).summary[
        "hot_spot_ratio"
    ]
    if st.group == "phases":
        per = _per_phase(wb, st, {**{f"split {sp}": pd_config(*sp) for sp in splits},
                                  **{s: cfgs[s] for s in MAIN if s != "distserve"}}, ds or start)  # fmt: skip
        notes["per_phase"] = per
        static = [v for k, v in per.items() if k.startswith("split")]
        notes["best_static_per_phase"] = [max(v[j] for v in static) for j in range(len(static[0]))]
        for row in rows:
            row["per_phase_max_rate_rps"] = per.get(row["system"])
    notes.update({"split": split, "slo_ttft_s": st.ttft_slo_s, "slo_tpot_s": st.tpot_slo_s,
                  "arrival_span_s": wb.duration_s, "requests_at_overload": wb.requests_for(overload),
                  "best_router": best_router})  # fmt: skip
    return rows, split, notes


def _row_key(row: dict) -> str:
    return "/".join(str(row[k]) for k in ("model", "workload", "arrival", "system"))


def split_series(rows: list[dict]) -> tuple[list[dict], dict[str, dict]]:
    """(rows without their time series, {model/workload/arrival/system: the series})."""
    series = {
        _row_key(r): {k: r[k] for k in SERIES_KEYS if k in r}
        for r in rows
        if any(k in r for k in SERIES_KEYS)
    }
    return [{k: v for k, v in r.items() if k not in SERIES_KEYS} for r in rows], series


def join_series(rows: list[dict], series: dict[str, dict]) -> list[dict]:
    """:func:`split_series` undone (rows whose series are not there stay without)."""
    return [r | series.get(_row_key(r), {}) for r in rows]


def run(
    out_dir: Path,
    quick: bool = False,
    models: tuple[str, ...] | None = None,
    groups: tuple[str, ...] | None = None,
    settings: tuple[str, ...] | None = None,
) -> dict:
    """Run the reproduction into ``out_dir``; ``models`` / ``groups`` keep only those settings, and ``settings``
    those named (a key ``model/workload/arrival`` or a workload name: every arrival and model of it). Results are
    written after each setting; settings already in ``out_dir/results.json`` are kept, not rerun (and reported
    whatever the filter)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvbalance.reproduce.banaserve_report import write_plots, write_readme

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = settings
    settings = [s for s in SETTINGS if (s.quick or not quick)]
    if models is not None:
        settings = [s for s in settings if s.model in models]
    if groups is not None:
        settings = [s for s in settings if s.group in groups]
    if names is not None:
        unknown = set(names) - {n for s in SETTINGS for n in (s.key, s.name)}
        if unknown:
            raise ValueError(f"unknown settings {sorted(unknown)}: names are {sorted({s.name for s in SETTINGS})}"
                             " or keys model/workload/arrival")  # fmt: skip
        settings = [s for s in settings if s.key in names or s.name in names]
    rows: list[dict] = []
    meta: dict[str, Any] = {"settings": {}, "wall_s": 0.0, "cpu_s": 0.0, "simulated_runs": 0}
    if (out / "results.json").exists() and (out / "meta.json").exists():
        old_meta = json.loads((out / "meta.json").read_text())
        if old_meta.get("quick") == quick:
            meta = old_meta
            rows = json.loads((out / "results.json").read_text())
            if (out / "series.json").exists():
                rows = join_series(rows, json.loads((out / "series.json").read_text()))
    done = {k for k in meta["settings"]}
    code = _code_state()  # at the start: the code this process imported
    t0, c0, load0 = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    runs = [meta.get("simulated_runs", 0)]
    wall0, cpu0 = meta.get("wall_s", 0.0), meta.get("cpu_s", 0.0)

    def save() -> None:
        meta.update({"quick": quick, "gpu": GPU, "num_gpus": NUM_GPUS, "seed": SEED, "paper": PAPER,
                     "wall_s": wall0 + time.perf_counter() - t0, "cpu_s": cpu0 + time.process_time() - c0,
                     "load_average": f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end",
                     "simulated_runs": runs[0], "sizes": _sizes(quick) | {"prefill": list(_sizes(quick)["prefill"])},
                     "engine": _engine_name()})  # fmt: skip
        slim, series = split_series(to_json_value(rows))
        (out / "results.json").write_text(json.dumps(slim, indent=1, default=str))
        (out / "series.json").write_text(json.dumps(series, default=str))
        (out / "meta.json").write_text(json.dumps(to_json_value(meta), indent=1, default=str))

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    ) as bar:
        task = bar.add_task("banaserve", total=len(settings), completed=sum(s.key in done for s in settings))
        sim_task = bar.add_task("simulated runs", total=None, completed=runs[0])

        def tick() -> None:
            runs[0] += 1
            bar.update(sim_task, completed=runs[0])

        splits: dict[tuple[str, str], tuple] = {
            (k.split("/")[0], k.split("/")[1]): tuple(v["split"]) for k, v in meta["settings"].items()
        }
        for st in settings:
            if st.key in done:
                continue
            bar.update(task, description=st.key)
            r, split, n = _one_setting(st, quick, splits.get((st.model, st.name)), tick)
            splits[(st.model, st.name)] = split
            rows += r
            meta["settings"][st.key] = n | {"code": code}
            save()
            bar.advance(task)
    save()
    write_plots(out, rows, meta)
    write_readme(out, rows, meta)
    return {"rows": len(rows), "wall_s": meta["wall_s"], "cpu_s": meta["cpu_s"], "simulated_runs": runs[0],
            "out": str(out)}  # fmt: skip


def _code_state() -> str | None:
    """The commit the setting was measured at (``+dirty`` with uncommitted changes under kvbalance/), if in git."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvbalance"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _engine_name() -> str:
    from kvbalance.perf.engines import resolve_engine
    from kvbalance.specs import get_gpu

    return resolve_engine(None, get_gpu(GPU)).name
