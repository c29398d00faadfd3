"""Prefix cache speed on the Mooncake conversation trace at 5k, 20k and 100k blocks.

Each request, in trace order: chained block hashes of its prompt, match the longest cached prefix,
lock it, allocate the rest (evicting LRU leaves when the pool is short), cache its new blocks,
then release (unlock, free): the scheduler's admission and completion path. Reports requests per second and the hit rate per pool size; the rate
must stay flat as the pool grows (O(1) allocate/free, heap-ordered eviction, no tree scans).
Run: .venv/bin/python benchmarks/bench_prefix_cache.py [--block-size 16] [--requests N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvbalance.kvcache import BlockPool, RadixCache, prefix_block_hashes
from kvbalance.workloads.presets import default_traces_dir
from kvbalance.workloads.tokens import SyntheticPrompt
from kvbalance.workloads.traces import load_mooncake


def replay(prompts, num_blocks: int, block_size: int, hashed: list | None = None) -> dict:
    """Replay the trace; with ``hashed`` (precomputed block hashes) only the cache operations are timed."""
    pool = BlockPool(num_blocks, block_size)
    cache = RadixCache(pool)
    hit = total = skipped = 0
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        hashes = hashed[i] if hashed is not None else prefix_block_hashes(prompt, block_size)
        if len(hashes) > num_blocks:
            skipped += 1
            continue
        node, hit_blocks = cache.match_prefix(hashes)
        cache.lock(node)
        table = cache.blocks_of(node)
        pool.incref(table)
        need = len(hashes) - hit_blocks
        if need > pool.num_free:
            cache.evict(need - pool.num_free)
        if need > pool.num_free:  # everything else is locked: cannot happen with one request at a time
            raise RuntimeError("pool too small")
        table += pool.allocate(need)
        end, _ = cache.extend(node, hit_blocks, hashes, table)
        hit += hit_blocks
        total += len(hashes)
        cache.unlock(end)
        pool.free(table)
    dt = time.perf_counter() - t0
    cache.check_invariants()
    pool.check_invariants()
    n = len(prompts) - skipped
    return {
        "num_blocks": num_blocks,
        "requests": n,
        "skipped_longer_than_pool": skipped,
        "seconds": round(dt, 3),
        "requests_per_s": round(n / dt, 1),
        "blocks_per_s": round(total / dt, 1),
        "block_hit_rate": round(hit / max(total, 1), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=None)
    args = ap.parse_args()
    path = default_traces_dir() / "mooncake_conversation_trace.jsonl"
    if not path.exists():
        raise SystemExit(f"trace not found: {path} (set KVBALANCE_TRACES)")
    records = load_mooncake(path)[: args.requests]
    prompts = [
        SyntheticPrompt(r.input_len, uid=i, hash_ids=r.hash_ids, block_tokens=512)
        for i, r in enumerate(records)
    ]
    hashed = [prefix_block_hashes(p, args.block_size) for p in prompts]
    rows = []
    for nb in (5_000, 20_000, 100_000):
        full = replay(prompts, nb, args.block_size)
        ops = replay(prompts, nb, args.block_size, hashed)
        full["cache_ops_requests_per_s"] = ops["requests_per_s"]
        rows.append(full)
    print(f"Mooncake conversation trace, {len(prompts)} requests, block size {args.block_size}")
    print(
        "req/s: whole admission path (synthetic tokens + block hashing + cache); cache ops: hashes precomputed"
    )
    print(f"{'blocks':>8} {'req/s':>10} {'cache ops':>10} {'blocks/s':>12} {'hit rate':>9} {'skipped':>8}")
    for r in rows:
        print(
            f"{r['num_blocks']:>8} {r['requests_per_s']:>10} {r['cache_ops_requests_per_s']:>10} "
            f"{r['blocks_per_s']:>12} {r['block_hit_rate']:>9} {r['skipped_longer_than_pool']:>8}"
        )
    dest = Path(__file__).parent / "results"
    dest.mkdir(exist_ok=True)
    (dest / f"prefix_cache_bs{args.block_size}.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
