"""Planning time of the offline planners for a job of the paper's trace size (400k requests).

Builds the paper's trace #1 (``workloads/blendserve_traces.py``: BurstGPT + MMLU + OpenVid, 35% sharing) and
times each stage of the ``blendserve`` planner (prefix tree over block hashes, warm-up sampling and
estimation, sort-and-split, dual scan with its per-step budgets) and the DFS planner; prints the figures and
the job's ideal bound for scale (planning must be small next to the job it plans).
Run: .venv/bin/python benchmarks/bench_offline_plan.py [--requests 400000] [--trace trace1]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kvbalance.offline.density import DensityConstants, job_density_fn, mem_s
from kvbalance.offline.dual_scan import dual_scan
from kvbalance.offline.estimate import choose_samples, estimate_output_lens
from kvbalance.offline.plan import PLANNERS, PlanContext
from kvbalance.offline.planners._common import budget_lens, job_stats, kv_tokens, prompt_lens
from kvbalance.offline.split import sort_and_split
from kvbalance.offline.tree import PrefixTree
from kvbalance.workloads.blendserve_traces import TRACES, build_trace, paper_trace_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400_000)
    ap.add_argument("--trace", default="trace1", choices=sorted(TRACES))
    args = ap.parse_args()
    ctx = PlanContext()
    k = DensityConstants.for_model(ctx.model, ctx.gpu)
    t = {}
    t0 = time.perf_counter()
    reqs = build_trace(paper_trace_config(args.trace, job_density_fn(k), args.requests))
    t["job_generation_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tree = PrefixTree.from_requests(reqs, ctx.block_size)
    t["tree_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tree.annotate(np.ones(len(reqs)), k)
    samples = choose_samples(tree, ctx.sample_fraction, ctx.seed)
    true = budget_lens(reqs)
    est = estimate_output_lens(tree, samples, true[samples].tolist())
    t["estimate_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    split = sort_and_split(tree, est.output_lens, k)
    t["sort_split_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    p, d = prompt_lens(reqs), est.output_lens
    mem = mem_s(p, d, k)
    ds = dual_scan(
        tree.leaf_order(),
        p,
        d,
        tree.leaf_density * mem,
        mem,
        tree.root.density,
        kv_tokens(ctx),
        ctx.chunk_tokens,
        tree.amortised_tokens,
    )
    t["dual_scan_s"] = time.perf_counter() - t0
    t["blendserve_stages_total_s"] = sum(v for key, v in t.items() if key != "job_generation_s")
    for name in ("blendserve", "vllm-dfs"):
        t0 = time.perf_counter()
        PLANNERS.get(name)().plan(reqs, ctx)
        t[f"{name}_plan_s"] = time.perf_counter() - t0
    stats = job_stats(reqs, tree, k)
    print(
        json.dumps(
            {
                "trace": args.trace,
                "requests": len(reqs),
                "samples": len(samples),
                "splits": split.num_splits,
                "sharing_kept": split.sharing_kept,
                "batches": len(ds.batches),
                **{key: round(v, 2) for key, v in t.items()},
                "job_ideal_bound_s": round(stats["ideal_bound_s"], 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
