"""CPU time of the paged decode-attention kernel alone, one thread, at SmolLM2-135M's shape.

A decode step is 30 kernel calls (one per layer, each over its own K/V cache, so no layer finds the
previous one's blocks in cache) of B sequences at one context length; the caches hold ~64k tokens
each (1,024 blocks of 64) in the engine's layout (``[layers, 2, kv_heads, blocks, block_size,
head_dim]``, bf16) and every sequence's blocks are drawn at random from them, as the engine's are.
Queries are bf16 (a bf16 model). Prints CPU ms per step (best and median of the repeats) and the
rate at which K/V are read (bytes of K and V the step attends / CPU time), for each kernel variant:
``dot`` (bf16 dot products, where the CPU has avx512_bf16), ``widen`` (K widened to float32) and,
with ``--baseline REV``, the kernel in ``kvbalance/model/native.py`` at git revision REV.

Run pinned to one core: taskset -c 1 .venv/bin/python benchmarks/bench_decode_attention.py
[--baseline main] [--repeats 7] [--steps 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvbalance.executor import hugepages
from kvbalance.model import native

LAYERS, KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 30, 3, 3, 64, 64, 1024
# (batch, context tokens); 300 and 600 end each unit in a short window (256-key windows)
SHAPES = [(16, 200), (16, 1000), (64, 200), (64, 300), (64, 600), (64, 1000)]


def load_baseline(rev: str):
    """native.py as it was at git revision ``rev``, imported as a separate module."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(
        ["git", "show", f"{rev}:kvbalance/model/native.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "native_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("native_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_step(batch: int, context: int, cache: torch.Tensor, gen: torch.Generator) -> list[tuple]:
    """One step's 30 calls' arguments: per layer, its queries and a fresh scattered block table."""
    max_blocks = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    ctx = torch.full((batch,), context, dtype=torch.int64)
    calls = []
    for layer in range(LAYERS):
        table = torch.randperm(NUM_BLOCKS, generator=gen)[: batch * max_blocks].view(batch, max_blocks)
        q = torch.randn(batch, KV_HEADS, GROUP, HEAD_DIM, generator=gen).bfloat16()
        calls.append((q, cache[layer, 0], cache[layer, 1], table.contiguous(), ctx))
    return calls


def time_step(fn, calls: list[tuple], steps: int) -> float:
    """CPU seconds of one step (30 calls), the mean over ``steps`` steps."""
    t0 = time.process_time()
    for _ in range(steps):
        for q, k, v, table, ctx in calls:
            fn(q, k, v, table, ctx, HEAD_DIM**-0.5)
    return (time.process_time() - t0) / steps


def variants(baseline) -> dict:
    out = {}
    if baseline is not None:
        out["baseline"] = baseline.paged_decode_attention
    if native.has_amx():
        out["amx"] = lambda *a: native.paged_decode_attention(*a, amx=True)
    out["widen"] = lambda *a: native.paged_decode_attention(*a, amx=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None, help="git revision whose kernel to time too (e.g. main)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="steps per repeat")
    ap.add_argument("--small-pages", action="store_true", help="4 KiB pages (the engine uses huge pages)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    shape = (LAYERS, 2, KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM)
    cache = hugepages.zeros(shape, torch.bfloat16)  # ~1.5 GB, the engine's layout and pages
    if args.small_pages:
        cache = torch.zeros(shape, dtype=torch.bfloat16)
    cache.copy_(torch.randn(shape, generator=gen) * 0.5)
    fns = variants(load_baseline(args.baseline) if args.baseline else None)
    print(
        f"layers {LAYERS}, kv_heads {KV_HEADS}, group {GROUP}, head_dim {HEAD_DIM}, bf16 KV and q, "
        f"{NUM_BLOCKS} blocks of {BLOCK_SIZE} per layer; CPU ms per step, best / median of {args.repeats}"
    )
    print(f"{'B':>4} {'ctx':>5} {'MB/step':>8}  " + "  ".join(f"{n:>22}" for n in fns))
    for batch, context in SHAPES:
        calls = make_step(batch, context, cache, gen)
        ref = None
        for name, fn in fns.items():  # the variants agree (float32 arithmetic, bf16 output)
            out = fn(*calls[0][:5], HEAD_DIM**-0.5).float()
            ref = out if ref is None else ref
            if not torch.allclose(out, ref, atol=2e-2, rtol=2e-2):
                sys.exit(f"{name}: output differs from {next(iter(fns))}'s")
        mb = LAYERS * batch * context * KV_HEADS * HEAD_DIM * 2 * 2 / 1e6
        times = {n: [] for n in fns}
        for _ in range(args.repeats):  # interleaved, so drift from other load hits every variant alike
            for name, fn in fns.items():
                times[name].append(time_step(fn, calls, args.steps))
        cells = []
        for name in fns:
            best, med = min(times[name]), statistics.median(times[name])
            cells.append(f"{1e3 * best:6.1f} /{1e3 * med:6.1f} ms {mb / 1e3 / best:4.1f} GB/s")
        print(f"{batch:>4} {context:>5} {mb:>8.1f}  " + "  ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
