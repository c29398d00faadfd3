"""Simulator speed: simulated requests per wall-clock second at a saturating rate.

20k ShareGPT-like requests on llama-2-7b / a100-80gb (the issue's benchmark). Prints a table and
writes benchmarks/results/simulator.json. Run: .venv/bin/python benchmarks/bench_simulator.py [N]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kvbalance.sim.run import SimulateConfig, run_simulation
from kvbalance.workloads.presets import build_requests


def main(n: int = 20_000) -> dict:
    cfg = SimulateConfig(model="llama-2-7b", gpu="a100-80gb", workload="sharegpt", rate=200.0, num_requests=n)
    t0 = time.perf_counter()
    reqs = build_requests(cfg.workload, n, cfg.rate, cfg.seed, 4096)
    t1 = time.perf_counter()
    res = run_simulation(cfg, requests=reqs, progress=True)
    t2 = time.perf_counter()
    s = res.summary
    seq_steps = sum(len(r.token_times_s) for r in reqs)
    out = {
        "num_requests": n,
        "completed": s["completed"],
        "simulated_makespan_s": s["makespan_s"],
        "num_steps": res.run.num_steps,
        "workload_build_s": round(t1 - t0, 3),
        "simulate_wall_s": round(t2 - t1, 3),
        "sim_requests_per_wall_s": round(n / (t2 - t1), 1),
        "sim_steps_per_wall_s": round(res.run.num_steps / (t2 - t1), 1),
        "sampled_tokens_per_wall_s": round(seq_steps / (t2 - t1), 1),
        "steady_throughput_rps": s["steady_throughput_rps"],
    }
    for k, v in out.items():
        print(f"{k:>28}: {v}")
    dest = Path(__file__).parent / "results"
    dest.mkdir(exist_ok=True)
    (dest / "simulator.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000)
