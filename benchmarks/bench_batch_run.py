"""OpenAI Batch runs with the real engine: one replica vs N Ray replicas (data parallelism), same outputs.

Job: ``--num-requests`` greedy requests, two thirds chat turns under one of two shared system prompts, one
third short completions, one invalid line; SmolLM2-135M by default. Each configuration writes its own
output file from scratch; the Ray configurations must reproduce the single replica's output lines exactly
(``created`` stamps aside). Prints wall time and output tokens per wall second (Ray start-up and model
loading included, as a user sees them) and writes ``benchmarks/results/batch_run.json``. Not a test::

    .venv/bin/python benchmarks/bench_batch_run.py --num-requests 48 --data-parallel 1 2
    .venv/bin/python benchmarks/bench_batch_run.py --model tiny-llama --num-requests 200

Needs ``pip install 'kvbalance[ray]'`` for N > 1. On a shared machine wall figures move with the load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from kvbalance.offline.batch_worker import EngineSpec, LocalBackend
from kvbalance.offline.runner import run_batch

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "batch_run.json"
SYSTEMS = ["You are a helpful assistant who answers in one sentence.", "You are a terse geography tutor."]
TOPICS = ["France", "Japan", "Brazil", "Kenya", "Canada", "Norway", "India", "Peru", "Egypt", "Chile"]


def write_job(path: Path, n: int, max_tokens: int, token_ids: bool) -> None:
    rng = random.Random(0)
    with open(path, "w") as fh:
        for i in range(n):
            topic = TOPICS[i % len(TOPICS)]
            if token_ids:  # models without a tokenizer
                body = {"prompt": [rng.randrange(256) for _ in range(rng.randint(8, 120))]}
                url = "/v1/completions"
            elif i % 3 == 2:
                body, url = {"prompt": f"The capital of {topic} is"}, "/v1/completions"
            else:
                msgs = [
                    {"role": "system", "content": SYSTEMS[i % 2]},
                    {"role": "user", "content": f"One fact about {topic}?"},
                ]
                body, url = {"messages": msgs}, "/v1/chat/completions"
            body.update(max_tokens=max_tokens, temperature=0)
            fh.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}) + "\n")
        fh.write('{"custom_id": "broken", "method": "POST"\n')


def comparable(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        ((rec.get("response") or {}).get("body") or {}).pop("created", None)
        out.append(rec)
    return out


def output_tokens(records: list[dict]) -> int:
    return sum(
        r["response"]["body"]["usage"]["completion_tokens"]
        for r in records
        if r["response"] and r["response"]["status_code"] == 200
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--data-parallel", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--num-cpus", type=int, default=os.cpu_count() or 1, help="CPU threads shared by the replicas"
    )
    args = ap.parse_args()
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.jsonl"
        write_job(job, args.num_requests, args.max_tokens, token_ids=args.model != "smollm2-135m")
        for n in args.data_parallel:
            threads = max(1, args.num_cpus // n)
            spec = EngineSpec(args.model, kv_cache_tokens=32_768, num_threads=threads)
            out = Path(tmp) / f"out_dp{n}.jsonl"
            t0 = time.perf_counter()
            if n == 1:
                backend = LocalBackend(spec)
            else:
                from kvbalance.offline.ray_runner import RayBackend

                backend = RayBackend(spec, n, num_cpus=args.num_cpus)
            run_batch(job, out, backend, progress=False)
            wall = time.perf_counter() - t0
            records = comparable(out)
            reference = reference or records
            row = {
                "data_parallel": n,
                "threads_per_replica": threads,
                "wall_s": round(wall, 2),
                "output_tokens": output_tokens(records),
                "output_tokens_per_s": round(output_tokens(records) / wall, 2),
                "outputs_equal_first_config": records == reference,
            }
            rows.append(row)
            print(row, flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result = {
        "model": args.model,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "load_avg_1m": load,
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
