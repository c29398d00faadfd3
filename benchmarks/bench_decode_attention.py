"""CPU time of the paged decode-attention kernel alone, one thread, at SmolLM2-135M's shape.

A decode step is 30 kernel calls (one per layer, each over its own K/V cache, so no layer finds the
previous one's blocks in cache) of B sequences at one context length; the caches hold ~64k tokens
each (1,024 blocks of 64) in the engine's layout (``[layers, 2, kv_heads, blocks, block_size,
head_dim]``, bf16) and every sequence's blocks are drawn at random from them, as the engine's are.
Queries are bf16 (a bf16 model). Prints CPU ms per step (best and median of the repeats) and the
rate at which K/V are read (bytes of K and V the step attends / CPU time), for each variant: ``amx``
(where the CPU has AMX-BF16), ``widen`` (the vector kernel, K widened to float32), ``torch`` (what the
engine runs without the kernel: each sequence's blocks gathered, a few sequences at a time, then
``scaled_dot_product_attention``; ``--no-torch`` leaves it out) and, with ``--baseline REV``, the kernel at
git revision REV (``kvbalance/model/native.py`` and ``kvbalance/native/``, so a revision that has the C
files). The last column is each variant's median over the first one's.

Run pinned to one core: taskset -c 1 .venv/bin/python benchmarks/bench_decode_attention.py
[--baseline main] [--repeats 7] [--steps 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvbalance.executor import hugepages
from kvbalance.model import cbuild, llama, native

LAYERS, KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 30, 3, 3, 64, 64, 1024
# (batch, context tokens); 300 and 600 end each unit in a short window (256-key windows)
SHAPES = [(16, 200), (16, 1000), (64, 200), (64, 300), (64, 600), (64, 1000)]


def load_baseline(rev: str):
    """native.py and the C kernels as they were at git revision ``rev``, imported as a separate module
    whose library (this benchmark's shape) is built from that revision's C files."""
    root = Path(__file__).resolve().parents[1]
    tar = subprocess.run(
        ["git", "archive", rev, "kvbalance/model/native.py", "kvbalance/native"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    tmp = Path(tempfile.mkdtemp())
    tarfile.open(fileobj=io.BytesIO(tar)).extractall(tmp, filter="data")
    spec = importlib.util.spec_from_file_location("native_baseline", tmp / "kvbalance/model/native.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    current, cbuild.NATIVE_DIR = cbuild.NATIVE_DIR, tmp / "kvbalance/native"
    try:  # built now, from the revision's files; later calls find it in the module's cache
        if mod.native_library(GROUP, HEAD_DIM, torch.bfloat16, torch.bfloat16) is None:
            sys.exit(f"--baseline {rev}: the kernel at that revision does not build")
    finally:
        cbuild.NATIVE_DIR = current
    return mod


def torch_attention(q, k_cache, v_cache, table, ctx, scale):
    """The engine's decode attention without the kernel (``Attention._attend``): whole blocks gathered a
    few sequences at a time (``llama.GATHER_BUDGET_BYTES``), keys past each context masked, SDPA."""
    b, kvh, g, hd = q.shape
    nb, bs = table.shape[1], k_cache.shape[2]
    positions = torch.arange(nb * bs)
    bias = torch.zeros(b, 1, 1, nb * bs, dtype=q.dtype).masked_fill(
        (positions[None, :] >= ctx[:, None])[:, None, None, :], float("-inf")
    )
    step = max(1, llama.GATHER_BUDGET_BYTES // (2 * nb * bs * kvh * hd * k_cache.element_size()))
    outs = []
    for s in range(0, b, step):
        e = min(b, s + step)
        blocks = table[s:e].reshape(-1)
        kc = k_cache.view(kvh, -1, bs * hd).index_select(1, blocks).view(kvh, e - s, -1, hd).transpose(0, 1)
        vc = v_cache.view(kvh, -1, bs * hd).index_select(1, blocks).view(kvh, e - s, -1, hd).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(q[s:e], kc, vc, attn_mask=bias[s:e], scale=scale))
    return torch.cat(outs)


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


def variants(baseline, with_torch: bool) -> dict:
    out = {}
    if native.has_amx():
        out["amx"] = lambda *a: native.paged_decode_attention(*a, amx=True)
    out["widen"] = lambda *a: native.paged_decode_attention(*a, amx=False)
    if baseline is not None:
        out["baseline"] = baseline.paged_decode_attention
    if with_torch:
        out["torch"] = torch_attention
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None, help="git revision whose kernel to time too (e.g. main)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="steps per repeat")
    ap.add_argument("--small-pages", action="store_true", help="4 KiB pages (the engine uses huge pages)")
    ap.add_argument("--no-torch", action="store_true", help="leave out the engine's path without the kernel")
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    shape = (LAYERS, 2, KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM)
    cache = hugepages.zeros(shape, torch.bfloat16)  # ~1.5 GB, the engine's layout and pages
    if args.small_pages:
        cache = torch.zeros(shape, dtype=torch.bfloat16)
    cache.copy_(torch.randn(shape, generator=gen) * 0.5)
    fns = variants(load_baseline(args.baseline) if args.baseline else None, not args.no_torch)
    print(
        f"layers {LAYERS}, kv_heads {KV_HEADS}, group {GROUP}, head_dim {HEAD_DIM}, bf16 KV and q, "
        f"{NUM_BLOCKS} blocks of {BLOCK_SIZE} per layer; CPU ms per step, best / median of {args.repeats}"
    )
    first = next(iter(fns))
    print(
        f"{'B':>4} {'ctx':>5} {'MB/step':>8}  " + "  ".join(f"{n:>22}" for n in fns) + f"  x/{first} (median)"
    )
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
        base = statistics.median(times[first])
        ratios = " ".join(f"{n} {statistics.median(times[n]) / base:.2f}x" for n in fns if n != first)
        print(f"{batch:>4} {context:>5} {mb:>8.1f}  " + "  ".join(f"{c:>22}" for c in cells) + "  " + ratios)


if __name__ == "__main__":
    main()
