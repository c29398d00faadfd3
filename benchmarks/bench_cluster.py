"""Cluster simulator speed: simulated requests per wall (and CPU) second of one 8-GPU run per system.

llama-13b on 8 x a100-80gb, Alpaca-like requests at a rate near the systems' SLO limit (1,000 req/s: the
quick reproduction's max rates at SLO are 1.6-2k req/s over 1 s bursts); vLLM (8 colocated, least_loaded),
DistServe (3P + 5D), BanaServe as published (``banaserve-paper``: 3P + 5D, store, load_aware, layer- and
attention-level migration), BanaServe with role flips (``banaserve``) and kvbalance (8 colocated, store,
store_aware: the router keeps a prefix index per instance). CPU seconds are printed too: on a shared machine
wall time is noisy, CPU time is the figure to compare.
Run: .venv/bin/python benchmarks/bench_cluster.py [N] [WORKLOAD] [RATE]   (defaults 2000 alpaca 1000)
"""

from __future__ import annotations

import sys
import time

from kvbalance.cluster.config import run_cluster
from kvbalance.cluster.systems import system_config
from kvbalance.sim.run import SimulateConfig
from kvbalance.workloads.presets import build_requests


def main(n: int = 2000, workload: str = "alpaca", rate: float = 1000.0) -> list[dict]:
    rows = []
    for system in ("vllm", "distserve", "banaserve-paper", "banaserve", "kvbalance"):
        sim = SimulateConfig(model="llama-13b", gpu="a100-80gb", workload=workload, rate=rate, num_requests=n)
        reqs = build_requests(workload, n, rate, 0, 2048)
        cfg = system_config(system, 8, (3, 5, 1, 1))
        w0, c0 = time.perf_counter(), time.process_time()
        res = run_cluster(sim, cfg, reqs)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        rows.append({"system": system, "requests": n, "completed": res.summary["completed"], "wall_s": wall,
                     "cpu_s": cpu, "req_per_wall_s": n / wall, "req_per_cpu_s": n / cpu,
                     "steps": res.summary["num_steps"]})  # fmt: skip
    for r in rows:
        print(f"{r['system']:10s} {r['requests']} req, {r['steps']} steps: {r['wall_s']:.2f} s wall "
              f"({r['req_per_wall_s']:.0f} req/s), {r['cpu_s']:.2f} s CPU ({r['req_per_cpu_s']:.0f} req/s)")  # fmt: skip
    return rows


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        int(args[0]) if args else 2000,
        args[1] if len(args) > 1 else "alpaca",
        float(args[2]) if len(args) > 2 else 1000.0,
    )
