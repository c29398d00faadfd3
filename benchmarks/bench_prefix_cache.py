"""Prefix cache speed and hit rate on the Mooncake conversation trace at 5k, 20k and 100k blocks, per block hash.

Each request, in trace order: chained block hashes of its prompt (``--hash-algo``: sha256, blake2b and the
fast poly64, in one run), match the longest cached prefix, check the hit against the cached tokens (as the
KV cache manager does), lock it, allocate the rest (evicting LRU leaves when the pool is short), cache its
new blocks with their tokens, then release (unlock, free): the scheduler's admission and completion path.
Reports requests per second and the hit rate per pool size and hash; the hit rate must not depend on the
hash (a different hash names the same prefixes), and the rate must stay flat as the pool grows (O(1)
allocate/free, heap-ordered eviction, no tree scans).
Run: .venv/bin/python benchmarks/bench_prefix_cache.py [--block-size 16] [--requests N] [--hash-algo A ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvbalance.kvcache import BlockPool, RadixCache
from kvbalance.kvcache.hashing import HASH_ALGOS, BlockHasher, token_bytes
from kvbalance.workloads.presets import default_traces_dir
from kvbalance.workloads.tokens import SyntheticPrompt
from kvbalance.workloads.traces import load_mooncake


def replay(prompts, num_blocks: int, block_size: int, hasher: BlockHasher, pre: list | None = None) -> dict:
    """Replay the trace; with ``pre`` (precomputed (hashes, token bytes)) only the cache operations are timed."""
    pool = BlockPool(num_blocks, block_size)
    cache = RadixCache(pool)
    hit = total = skipped = 0
    bs = block_size
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        if pre is not None:
            hashes, toks = pre[i]
        else:
            hashes, toks = hasher.prefix_block_hashes(prompt, bs), None
        if len(hashes) > num_blocks:
            skipped += 1
            continue
        node, hit_blocks = cache.match_prefix(hashes)
        if hit_blocks:
            mine = toks[: hit_blocks * bs * 8] if toks is not None else token_bytes(prompt[: hit_blocks * bs])
            node, hit_blocks = cache.verify_tokens(node, hit_blocks, mine)
        cache.lock(node)
        table = cache.blocks_of(node)
        pool.incref(table)
        need = len(hashes) - hit_blocks
        if need > pool.num_free:
            cache.evict(need - pool.num_free)
        if need > pool.num_free:  # everything else is locked: cannot happen with one request at a time
            raise RuntimeError("pool too small")
        table += pool.allocate(need)
        lo, hi = hit_blocks * bs, len(hashes) * bs
        new = toks[lo * 8 : hi * 8] if toks is not None else token_bytes(prompt[lo:hi])
        end, _ = cache.extend(node, hit_blocks, hashes, table, new)
        hit += hit_blocks
        total += len(hashes)
        cache.unlock(end)
        pool.free(table)
    dt = time.perf_counter() - t0
    cache.check_invariants()
    pool.check_invariants()
    n = len(prompts) - skipped
    return {
        "hash_algo": hasher.algo,
        "num_blocks": num_blocks,
        "requests": n,
        "skipped_longer_than_pool": skipped,
        "seconds": round(dt, 3),
        "requests_per_s": round(n / dt, 1),
        "blocks_per_s": round(total / dt, 1),
        "block_hit_rate": round(hit / max(total, 1), 4),
        "token_mismatches": cache.num_token_mismatches,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--hash-algo", nargs="+", default=list(HASH_ALGOS), choices=HASH_ALGOS)
    args = ap.parse_args()
    path = default_traces_dir() / "mooncake_conversation_trace.jsonl"
    if not path.exists():
        raise SystemExit(f"trace not found: {path} (set KVBALANCE_TRACES)")
    records = load_mooncake(path)[: args.requests]
    prompts = [
        SyntheticPrompt(r.input_len, uid=i, hash_ids=r.hash_ids, block_tokens=512)
        for i, r in enumerate(records)
    ]
    bs = args.block_size
    rows = []
    for nb in (5_000, 20_000, 100_000):
        for algo in args.hash_algo:  # alternated per pool size: the machine's load hits every hash alike
            hasher = BlockHasher(algo)
            pre = [(hasher.prefix_block_hashes(p, bs), token_bytes(p[: len(p) // bs * bs])) for p in prompts]
            full = replay(prompts, nb, bs, hasher)
            ops = replay(prompts, nb, bs, hasher, pre)
            assert ops["block_hit_rate"] == full["block_hit_rate"]
            full["cache_ops_requests_per_s"] = ops["requests_per_s"]
            rows.append(full)
    print(f"Mooncake conversation trace, {len(prompts)} requests, block size {bs}")
    print(
        "req/s: whole admission path (synthetic tokens + block hashing + token check + cache); "
        "cache ops: hashes and token bytes precomputed"
    )
    print(
        f"{'hash':>8} {'blocks':>8} {'req/s':>10} {'cache ops':>10} {'blocks/s':>12} {'hit rate':>9} "
        f"{'skipped':>8} {'mismatch':>9}"
    )
    for r in rows:
        print(
            f"{r['hash_algo']:>8} {r['num_blocks']:>8} {r['requests_per_s']:>10} "
            f"{r['cache_ops_requests_per_s']:>10} {r['blocks_per_s']:>12} {r['block_hit_rate']:>9} "
            f"{r['skipped_longer_than_pool']:>8} {r['token_mismatches']:>9}"
        )
    dest = Path(__file__).parent / "results"
    dest.mkdir(exist_ok=True)
    (dest / f"prefix_cache_bs{bs}.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
