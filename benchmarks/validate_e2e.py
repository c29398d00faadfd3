"""Validation of simulated end-to-end figures against public measurements (issue 23): each row is one
published measurement (model, GPU, TP, engine and version, workload, figure, source), simulated under the
engine profile that matches its engine, on the same requests as far as the source states them. Nothing here
is fitted: the GPU presets are fitted on the operator profiles alone, and a bad row stays with its cause.

    nice -n 10 .venv/bin/python benchmarks/validate_e2e.py --out benchmarks/results/validation

writes ``validation.json`` (every row, its simulated figure and error, the seeds' spread where a workload is
sampled) and prints the markdown table of ``docs/validation.md``. ``--rows ID,ID`` runs some rows only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvbalance.perf.engines import get_engine
from kvbalance.request import Request, SamplingParams
from kvbalance.sim.run import SimulateConfig, run_simulation
from kvbalance.workloads.presets import describe_workload
from kvbalance.workloads.tokens import unique_prompt

GPT_FAST = "https://github.com/pytorch-labs/gpt-fast (README, Benchmarks; commit 0f925b5)"
GPT_FAST_NOTE = (
    "A100-80GB power-limited to 330 W, 5-token prompt, 200 new tokens (generate.py default), tok/s = new "
    "tokens / generate() time (eager prefill included), bf16"
)
VLLM_CI_A100 = "https://buildkite.com/vllm/performance-benchmark/builds/9523"
VLLM_CI_H200 = "https://buildkite.com/vllm/performance-benchmark/builds/9515"
VLLM_CI_H100 = "https://buildkite.com/vllm/performance-benchmark/builds/9555"
VLLM_CI_VERSION = "vLLM main, V0 engine, 0.6 era (perf-benchmark builds 95xx: autumn 2024 by their numbering)"
LATENCY_NOTE = (
    "benchmark_latency: 8 prompts of 32 tokens, 128 output tokens each, dummy weights, mean of 15 runs"
)
THROUGHPUT_NOTE = (
    "benchmark_throughput: 200 ShareGPT prompts, their own output lengths (ignore_eos), all at once, no chunked "
    "prefill, no prefix caching; 42,659 prompt + 43,545 output tokens (Llama-3 tokenizer); simulated: 200 "
    "pairs from the vLLM artifact's ShareGPT lengths (vLLM's filter), scaled to those totals, 5 seeds"
)
# What vLLM's CI throughput test ran (.buildkite/nightly-benchmarks/tests/throughput-tests.json: --dataset
# ShareGPT_V3_unfiltered_cleaned_split.json --num-prompts 200 --load-format dummy, nothing else) through
# benchmarks/benchmark_throughput.py of the 0.6 line (vllm-project/vllm at 018efffd, September 2024):
# - sample_requests: random.seed(0), shuffle, first two turns, tokenised with the model's tokenizer, pairs
#   dropped where prompt < 4 or output < 4 or prompt > 1024 or prompt + output > 2048; the first 200 kept;
# - SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len): every request runs
#   to its completion's length;
# - LLM(...) with --enable-chunked-prefill / --enable-prefix-caching store_true flags, so both are passed
#   False explicitly: V0's EngineArgs turns chunked prefill on for long contexts only when it is None, so the
#   128K Llama-3.1-8B runs without it too (max_num_batched_tokens = max_model_len); max_num_seqs 256,
#   gpu_memory_utilization 0.9, num_scheduler_steps 1 (no multi-step), CUDA graphs (enforce_eager off).
# The 200 pairs that sampler picks total 42,659 prompt and 43,545 output tokens under the Llama-3 tokenizer:
# vLLM's benchmark_throughput.py run in vllm-project/vllm-ascend's docs (developer_guide/evaluation/
# performance_benchmark.md, Meta-Llama-3.1-8B-Instruct: "Total num prompt tokens: 42659, Total num output
# tokens: 43545"); benchmark_serving's ShareGPT sampler (the same procedure) reports the same 42,659 input
# tokens with the Llama-3.3-70B tokenizer. The artifact's pairs (all of ShareGPT's turns, OPT tokenizer, means
# 161 / 338) are a different population: 200 of them hold 25-43K prompt and 65-76K output tokens.
VLLM_SHAREGPT_PROMPTS = 200
VLLM_SHAREGPT_PROMPT_TOKENS = 42_659
VLLM_SHAREGPT_OUTPUT_TOKENS = 43_545


@dataclass(frozen=True)
class Row:
    """One public measurement and how to simulate it."""

    id: str
    source: str
    engine_version: str
    profile: str  # the engine profile it is simulated under
    model: str
    gpu: str
    tp: int
    kind: str  # "bs1_tok_s", "batch_latency_s" or "offline_rps"
    measured: float
    unit: str
    workload: dict = field(default_factory=dict)
    note: str = ""
    compare: tuple[str, ...] = ()  # other profiles to simulate it under, for context (not scored)


ROWS: tuple[Row, ...] = (
    Row("gpt-fast-7b-tp1", GPT_FAST, "gpt-fast (torch.compile, CUDA graphs)", "gpt-fast", "llama-2-7b",
        "a100-80gb", 1, "bs1_tok_s", 104.9, "tok/s", {"prompt": 5, "output": 200}, GPT_FAST_NOTE),
    Row("gpt-fast-7b-tp2", GPT_FAST, "gpt-fast (torch.compile, CUDA graphs)", "gpt-fast", "llama-2-7b",
        "a100-80gb", 2, "bs1_tok_s", 168.84, "tok/s", {"prompt": 5, "output": 200}, GPT_FAST_NOTE),
    Row("gpt-fast-7b-tp4", GPT_FAST, "gpt-fast (torch.compile, CUDA graphs)", "gpt-fast", "llama-2-7b",
        "a100-80gb", 4, "bs1_tok_s", 254.02, "tok/s", {"prompt": 5, "output": 200}, GPT_FAST_NOTE),
    Row("gpt-fast-7b-tp8", GPT_FAST, "gpt-fast (torch.compile, CUDA graphs)", "gpt-fast", "llama-2-7b",
        "a100-80gb", 8, "bs1_tok_s", 328.43, "tok/s", {"prompt": 5, "output": 200}, GPT_FAST_NOTE),
    Row("gpt-fast-70b-tp8", GPT_FAST, "gpt-fast (torch.compile, CUDA graphs)", "gpt-fast", "llama-2-70b",
        "a100-80gb", 8, "bs1_tok_s", 62.50, "tok/s", {"prompt": 5, "output": 200}, GPT_FAST_NOTE),
    Row("vllm-ci-a100-8b-latency", VLLM_CI_A100, VLLM_CI_VERSION, "vllm-v0.6", "llama-3.1-8b", "a100-80gb", 1,
        "batch_latency_s", 1.57927, "s", {"batch": 8, "prompt": 32, "output": 128}, LATENCY_NOTE),
    Row("vllm-ci-a100-70b-latency", VLLM_CI_A100, VLLM_CI_VERSION, "vllm-v0.6", "llama-3.1-70b", "a100-80gb",
        4, "batch_latency_s", 3.99059, "s", {"batch": 8, "prompt": 32, "output": 128},
        LATENCY_NOTE + "; Llama-3-70B (same shapes as llama-3.1-70b)"),
    Row("vllm-ci-h200-8b-latency", VLLM_CI_H200, VLLM_CI_VERSION, "vllm-v0.6", "llama-3.1-8b", "h200", 1,
        "batch_latency_s", 0.833421, "s", {"batch": 8, "prompt": 32, "output": 128}, LATENCY_NOTE),
    Row("vllm-ci-h200-70b-latency", VLLM_CI_H200, VLLM_CI_VERSION, "vllm-v0.6", "llama-3.1-70b", "h200", 4,
        "batch_latency_s", 2.07753, "s", {"batch": 8, "prompt": 32, "output": 128},
        LATENCY_NOTE + "; Llama-3-70B (same shapes as llama-3.1-70b)"),
    Row("vllm-ci-h100-8b-latency", VLLM_CI_H100, VLLM_CI_VERSION, "vllm-v0.6", "llama-3.1-8b", "h100-sxm", 1,
        "batch_latency_s", 0.997542, "s", {"batch": 8, "prompt": 32, "output": 128}, LATENCY_NOTE),
    Row("vllm-ci-h100-70b-latency", VLLM_CI_H100, VLLM_CI_VERSION, "vllm-v0.6", "llama-3.1-70b", "h100-sxm", 4,
        "batch_latency_s", 2.44447, "s", {"batch": 8, "prompt": 32, "output": 128},
        LATENCY_NOTE + "; Llama-3-70B (same shapes as llama-3.1-70b)"),
    Row("vllm-ci-a100-8b-throughput", VLLM_CI_A100, VLLM_CI_VERSION, "vllm-v0.6", "llama-3.1-8b", "a100-80gb",
        1, "offline_rps", 11.0567, "req/s", {"requests": 200}, THROUGHPUT_NOTE),
    Row("vllm-ci-a100-70b-throughput", VLLM_CI_A100, VLLM_CI_VERSION, "vllm-v0.6", "llama-3.1-70b",
        "a100-80gb", 4, "offline_rps", 4.78859, "req/s", {"requests": 200, "max_context": 8192},
        THROUGHPUT_NOTE + "; Llama-3-70B (8K context)"),
    Row("vllm-ci-h200-8b-throughput", VLLM_CI_H200, VLLM_CI_VERSION, "vllm-v0.6", "llama-3.1-8b", "h200", 1,
        "offline_rps", 22.5674, "req/s", {"requests": 200}, THROUGHPUT_NOTE),
    Row("vllm-ci-h200-70b-throughput", VLLM_CI_H200, VLLM_CI_VERSION, "vllm-v0.6", "llama-3.1-70b", "h200", 4,
        "offline_rps", 9.83905, "req/s", {"requests": 200, "max_context": 8192},
        THROUGHPUT_NOTE + "; Llama-3-70B (8K context)"),
    Row("vllm-ci-h100-8b-throughput", VLLM_CI_H100, VLLM_CI_VERSION, "vllm-v0.6", "llama-3.1-8b", "h100-sxm", 1,
        "offline_rps", 19.5005, "req/s", {"requests": 200}, THROUGHPUT_NOTE),
    Row("vllm-ci-h100-70b-throughput", VLLM_CI_H100, VLLM_CI_VERSION, "vllm-v0.6", "llama-3.1-70b", "h100-sxm",
        4, "offline_rps", 8.86239, "req/s", {"requests": 200, "max_context": 8192},
        THROUGHPUT_NOTE + "; Llama-3-70B (8K context)"),
)  # fmt: skip

# every vLLM CI row is also simulated under vllm-v0 (the A40-era profile, the default before issue 23)
ROWS = tuple(Row(**(r.__dict__ | {"compare": ("vllm-v0",)})) if r.profile == "vllm-v0.6" else r for r in ROWS)

SEEDS = tuple(range(5))


def benchmark_sharegpt_requests(
    seed: int,
    n: int = VLLM_SHAREGPT_PROMPTS,
    prompt_tokens: int = VLLM_SHAREGPT_PROMPT_TOKENS,
    output_tokens: int = VLLM_SHAREGPT_OUTPUT_TOKENS,
) -> list[Request]:
    """``n`` requests standing for benchmark_throughput's ShareGPT sample, all at t = 0, each to its own
    output length (ignore_eos). The texts are not in the artifact, so the pairs are drawn (seeded, with
    replacement) from its ShareGPT lengths under the sampler's own filter (prompt and output >= 4, prompt <=
    1024, prompt + output <= 2048), and their prompts, then their outputs, are scaled by one factor each so
    that the set holds the sample's known totals within the filter's bounds (clipped at them). The shape of the lengths, the
    longest output above all, stays the artifact's: the seeds' spread is that uncertainty."""
    lengths = describe_workload("sharegpt-trace")["lengths"]
    ins, outs = lengths.inputs, lengths.outputs
    keep = (ins >= 4) & (outs >= 4) & (ins <= 1024) & (ins + outs <= 2048)
    ins, outs = ins[keep], outs[keep]
    idx = np.random.default_rng(seed).integers(0, len(ins), size=n)
    p = _scaled_to_total(ins[idx], prompt_tokens, np.full(n, 1024))
    o = _scaled_to_total(outs[idx], output_tokens, 2048 - p)
    return [
        Request(
            f"sharegpt{seed}-{i:03d}",
            unique_prompt(i, int(p[i])),  # prompts share nothing (and prefix caching is off, as in the run)
            SamplingParams(max_tokens=int(o[i]), ignore_eos=True),
            arrival_s=0.0,
        )
        for i in range(n)
    ]


def _scaled_to_total(x: np.ndarray, total: int, hi: np.ndarray, lo: int = 4) -> np.ndarray:
    """``clip(rint(x * a), lo, hi)`` with the one factor ``a`` that brings the sum nearest ``total``
    (bisection: the clipped sum grows with ``a``)."""
    x = np.asarray(x, dtype=np.float64)

    def scaled(a: float) -> np.ndarray:
        return np.clip(np.rint(x * a), lo, hi).astype(np.int64)

    a_lo, a_hi = 0.0, 2.0 * total / x.sum()
    while scaled(a_hi).sum() < total and a_hi < 1e6:
        a_hi *= 2.0
    for _ in range(60):
        mid = 0.5 * (a_lo + a_hi)
        a_lo, a_hi = (mid, a_hi) if scaled(mid).sum() < total else (a_lo, mid)
    return min((scaled(a_lo), scaled(a_hi)), key=lambda v: abs(int(v.sum()) - total))


def _config(row: Row, **kw) -> SimulateConfig:
    return SimulateConfig(model=row.model, gpu=row.gpu, tp=row.tp, engine=row.profile, **kw)


def simulate(row: Row, profile: str | None = None, seeds: tuple[int, ...] = SEEDS) -> dict:
    """The row's simulated figure under its profile (or ``profile``), and for sampled workloads every seed's."""
    if profile is not None:
        row = Row(**(row.__dict__ | {"profile": profile}))
    w = row.workload
    if row.kind == "bs1_tok_s":
        cfg = _config(row, workload=f"fixed:{w['prompt']}:{w['output']}", rate=math.inf, num_requests=1,
                      max_num_seqs=1, enable_prefix_caching=False)  # fmt: skip
        s = run_simulation(cfg, report=False).summary
        return {"value": w["output"] / s["makespan_s"], "seeds": []}
    if row.kind == "batch_latency_s":
        cfg = _config(row, workload=f"fixed:{w['prompt']}:{w['output']}", rate=math.inf,
                      num_requests=w["batch"], enable_prefix_caching=False)  # fmt: skip
        return {"value": run_simulation(cfg, report=False).summary["makespan_s"], "seeds": []}
    if row.kind == "offline_rps":
        vals, runs = [], []
        for seed in seeds:
            # V0 without chunked prefill: whole prompts, max_num_batched_tokens = max(max_model_len, 2048)
            cfg = _config(row, workload="sharegpt-trace", rate=math.inf, num_requests=w["requests"], seed=seed,
                          max_context=w.get("max_context"), policy="vllm", enable_prefix_caching=False)  # fmt: skip
            reqs = benchmark_sharegpt_requests(seed, w["requests"])
            s = run_simulation(cfg, report=False, requests=reqs).summary
            vals.append(s["throughput_rps"])
            runs.append({
                "seed": seed, "throughput_rps": s["throughput_rps"], "makespan_s": s["makespan_s"],
                "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
                "output_tokens": sum(r.sampling.max_tokens for r in reqs),
                "longest_output": max(r.sampling.max_tokens for r in reqs),
                "preemptions": s.get("preemptions"), "kv_capacity_tokens": s.get("kv_capacity_tokens"),
            })  # fmt: skip
        return {"value": statistics.fmean(vals), "seeds": vals, "runs": runs}
    raise ValueError(f"kind: unknown {row.kind!r} in row {row.id}")


def table(results: list[dict]) -> str:
    head = (
        "| row | model | GPU x TP | engine (profile) | workload | measured | simulated | error | other profiles |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    lines = [head]
    for r in results:
        spread = ""
        if r["seeds"]:
            spread = f" ({min(r['seeds']):.3g}-{max(r['seeds']):.3g} over {len(r['seeds'])} seeds)"
        lines.append(
            f"| [{r['id']}]({r['source'].split(' ')[0]}) | {r['model']} | {r['gpu']} x{r['tp']} | "
            f"{r['engine_version']} (`{r['profile']}`) | {r['note']} | {r['measured']:.4g} {r['unit']} | "
            f"{r['simulated']:.4g} {r['unit']}{spread} | {100 * r['error']:+.1f}% | "
            + "; ".join(
                f"`{k}` {v:.4g} ({100 * (v / r['measured'] - 1):+.1f}%)" for k, v in r["others"].items()
            )
            + " |"
        )
    errs = sorted(abs(r["error"]) for r in results)
    lines.append("")
    lines.append(
        f"{len(errs)} rows: median |error| {100 * statistics.median(errs):.1f}%, worst {100 * errs[-1]:.1f}%"
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=None, help="comma-separated row ids (default: all)")
    p.add_argument("--out", default=None, help="folder for validation.json")
    p.add_argument("--seeds", type=int, default=len(SEEDS), help="seeds of the sampled ShareGPT workloads")
    args = p.parse_args()
    rows = ROWS
    if args.rows:
        want = set(args.rows.split(","))
        unknown = want - {r.id for r in ROWS}
        if unknown:
            raise SystemExit(f"rows: unknown {', '.join(sorted(unknown))}")
        rows = tuple(r for r in ROWS if r.id in want)
    results = []
    for row in rows:
        get_engine(row.profile)
        seeds = tuple(range(args.seeds))
        sim = simulate(row, seeds=seeds)
        others = {p: simulate(row, p, seeds)["value"] for p in row.compare}
        results.append(
            asdict(row)
            | {
                "simulated": sim["value"],
                "seeds": sim["seeds"],
                "runs": sim.get("runs", []),
                "error": sim["value"] / row.measured - 1.0,
                "others": others,
            }
        )
        print(
            f"{row.id}: measured {row.measured:.4g}, simulated {sim['value']:.4g} {row.unit} {others}",
            flush=True,
        )
    md = table(results)
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        errs = sorted(abs(r["error"]) for r in results)
        summary = {"rows": results, "median_abs_error": statistics.median(errs), "worst_abs_error": errs[-1]}
        (out / "validation.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / "table.md").write_text(md + "\n")
        print(f"wrote {out / 'validation.json'}")


if __name__ == "__main__":
    main()
