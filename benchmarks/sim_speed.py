"""Simulator speed on Vidur's reference set-up, and on a 100k-request, 16-instance cluster.

``vidur`` (default): 4 x llama-2-70b TP4 on a100-80gb (16 GPUs), Sarathi chunk 512, batch cap 128,
round-robin dispatch (Vidur's default global scheduler), Poisson arrivals at 4 req/s, 6,000 requests with
Arxiv-Summarization-4K-like lengths (Vidur's trace: prompt median 2,730, outputs median 167; here drawn
from fits to the issue's moments: prompt = 4,054 - lognormal, mean 2,588 / median 2,730 / max 4,054;
output lognormal, median 167, sigma 1.18 so the mean is 291 once prompt + output <= 4,096). Vidur simulates about 150
requests per wall second on this set-up (its event loop alone: 6,000 requests in 41 s on this machine).

``cluster16``: 100,000 ShareGPT-like requests on 16 colocated llama-2-7b / a100-80gb instances behind
vLLM's least-loaded router, Poisson at 100 req/s (about 70% of the cluster's SLO-free capacity).

Times are CPU seconds of this process (``time.process_time``; the machine is shared), per phase: building
the requests, building the cluster, the event loop, the summary. ``--fast off`` runs with the exact fast
paths off (``KVBALANCE_SIM_FAST=0``: no step-shape cache, decode cohort, runs ahead of the clock or past arrivals
routed elsewhere, lazy block hashes or deferred publication), for the before/after ratio; both give the same summary bit for bit (checked in
tests/test_search_speed.py and tests/test_decode_cohort.py). ``--profile`` adds a cProfile
breakdown of the event loop by package. ``--prefix-caching off`` runs without the prefix cache (Vidur models
none; on, SHA-256-named as vLLM V1's, is the default). Writes benchmarks/results/sim_speed/<setup>.json
(``-fast-off``, ``-no-prefix-cache`` suffixes for the variants).

Run: .venv/bin/python benchmarks/sim_speed.py [vidur|cluster16] [--requests N] [--fast on|off]
     [--prefix-caching on|off] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

VIDUR_REQUESTS_PER_WALL_S = 150.0  # 6,000 requests in 41 s (the measurement on this machine)


def vidur_requests(n: int, seed: int = 0, rate: float = 4.0):
    """Arxiv-Summarization-4K-like requests: prompt 4054 - lognormal (median 1324, sigma 0.4515) so the mean is
    2,588 and the median 2,730; output lognormal median 167, sigma 1.18 (mean 291 once cut to prompt + output <= 4096)."""
    from kvbalance.request import Request, SamplingParams
    from kvbalance.workloads.arrivals import poisson
    from kvbalance.workloads.tokens import unique_prompt

    rng = np.random.default_rng(seed)
    prompt = np.clip(4054 - rng.lognormal(np.log(1324.0), 0.4515, n), 16, 4054).astype(np.int64)
    output = np.clip(np.rint(rng.lognormal(np.log(167.0), 1.18, n)), 1, None).astype(np.int64)
    output = np.minimum(output, 4096 - prompt)
    times = poisson(rate, n, rng)
    return [
        Request(f"r{i:06d}", unique_prompt(i, int(s)), SamplingParams(max_tokens=int(o), ignore_eos=True),
                arrival_s=float(t))
        for i, (s, o, t) in enumerate(zip(prompt, output, times))
    ]  # fmt: skip


def setup(name: str, n: int | None):
    """(SimulateConfig, ClusterConfig, request factory, request count) of a named set-up."""
    from kvbalance.cluster.config import ClusterConfig, InstanceGroup
    from kvbalance.sim.run import SimulateConfig
    from kvbalance.workloads.presets import build_requests

    if name == "vidur":
        n = n or 6000
        sim = SimulateConfig(model="llama-2-70b", gpu="a100-80gb", tp=4, workload="vidur-arxiv-4k", rate=4.0,
                             num_requests=n, policy="sarathi", chunk_size=512, max_num_seqs=128)  # fmt: skip
        cluster = ClusterConfig(
            instances=[InstanceGroup(role="colocated", count=4, tp=4)], router="round_robin"
        )
        return sim, cluster, lambda: vidur_requests(n), n
    if name == "cluster16":
        n = n or 100_000
        sim = SimulateConfig(
            model="llama-2-7b", gpu="a100-80gb", workload="sharegpt", rate=100.0, num_requests=n
        )
        cluster = ClusterConfig(instances=[InstanceGroup(role="colocated", count=16)], router="least_loaded")
        return sim, cluster, lambda: build_requests("sharegpt", n, 100.0, 0, 4096), n
    raise ValueError(f"setup: unknown {name!r} (known: vidur, cluster16)")


def _by_package(prof: cProfile.Profile) -> dict[str, float]:
    """Own (tottime) CPU seconds of the profiled loop, summed per kvbalance package (others: 'python')."""
    out: dict[str, float] = defaultdict(float)
    for (path, _line, _fn), (_cc, _nc, tt, _ct, _callers) in pstats.Stats(prof).stats.items():
        part = path.replace(os.sep, "/").split("/kvbalance/")
        key = part[1].split("/")[0].removesuffix(".py") if len(part) > 1 else "python"
        out[key] += tt
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("setup", nargs="?", default="vidur", choices=["vidur", "cluster16"])
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--fast", choices=["on", "off"], default="on")
    ap.add_argument("--prefix-caching", choices=["on", "off"], default="on")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sim_speed"))
    args = ap.parse_args(argv)
    os.environ["KVBALANCE_SIM_FAST"] = "1" if args.fast == "on" else "0"

    from kvbalance.cluster.config import build_cluster, run_cluster  # noqa: F401 (imported before timing)

    sim, ccfg, make_requests, n = setup(args.setup, args.requests)
    if args.prefix_caching == "off":
        sim = sim.model_copy(update={"enable_prefix_caching": False})
    t0, w0 = time.process_time(), time.perf_counter()
    reqs = make_requests()
    t1 = time.process_time()
    cluster = build_cluster(sim, ccfg)
    t2, w2 = time.process_time(), time.perf_counter()
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    run = cluster.run(reqs)
    if prof:
        prof.disable()
    t3, w3 = time.process_time(), time.perf_counter()
    from kvbalance.metrics.summary import summarize

    s = summarize(reqs, kv_capacity_tokens=sum(m.instance.kv_capacity_tokens for m in cluster.members),
                  timeline=run.timelines)  # fmt: skip
    t4, w4 = time.process_time(), time.perf_counter()
    steps = sum(m.instance.num_steps for m in cluster.members)
    lengths = np.array([(r.num_prompt_tokens, r.max_tokens) for r in reqs])
    out = {
        "setup": args.setup,
        "fast_paths": args.fast,
        "prefix_caching": args.prefix_caching,
        "num_requests": n,
        "instances": ccfg.describe(),
        "model": sim.model,
        "gpu": sim.gpu,
        "prompt_mean_median_max": [round(float(lengths[:, 0].mean()), 1), int(np.median(lengths[:, 0])),
                                   int(lengths[:, 0].max())],
        "output_mean_median_max": [round(float(lengths[:, 1].mean()), 1), int(np.median(lengths[:, 1])),
                                   int(lengths[:, 1].max())],
        "completed": s["completed"],
        "num_steps": steps,
        "simulated_makespan_s": s["makespan_s"],
        "cpu_s": {"build_requests": round(t1 - t0, 3), "build_cluster": round(t2 - t1, 3),
                  "event_loop": round(t3 - t2, 3), "summary": round(t4 - t3, 3), "total": round(t4 - t0, 3)},
        "wall_s_total": round(w4 - w0, 3),
        "sim_requests_per_cpu_s": round(n / (t3 - t2), 1),
        "sim_requests_per_wall_s": round(n / (w3 - w2), 1),
        "sim_steps_per_cpu_s": round(steps / (t3 - t2), 1),
    }  # fmt: skip
    if args.setup == "vidur":
        out["vs_vidur_requests_per_s"] = round(out["sim_requests_per_cpu_s"] / VIDUR_REQUESTS_PER_WALL_S, 1)
    if prof:
        out["event_loop_cpu_s_by_package"] = _by_package(prof)
    for k, v in out.items():
        print(f"{k:>28}: {v}")
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    suffix = ("" if args.fast == "on" else "-fast-off") + (
        "" if args.prefix_caching == "on" else "-no-prefix-cache"
    )
    (dest / f"{args.setup}{suffix}.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
