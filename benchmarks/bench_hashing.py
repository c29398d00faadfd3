"""Cost per block of each prefix-cache block hash on this CPU (prints a table; not a timed test).

For each algorithm (``kvcache.hashing.HASH_ALGOS``) and block size, hashes a 65,536-token prompt (4,096
blocks at 16 tokens) given as a Python list (the real engine's prompts) and as an int64 numpy array (the
simulator's synthetic prompts), and reports CPU nanoseconds per block, the median of ``--repeats`` rounds
with the algorithms alternated inside each round (so the shared machine's load falls on all of them alike).
The list figures include the list -> int64 bytes conversion every hash pays.

Then (``--sim-requests``, 0 to skip) what the hash costs a whole simulation: the first N Mooncake requests
(llama-2-7b on an A100-80GB, all at once) under sha256 and poly64, alternating for ``--sim-rounds`` rounds,
CPU seconds of each run (the fastest of each is compared), and that the runs are identical.

    .venv/bin/python benchmarks/bench_hashing.py [--repeats 7] [--sim-requests 2000] [--sim-rounds 4]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from kvbalance.kvcache.hashing import HASH_ALGOS, BlockHasher

NUM_TOKENS = 65_536


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sim-requests", type=int, default=2000)
    ap.add_argument("--sim-rounds", type=int, default=4)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 50_000, NUM_TOKENS).astype(np.int64)
    inputs = {"list": arr.tolist(), "numpy": arr}
    hashers = {a: BlockHasher(a, salt="deployment-salt", model="smollm2-135m|bfloat16") for a in HASH_ALGOS}
    rows = []
    for bs in (16, 64):
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):
            for kind, toks in inputs.items():
                for algo, h in hashers.items():
                    t0 = time.process_time()
                    h.prefix_block_hashes(toks, bs)
                    times.setdefault((algo, kind), []).append(time.process_time() - t0)
        n_blocks = NUM_TOKENS // bs
        for (algo, kind), ts in times.items():
            rows.append(
                {
                    "algo": algo,
                    "block_size": bs,
                    "input": kind,
                    "ns_per_block": round(statistics.median(ts) / n_blocks * 1e9),
                    "ns_per_token": round(statistics.median(ts) / NUM_TOKENS * 1e9, 1),
                }
            )
    print(f"CPU: {cpu_name()}; {NUM_TOKENS} tokens per call, median of {args.repeats} rounds, CPU time")
    print(f"{'algo':>8} {'block':>6} {'input':>6} {'ns/block':>9} {'ns/token':>9}")
    for r in rows:
        print(
            f"{r['algo']:>8} {r['block_size']:>6} {r['input']:>6} {r['ns_per_block']:>9} {r['ns_per_token']:>9}"
        )
    sim = simulate_cost(args.sim_requests, args.sim_rounds) if args.sim_requests else None
    dest = Path(__file__).parent / "results" / "security"
    dest.mkdir(parents=True, exist_ok=True)
    out = {"cpu": cpu_name(), "rows": rows, "simulation": sim}
    (dest / "hashing.json").write_text(json.dumps(out, indent=2) + "\n")


def simulate_cost(num_requests: int, rounds: int) -> dict:
    from kvbalance.sim.config import SimulateConfig
    from kvbalance.sim.run import run_simulation
    from kvbalance.workloads.presets import default_traces_dir

    path = default_traces_dir() / "mooncake_conversation_trace.jsonl"
    if not path.is_file():
        print(f"simulation: trace not found at {path} (set KVBALANCE_TRACES); skipped")
        return {}
    cpu: dict[str, list[float]] = {"sha256": [], "poly64": []}
    results = set()
    for r in range(rounds):
        for algo in ("sha256", "poly64") if r % 2 == 0 else ("poly64", "sha256"):
            cfg = SimulateConfig(model="llama-2-7b", gpu="a100-80gb", workload=f"mooncake:{path}",
                                 num_requests=num_requests, rate=float("inf"), prefix_caching_hash_algo=algo)  # fmt: skip
            t0 = time.process_time()
            res = run_simulation(cfg)
            cpu[algo].append(round(time.process_time() - t0, 3))
            results.add((res.summary["prefix_hit_rate"], res.summary["makespan_s"]))
    ratio = min(cpu["sha256"]) / min(cpu["poly64"])
    print(f"simulation, first {num_requests} Mooncake requests: CPU s sha256 {cpu['sha256']}, poly64 {cpu['poly64']}; "
          f"fastest sha256 / fastest poly64 = {ratio:.3f}; identical runs: {len(results) == 1}")  # fmt: skip
    return {"num_requests": num_requests, "cpu_s": cpu, "ratio_sha256_over_poly64": round(ratio, 3),
            "identical": len(results) == 1, "hit_rate_makespan": sorted(results)}  # fmt: skip


if __name__ == "__main__":
    main()
