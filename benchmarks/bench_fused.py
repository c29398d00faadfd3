"""The fused element-wise kernels (kvbalance/model/fused.py) against the torch ops they replace, in the real
engine: SmolLM2-135M on one thread (bf16, or ``--dtype float32``), CPU ms per step for a prefill step of
``--prefill`` tokens and a decode step of ``--batch`` sequences at context ~``--context``.

The two paths alternate step by step in one process (the kernels are switched off by clearing the loaded
library), so both see the same machine load; the minimum and the median of ``--reps`` steps each are printed.

``--ops``: each kernel alone against the torch code the model runs without it (``F.rms_norm``; the residual
add then ``F.rms_norm``; ``F.silu(gate) * up``; ``llama.apply_rope``; the greedy argmax's float32 copy and
numpy argmax), on SmolLM2's shapes at 64 and 2,048 rows: CPU us per call, best of ``--reps`` rounds of 20
calls, the two alternating, and torch / fused.

    taskset -c 1 .venv/bin/python benchmarks/bench_fused.py --reps 9 [--dtype float32]
    taskset -c 1 .venv/bin/python benchmarks/bench_fused.py --ops --reps 15 [--dtype float32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F
from decoding import decoding_engine

from kvbalance.llm import LLMEngine
from kvbalance.model import fused, llama
from kvbalance.request import SamplingParams

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB, EPS = 576, 1536, 9, 3, 64, 49152, 1e-5


def _timed_step(eng: LLMEngine, use_fused: bool, lib) -> float:
    fused._libs[lib.dtype] = lib if use_fused else None  # None: fused.supports() is False, torch runs
    c0 = time.process_time()
    eng.step()
    return 1e3 * (time.process_time() - c0)


def prefill(tokens: int, reps: int, lib) -> dict[bool, list[float]]:
    eng = LLMEngine("smollm2-135m", num_threads=1, max_num_batched_tokens=tokens, dtype=str(lib.dtype)[6:])
    rng, ms = random.Random(0), {True: [], False: []}
    for i in range(2 * reps + 2):  # two warm-up steps
        eng.add_request([rng.randrange(1000, 40000) for _ in range(tokens)], SamplingParams(max_tokens=1))
        t = _timed_step(eng, i % 2 == 0, lib)
        if i >= 2:
            ms[i % 2 == 0].append(t)
        while eng.has_unfinished():
            eng.step()
    return ms


def decode(batch: int, context: int, reps: int, lib) -> dict[bool, list[float]]:
    eng = decoding_engine(batch, context, max_tokens=2 * reps + 16, dtype=str(lib.dtype)[6:])
    ms: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * reps + 2):
        t = _timed_step(eng, i % 2 == 0, lib)
        if i >= 2:
            ms[i % 2 == 0].append(t)
    return ms


def _ops(rows: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, tuple]:
    """Per kernel: (fused call, torch call) on fresh inputs of ``rows`` rows."""
    x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    delta = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, generator=gen).to(dtype)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    angles = torch.rand(rows, HEAD_DIM // 2, generator=gen) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    nh, q_k = HEADS + KV_HEADS, (HEADS + KV_HEADS) * HEAD_DIM
    h1, h2 = x.clone(), x.clone()

    def torch_add_norm():
        h2.add_(delta)
        return F.rms_norm(h2, (HIDDEN,), w, EPS)

    ops = {
        "rms_norm": (lambda: fused.rms_norm(x, w, EPS), lambda: F.rms_norm(x, (HIDDEN,), w, EPS)),
        "add_rms_norm": (lambda: fused.add_rms_norm(h1, delta, w, EPS), torch_add_norm),
        "silu_and_mul": (
            lambda: fused.silu_and_mul(gate_up),
            lambda: F.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:],
        ),
        "rope": (
            lambda: fused.rope_(qkv, cos, sin, nh, HEAD_DIM),
            lambda: llama.apply_rope(qkv[:, :q_k].view(rows, nh, HEAD_DIM), cos, sin),
        ),
    }
    if dtype == torch.bfloat16 and rows <= 64:  # the greedy argmax (a decode batch): bf16 logits only
        logits = torch.randn(rows, VOCAB, generator=gen).to(dtype)
        ops["argmax_rows"] = (
            lambda: fused.argmax_rows(logits),
            lambda: logits.float().numpy().argmax(axis=-1).tolist(),
        )
    return ops


def bench_ops(dtype: torch.dtype, reps: int, calls: int = 20) -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"{str(dtype)[6:]} rows; CPU us per call, best of {reps} rounds of {calls} calls, alternating")
    print(f"{'kernel':14s} {'rows':>5s} {'torch':>9s} {'fused':>9s} {'torch/fused':>11s}")
    for rows in (64, 2048):
        for name, (mine, theirs) in _ops(rows, dtype, gen).items():
            best = {"fused": float("inf"), "torch": float("inf")}
            for fn in (mine, theirs):
                fn()  # warm-up
            for _ in range(reps):
                for key, fn in (("fused", mine), ("torch", theirs)):
                    t0 = time.process_time()
                    for _ in range(calls):
                        fn()
                    best[key] = min(best[key], (time.process_time() - t0) / calls)
            print(
                f"{name:14s} {rows:5d} {1e6 * best['torch']:9.1f} {1e6 * best['fused']:9.1f}"
                f" {best['torch'] / best['fused']:10.2f}x",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", type=int, default=2048, help="tokens in the prefill step")
    p.add_argument("--batch", type=int, default=64, help="sequences in the decode step")
    p.add_argument("--context", type=int, default=200, help="prompt tokens of each decoding sequence")
    p.add_argument("--reps", type=int, default=7, help="steps timed per path")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the model's dtype")
    p.add_argument("--ops", action="store_true", help="each kernel alone against its torch code (see above)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.ops:
        with torch.inference_mode():
            bench_ops(getattr(torch, args.dtype), args.reps)
        return
    lib = fused.library(getattr(torch, args.dtype))
    if lib is None:
        raise SystemExit("the fused kernels are unavailable here (no compiler, or KVBALANCE_NATIVE=0)")
    lib.dtype = getattr(torch, args.dtype)
    rows = [
        (f"prefill {args.prefill} tokens", prefill(args.prefill, args.reps, lib)),
        (f"decode {args.batch} seqs, ctx ~{args.context}", decode(args.batch, args.context, args.reps, lib)),
    ]
    fused._libs[lib.dtype] = lib
    print(f"{args.dtype} model; CPU ms per step (a shared machine: the minimum is the least disturbed step)")
    print(f"{'step':32s} {'':6s} {'torch':>8s} {'fused':>8s} {'saved':>6s}")
    for name, ms in rows:
        for stat, f in (("min", min), ("median", statistics.median)):
            off, on = f(ms[False]), f(ms[True])
            print(f"{name:32s} {stat:6s} {off:8.1f} {on:8.1f} {1 - on / off:6.1%}")


if __name__ == "__main__":
    main()
