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
files). The last column is each variant's median over the first one's. ``--dtype float32`` times a float32
cache and queries (the float32 model) instead of bf16.

``--write-kv``: the kernel that writes a step's new K/V into the cache (``write_kv``, the same library)
against the two ``index_copy_`` calls the engine runs without it.

``--avx2``: as an AVX2-only CPU (AMD Zen 2/3) would run it: the library built without AVX-512
(``-mno-avx512f``) with its AVX2 kernel (``avx2``) and without it (``portable-avx2``: the portable kernel
for the same target, what would run in its place); run it with ``ATEN_CPU_CAPABILITY=avx2`` so that the
``torch`` column is torch's AVX2 code too.

Run pinned to one core: taskset -c 1 .venv/bin/python benchmarks/bench_decode_attention.py
[--baseline main] [--repeats 7] [--steps 5] [--dtype float32] [--avx2]
"""

from __future__ import annotations

import argparse
import ctypes
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
        q = torch.randn(batch, KV_HEADS, GROUP, HEAD_DIM, generator=gen).to(cache.dtype)
        calls.append((q, cache[layer, 0], cache[layer, 1], table.contiguous(), ctx))
    return calls


def time_step(fn, calls: list[tuple], steps: int) -> float:
    """CPU seconds of one step (30 calls), the mean over ``steps`` steps."""
    t0 = time.process_time()
    for _ in range(steps):
        for q, k, v, table, ctx in calls:
            fn(q, k, v, table, ctx, HEAD_DIM**-0.5)
    return (time.process_time() - t0) / steps


def _with_library(lib, key):
    """The kernel call through ``lib`` (one of this benchmark's own builds) in place of the engine's."""

    def call(*a):
        native._libs[key] = lib
        return native.paged_decode_attention(*a, amx=False)

    return call


def avx2_variants(dtype: torch.dtype) -> dict:
    """The library as an AVX2-only CPU builds it, with its AVX2 kernel and without (the portable one)."""
    bf16 = dtype == torch.bfloat16
    key = (GROUP, HEAD_DIM, bf16, bf16)
    flags = (*native.build_flags(GROUP, HEAD_DIM, bf16, bf16, amx=False), "-mno-avx512f")
    out = {}
    for name, extra in (("avx2", ()), ("portable-avx2", ("-DNO_AVX2_KERNEL=1",))):
        path = cbuild.build(f"bench_attention_{name}_{key}", native.SOURCES, (*flags, *extra), "nothing")
        if path is None:
            sys.exit(f"--avx2: the {name} build failed")
        lib = ctypes.CDLL(str(path))
        lib.paged_decode_attention.argtypes = native_library_argtypes()
        lib.attention_avx2.restype = ctypes.c_int
        if bool(lib.attention_avx2()) != (name == "avx2"):
            sys.exit(f"--avx2: the {name} build has the wrong path")
        out[name] = _with_library(lib, key)
    return out


def native_library_argtypes() -> list:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return [ptr] * 6 + [i64] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]


def variants(baseline, with_torch: bool, dtype: torch.dtype, avx2: bool) -> dict:
    out = {}
    if native.has_amx() and dtype == torch.bfloat16:
        out["amx"] = lambda *a: native.paged_decode_attention(*a, amx=True)
    if avx2:
        out.update(avx2_variants(dtype))
    else:
        bf16 = dtype == torch.bfloat16
        key = (GROUP, HEAD_DIM, bf16, bf16)
        out["widen"] = _with_library(native.native_library(GROUP, HEAD_DIM, dtype, dtype), key)
    if baseline is not None:
        out["baseline"] = baseline.paged_decode_attention
    if with_torch:
        out["torch"] = torch_attention
    return out


def bench_write_kv(dtype: torch.dtype, reps: int, calls: int = 20) -> None:
    """The step's new K/V into their cache slots: native.write_kv against the two ``index_copy_`` calls the
    engine runs without it (``Attention.forward``), from strided views of a fused QKV output."""
    gen = torch.Generator().manual_seed(0)
    kc, vc = (torch.zeros(KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, dtype=dtype) for _ in range(2))
    print(f"write_kv, {str(dtype)[6:]} cache; CPU us per call, best of {reps} rounds of {calls}, alternating")
    for tokens in (64, 2048):
        qkv = torch.randn(tokens, (GROUP + 2) * KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        k, v = qkv[:, GROUP * KV_HEADS : (GROUP + 1) * KV_HEADS], qkv[:, (GROUP + 1) * KV_HEADS :]
        slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:tokens]

        def torch_path(k=k, v=v, slots=slots):
            kc.view(KV_HEADS, -1, HEAD_DIM).index_copy_(1, slots, k.transpose(0, 1))
            vc.view(KV_HEADS, -1, HEAD_DIM).index_copy_(1, slots, v.transpose(0, 1))

        fns = {"native": lambda k=k, v=v, s=slots: native.write_kv(k, v, kc, vc, s), "torch": torch_path}
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(reps):
            for name, fn in fns.items():
                t0 = time.process_time()
                for _ in range(calls):
                    fn()
                best[name] = min(best[name], (time.process_time() - t0) / calls)
        print(
            f"  {tokens:5d} tokens: native {1e6 * best['native']:8.1f} us, torch {1e6 * best['torch']:8.1f} us,"
            f" torch/native {best['torch'] / best['native']:.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None, help="git revision whose kernel to time too (e.g. main)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="steps per repeat")
    ap.add_argument("--small-pages", action="store_true", help="4 KiB pages (the engine uses huge pages)")
    ap.add_argument("--no-torch", action="store_true", help="leave out the engine's path without the kernel")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="cache and queries")
    ap.add_argument("--avx2", action="store_true", help="the kernels an AVX2-only CPU runs (see above)")
    ap.add_argument("--write-kv", action="store_true", help="time write_kv against index_copy_ instead")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.write_kv:
        bench_write_kv(getattr(torch, args.dtype), args.repeats)
        return
    gen = torch.Generator().manual_seed(0)
    shape = (LAYERS, 2, KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM)
    dtype = getattr(torch, args.dtype)
    cache = hugepages.zeros(shape, dtype)  # ~1.5 GB (bf16), the engine's layout and pages
    if args.small_pages:
        cache = torch.zeros(shape, dtype=dtype)
    cache.copy_(torch.randn(shape, generator=gen) * 0.5)
    fns = variants(
        load_baseline(args.baseline) if args.baseline else None, not args.no_torch, dtype, args.avx2
    )
    print(
        f"layers {LAYERS}, kv_heads {KV_HEADS}, group {GROUP}, head_dim {HEAD_DIM}, {args.dtype} KV and q, "
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
        mb = LAYERS * batch * context * KV_HEADS * HEAD_DIM * 2 * cache.element_size() / 1e6
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
