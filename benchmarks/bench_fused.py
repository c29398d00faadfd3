"""The fused bf16 element-wise kernels (kvbalance/model/fused.py) against the torch ops they replace, in
the real engine: SmolLM2-135M in bf16 on one thread, CPU ms per step for a prefill step of ``--prefill``
tokens and a decode step of ``--batch`` sequences at context ~``--context``.

The two paths alternate step by step in one process (the kernels are switched off by clearing the loaded
library), so both see the same machine load; the minimum and the median of ``--reps`` steps each are printed.

    taskset -c 1 .venv/bin/python benchmarks/bench_fused.py --reps 9
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from decoding import decoding_engine

from kvbalance.llm import LLMEngine
from kvbalance.model import fused
from kvbalance.request import SamplingParams


def _timed_step(eng: LLMEngine, use_fused: bool, lib) -> float:
    fused._libs[torch.bfloat16] = lib if use_fused else None  # None: fused.supports() is False, torch runs
    c0 = time.process_time()
    eng.step()
    return 1e3 * (time.process_time() - c0)


def prefill(tokens: int, reps: int, lib) -> dict[bool, list[float]]:
    eng = LLMEngine("smollm2-135m", num_threads=1, max_num_batched_tokens=tokens)
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
    eng, ms = decoding_engine(batch, context, max_tokens=2 * reps + 16), {True: [], False: []}
    for i in range(2 * reps + 2):
        t = _timed_step(eng, i % 2 == 0, lib)
        if i >= 2:
            ms[i % 2 == 0].append(t)
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", type=int, default=2048, help="tokens in the prefill step")
    p.add_argument("--batch", type=int, default=64, help="sequences in the decode step")
    p.add_argument("--context", type=int, default=200, help="prompt tokens of each decoding sequence")
    p.add_argument("--reps", type=int, default=7, help="steps timed per path")
    args = p.parse_args()
    torch.set_num_threads(1)
    lib = fused.library()
    if lib is None:
        raise SystemExit("the fused kernels are unavailable here (no compiler, or KVBALANCE_NATIVE=0)")
    rows = [
        (f"prefill {args.prefill} tokens", prefill(args.prefill, args.reps, lib)),
        (f"decode {args.batch} seqs, ctx ~{args.context}", decode(args.batch, args.context, args.reps, lib)),
    ]
    fused._libs[torch.bfloat16] = lib
    print("CPU ms per step (a shared machine: the minimum is the least disturbed step)")
    print(f"{'step':32s} {'':6s} {'torch':>8s} {'fused':>8s} {'saved':>6s}")
    for name, ms in rows:
        for stat, f in (("min", min), ("median", statistics.median)):
            off, on = f(ms[False]), f(ms[True])
            print(f"{name:32s} {stat:6s} {off:8.1f} {on:8.1f} {1 - on / off:6.1%}")


if __name__ == "__main__":
    main()
