"""Reproduce the Elastic KV Cache paper: lending the prefill activation reserve vs chunk size vs static overcommit.

Qwen2.5-7B on one A100-40GB (simulated on the cost model). 40 background requests (prompts of 3-5K tokens,
outputs of 256-4096, all at t=0) are decoding when 6 prompts of about 25K tokens arrive, one every 4.5 s
from t=40 s (each prefill, ~3 s, runs on its own, so TTFT measures prefill compute rather than queueing
behind another long prompt). Four modes:

* ``chunk-8192`` / ``chunk-32768``: chunked prefill with that token budget; the KV pool is what is left after
  weights and the activation reserve of that chunk size (``perf.memory.activation_reserve_bytes``);
* ``elastic-32768``: chunk 32768, with the reserve (minus what a decode step needs) lent to the KV pool while
  only decodes run and reclaimed before a prefill (``kvcache/elastic.py``, with modelled map/unmap latency);
* ``static-32768``: chunk 32768 with the reserve given to the KV pool for good: it runs until a prefill
  chunk needs activation memory that KV pages (live or cached) have taken, then fails with CUDA OOM.

Reported: median/max TTFT of the long prompts, KV capacity (base and with the reserve lent), failures
(``rows`` in results.json). A second scenario without long prompts (``decode_pressure``) lets the 40
requests' KV outgrow the chunk-32768 pool: the lent reserve absorbs it where the base pool preempts.
Then the share of time in which only decodes run (when lending is possible), with the length of those
periods, on chat (ShareGPT), bursty (gamma arrivals, cv 4) and long-context (LongBench) workloads, and the
reserve's share of KV memory for 7B TP1, 7B TP4 and 32B TP4 across chunk sizes. Same seed -> same numbers.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvbalance.engine import Instance, InstanceConfig, build_instance
from kvbalance.executor.sim import SimExecutor
from kvbalance.kvcache.elastic import ElasticConfig
from kvbalance.metrics.summary import to_json_value
from kvbalance.perf import memory as er
from kvbalance.perf.cost import CostModel
from kvbalance.perf.memory import kv_capacity_tokens
from kvbalance.reproduce import elastic_plots as plots
from kvbalance.request import Request, RequestState, SamplingParams
from kvbalance.sim.loop import simulate_instance
from kvbalance.specs import get_gpu, get_model
from kvbalance.workloads.presets import build_requests
from kvbalance.workloads.tokens import unique_prompt

MODEL = "qwen2.5-7b"
GPU = "a100-40gb"
GPU_UTIL = 0.9
BLOCK = 16
MAX_NUM_SEQS = 256
SEED = 0
MODES = ("chunk-8192", "chunk-32768", "elastic-32768", "static-32768")

# the TTFT scenario (same in quick and full runs: it is cheap)
NUM_BACKGROUND = 40
BACKGROUND_PROMPT = (3000, 5000)
BACKGROUND_OUTPUT = (256, 4096)
NUM_LONG = 6
LONG_PROMPT = (24_000, 26_000)
LONG_OUTPUT = 64
BURST_AT_S = 40.0
BURST_GAP_S = 4.5  # one long prompt every 4.5 s: each prefill (~3-4 s) runs on its own

# decode-phase pressure: background only, KV peaks above the chunk-32768 base pool
PRESSURE_PROMPT = (7000, 7600)
PRESSURE_OUTPUT = (1500, 2500)
PRESSURE_COLUMNS = (
    "mode",
    "kv_capacity_tokens",
    "kv_capacity_lent_tokens",
    "kv_used_peak_tokens",
    "preemptions",
    "drain_preemptions",
    "makespan_s",
    "output_tokens_per_s",
    "lends",
    "reclaims",
)

# decode-only share: (label, workload, arrival, cv, rate req/s, requests quick, requests full)
SHARE_WORKLOADS = (
    ("chat (sharegpt)", "sharegpt", "poisson", 1.0, 6.0, 300, 2000),
    ("bursty (sharegpt gamma cv 4)", "sharegpt", "gamma", 4.0, 6.0, 300, 2000),
    ("long-context (longbench)", "longbench", "poisson", 1.0, 0.4, 60, 300),
)
SHARE_CHUNK = 8192

RESERVE_CASES = (("qwen2.5-7b", 1), ("qwen2.5-7b", 4), ("qwen2.5-32b", 4))
RESERVE_CHUNKS = (2048, 4096, 8192, 16384, 32768)


# -- the TTFT scenario ---------------------------------------------------------------------------


def background_requests(
    rng: np.random.Generator, prompt: tuple[int, int], output: tuple[int, int]
) -> list[Request]:
    reqs = []
    for i in range(NUM_BACKGROUND):
        p = unique_prompt(10_000 + i, int(rng.integers(*prompt, endpoint=True)))
        out = int(rng.integers(*output, endpoint=True))
        reqs.append(Request(f"bg{i:02d}", p, SamplingParams(max_tokens=out, ignore_eos=True), 0.0))
    return reqs


def scenario_requests(seed: int = SEED) -> list[Request]:
    """40 background requests at t=0 and 6 long prompts from BURST_AT_S (unique prompts, seeded)."""
    rng = np.random.default_rng(seed)
    reqs = background_requests(rng, BACKGROUND_PROMPT, BACKGROUND_OUTPUT)
    for i in range(NUM_LONG):
        prompt = unique_prompt(20_000 + i, int(rng.integers(*LONG_PROMPT, endpoint=True)))
        at = BURST_AT_S + BURST_GAP_S * i
        reqs.append(Request(f"long{i}", prompt, SamplingParams(max_tokens=LONG_OUTPUT, ignore_eos=True), at))
    return reqs


def reserve_bytes(chunk: int, model: str = MODEL, tp: int = 1) -> int:
    return er.activation_reserve_bytes(get_model(model), chunk, tp)


def build_mode(mode: str) -> Instance:
    kind, chunk = mode.split("-")
    chunk = int(chunk)
    model = get_model(MODEL)
    kv_tokens = kv_capacity_tokens(model, GPU, 1, GPU_UTIL, reserve_bytes(chunk))
    elastic = None
    if kind in ("elastic", "static"):
        elastic = ElasticConfig.for_model(model, chunk, 1, BLOCK, MAX_NUM_SEQS, mode=kind)
    icfg = InstanceConfig(
        kv_tokens=kv_tokens - kv_tokens % BLOCK,
        block_size=BLOCK,
        chunk_size=chunk,
        max_num_seqs=MAX_NUM_SEQS,
        max_context=model.max_context,
        elastic=elastic,
        name=mode,
    )
    return build_instance(icfg, SimExecutor(CostModel(model, GPU, 1)))


def run_mode(mode: str, reqs: list[Request] | None = None) -> tuple[dict[str, Any], dict[str, list]]:
    inst = build_mode(mode)
    reqs = scenario_requests() if reqs is None else reqs
    trace: dict[str, list] = {"t": [], "capacity": [], "used": []}
    decode_only_s = [0.0]

    def on_step(driver, outcome, now):
        if outcome.plan.num_prefill_tokens == 0:
            decode_only_s[0] += outcome.result.duration_s
        trace["t"].append(outcome.start_s)
        load = inst.load()
        trace["capacity"].append(load.kv_capacity_tokens)
        trace["used"].append(load.kv_used_tokens + load.kv_cached_tokens)

    t0 = time.perf_counter()
    run = simulate_instance(inst, reqs, on_step=on_step)
    wall = time.perf_counter() - t0
    long = [r for r in reqs if r.request_id.startswith("long")]
    ttfts = [r.first_token_s - r.arrival_s for r in long if r.first_token_s is not None]
    ok = bool(long) and len(ttfts) == len(long) and not inst.failed
    base = inst.elastic.base_blocks * BLOCK if inst.elastic is not None else inst.kv_capacity_tokens
    lent = base + (inst.elastic.config.reserve_blocks * BLOCK if inst.elastic is not None else 0)
    el = inst.elastic.stats() if inst.elastic is not None else {}
    row = {
        "mode": mode,
        "ttft_median_s": statistics.median(ttfts) if ok else None,
        "ttft_max_s": max(ttfts) if ok else None,
        "kv_capacity_tokens": base,
        "kv_capacity_lent_tokens": lent,
        "failed": bool(inst.failed),
        "failure": inst.failure_reason,
        "oom_at_s": min((r.finish_s for r in reqs if r.reject_reason == "oom"), default=None),
        "rejected_oom": sum(1 for r in reqs if r.reject_reason == "oom"),
        "completed": sum(1 for r in reqs if r.state is RequestState.FINISHED),
        "preemptions": inst.load().num_preemptions,
        "makespan_s": run.makespan_s,
        "kv_used_peak_tokens": max(trace["used"], default=0),
        "output_tokens_per_s": sum(r.num_output_tokens for r in reqs if r.state is RequestState.FINISHED)
        / run.makespan_s
        if run.makespan_s
        else None,
        "decode_only_share": decode_only_s[0] / run.makespan_s if run.makespan_s else None,
        "lends": el.get("lends"),
        "reclaims": el.get("reclaims"),
        "drain_preemptions": el.get("drain_preemptions"),
        "drain_evicted_blocks": el.get("drain_evicted_blocks"),
        "switch_s": el.get("switch_s"),
        "reserve_gib": reserve_bytes(int(mode.split("-")[1])) / (1 << 30),
        "long_ttfts_s": ttfts,
        "sim_wall_s": wall,
    }
    if run.unfinished:
        raise RuntimeError(f"{mode}: {len(run.unfinished)} requests neither finished nor rejected")
    return row, trace


def pressure_rows() -> tuple[list[dict[str, Any]], dict[str, dict[str, list]]]:
    """Decode-phase memory pressure, no long prompts: 40 requests whose KV outgrows the chunk-32768 pool."""
    rows, traces = [], {}
    for mode in ("chunk-8192", "chunk-32768", "elastic-32768"):
        reqs = background_requests(np.random.default_rng(SEED + 1), PRESSURE_PROMPT, PRESSURE_OUTPUT)
        row, traces[mode] = run_mode(mode, reqs)
        rows.append({k: row[k] for k in PRESSURE_COLUMNS})
    return rows, traces


# -- decode-only share ---------------------------------------------------------------------------


def decode_only_share(label: str, workload: str, arrival: str, cv: float, rate: float, n: int) -> dict:
    """Share of simulated time whose steps are decode-only (where the reserve could be lent), and idle."""
    model = get_model(MODEL)
    kv_tokens = kv_capacity_tokens(model, GPU, 1, GPU_UTIL, reserve_bytes(SHARE_CHUNK))
    icfg = InstanceConfig(
        kv_tokens=kv_tokens - kv_tokens % BLOCK,
        block_size=BLOCK,
        chunk_size=SHARE_CHUNK,
        max_num_seqs=MAX_NUM_SEQS,
        max_context=model.max_context,
    )
    inst = build_instance(icfg, SimExecutor(CostModel(model, GPU, 1)))
    reqs = build_requests(workload, n, rate, SEED, model.max_context, arrival=arrival, cv=cv)
    acc = {"decode": 0.0, "mixed": 0.0}
    periods: list[float] = []  # lengths of runs of back-to-back decode-only steps (one lend each)
    last_end = [None]

    def on_step(driver, outcome, now):
        dt = outcome.result.duration_s
        if outcome.plan.num_prefill_tokens:
            acc["mixed"] += dt
            last_end[0] = None
            return
        acc["decode"] += dt
        if last_end[0] is not None and outcome.start_s == last_end[0]:
            periods[-1] += dt
        else:
            periods.append(dt)
        last_end[0] = now

    run = simulate_instance(inst, reqs, on_step=on_step)
    span = max(r.finish_s for r in reqs if r.finish_s is not None) - min(r.arrival_s for r in reqs)
    busy = acc["decode"] + acc["mixed"]
    return {
        "workload": label,
        "spec": workload,
        "arrival": arrival if arrival != "gamma" else f"gamma cv {cv:g}",
        "rate_rps": rate,
        "requests": n,
        "completed": sum(1 for r in reqs if r.state is RequestState.FINISHED),
        "steps": run.num_steps,
        "decode_only_share": acc["decode"] / span,
        "prefill_share": acc["mixed"] / span,
        "idle_share": max(0.0, 1.0 - busy / span),
        "decode_only_share_of_busy": acc["decode"] / busy if busy else None,
        "decode_only_periods": len(periods),
        "decode_only_period_median_s": statistics.median(periods) if periods else None,
        "decode_only_period_p90_s": float(np.percentile(periods, 90)) if periods else None,
        "simulated_s": span,
    }


# -- reserve share -------------------------------------------------------------------------------


def reserve_share(model_name: str, tp: int, chunk: int) -> dict:
    m, g = get_model(model_name), get_gpu(GPU)
    reserve = er.activation_reserve_bytes(m, chunk, tp)
    weights = m.weight_bytes // tp
    pool = er.kv_pool_bytes(g.mem_capacity_bytes, weights, reserve, GPU_UTIL)
    return {
        "model": model_name,
        "tp": tp,
        "case": f"{model_name} TP{tp}",
        "chunk_size": chunk,
        "reserve_gib": reserve / (1 << 30),
        "kv_pool_gib": pool / (1 << 30),
        "reserve_share_of_kv": er.reserve_share_of_kv(g.mem_capacity_bytes, weights, reserve, GPU_UTIL),
        "lendable_kv_tokens": er.lendable_kv_tokens(reserve, m, tp),
    }


# -- entry point ---------------------------------------------------------------------------------


def run(out_dir: Path, quick: bool) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    ttft_rows, traces = [], {}
    for mode in MODES:
        row, trace = run_mode(mode)
        ttft_rows.append(row)
        traces[mode] = trace
    by_mode = {r["mode"]: r for r in ttft_rows}
    a, b = by_mode["chunk-8192"]["ttft_median_s"], by_mode["chunk-32768"]["ttft_median_s"]
    ttft_gap = abs(a - b) / min(a, b) if a and b else None
    e = by_mode["elastic-32768"]
    capacity_gain = e["kv_capacity_lent_tokens"] / e["kv_capacity_tokens"] - 1

    pressure, pressure_traces = pressure_rows()
    share_rows = [
        decode_only_share(label, w, arr, cv, rate, nq if quick else nf)
        for label, w, arr, cv, rate, nq, nf in SHARE_WORKLOADS
    ]
    reserve_rows = [reserve_share(m, tp, c) for m, tp in RESERVE_CASES for c in RESERVE_CHUNKS]

    plots.write_tables(out, ttft_rows, pressure, PRESSURE_COLUMNS, share_rows, reserve_rows)
    plots.plot_long_prompt_ttft(
        out / "ttft_long_prompts.png",
        ttft_rows,
        f"{MODEL} on {GPU}: TTFT of {NUM_LONG} ~25K-token prompts over {NUM_BACKGROUND} decodes",
    )
    plots.plot_kv_capacity(out / "kv_capacity.png", traces, pressure_traces)
    plots.plot_reserve_share(out / "reserve_share.png", reserve_rows, GPU)

    results = {
        "experiment": "elastic",
        "model": MODEL,
        "gpu": GPU,
        "quick": quick,
        "rows": ttft_rows,
        "ttft_gap_chunk_8192_vs_32768": ttft_gap,
        "elastic_capacity_gain": capacity_gain,
        "decode_pressure": pressure,
        "decode_only_share": share_rows,
        "reserve_share": reserve_rows,
        "scenario": {
            "background": {"n": NUM_BACKGROUND, "prompt": BACKGROUND_PROMPT, "output": BACKGROUND_OUTPUT},
            "long": {"n": NUM_LONG, "prompt": LONG_PROMPT, "output": LONG_OUTPUT, "at_s": BURST_AT_S},
            "gpu_memory_utilization": GPU_UTIL,
            "block_size": BLOCK,
            "seed": SEED,
        },
        "wall_s": time.perf_counter() - t0,
    }
    results = to_json_value(results)
    (out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    return results
