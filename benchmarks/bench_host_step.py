"""Host work of the real engine's decode step (issue 12): SmolLM2-135M in bf16, ``--batch`` sequences at
context ~``--context``, CPU and wall ms per step with the glue-free decode layers
(``kvbalance/model/decode_step.py``) on and off, alternating step by step in one process (both see the
same machine load), and the step's host parts outside the forward (timers around them).

    taskset -c 1 .venv/bin/python benchmarks/bench_host_step.py --batch 64 --context 300
    taskset -c 0,1 .venv/bin/python benchmarks/bench_host_step.py --batch 64 --threads 2

Measured on the shared 2-core machine (general -> glue-free, ms): 64 x 300, one thread, CPU min / lower
quartile / median 86.9 / 88.8 / 93.6 -> 82.6 / 84.7 / 88.1; 32 x 300, one thread, 55.8 / 60.7 / 63.2 ->
53.1 / 57.2 / 60.9; two threads, wall min / median 68.9 / 71.2 -> 65.6 / 69.5 (64) and 35.4 / 41.2 ->
32.6 / 39.6 (32).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from decoding import decoding_engine

from kvbalance.model import decode_step


def _toggle(eng, reps: int) -> dict[bool, tuple[list[float], list[float]]]:
    real, ms = decode_step.decode_plan, {True: ([], []), False: ([], [])}
    try:
        for i in range(2 * reps + 2):
            on = i % 2 == 0
            decode_step.decode_plan = real if on else (lambda *a: None)
            c0, w0 = time.process_time(), time.perf_counter()
            eng.step()
            if i >= 2:  # one warm-up step each
                ms[on][0].append(1e3 * (time.process_time() - c0))
                ms[on][1].append(1e3 * (time.perf_counter() - w0))
    finally:
        decode_step.decode_plan = real
    return ms


def _parts(eng, reps: int) -> dict[str, list[float]]:
    """CPU ms of the step's parts: the engine step, the executor, its preparation, the forward, the LM
    head and sampling (the rest of the engine step is the scheduler and output processing)."""
    acc: dict[str, list[float]] = {}
    ex = eng.executor
    targets = [
        (eng, "step", "engine step"),
        (ex, "execute", "executor.execute"),
        (ex, "_prepare", "  prepare (metadata, ids)"),
        (ex.model, "forward", "  model forward"),
        (ex.model, "compute_logits", "  LM head"),
    ]
    for obj, name, label in targets:
        f = getattr(obj, name)

        def timed(*a, _f=f, _label=label, **k):
            c0 = time.process_time()
            try:
                return _f(*a, **k)
            finally:
                acc.setdefault(_label, []).append(1e3 * (time.process_time() - c0))

        setattr(obj, name, timed)
    try:
        for _ in range(reps):
            eng.step()
    finally:
        for obj, name, _ in targets:
            delattr(obj, name)  # the instance attribute shadowed the method
    return acc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64, help="decoding sequences")
    p.add_argument("--context", type=int, default=300, help="prompt tokens of each sequence")
    p.add_argument("--threads", type=int, default=1, help="compute threads")
    p.add_argument("--reps", type=int, default=15, help="steps timed per path")
    args = p.parse_args()
    eng = decoding_engine(args.batch, args.context, max_tokens=3 * args.reps + 16)
    torch.set_num_threads(args.threads)
    ms = _toggle(eng, args.reps)
    print(f"decode step, {args.batch} seqs at context ~{args.context}, {args.threads} thread(s); ms per step")
    print(f"{'layers':12s} {'cpu min':>8s} {'cpu q1':>8s} {'cpu med':>8s} {'wall min':>9s} {'wall med':>9s}")
    for on, name in ((False, "general"), (True, "glue-free")):
        cpu, wall = ms[on]
        print(
            f"{name:12s} {min(cpu):8.1f} {statistics.quantiles(cpu, n=4)[0]:8.1f} {statistics.median(cpu):8.1f} "
            f"{min(wall):9.1f} "
            f"{statistics.median(wall):9.1f}"
        )
    print("\nCPU ms of the step's parts (glue-free layers), median")
    for label, v in _parts(eng, args.reps).items():
        print(f"{label:28s} {statistics.median(v):8.2f}")


if __name__ == "__main__":
    main()
