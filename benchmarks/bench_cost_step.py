"""CostModel.step speed with and without the measured-shape corrections (the simulator's hot path).

llama-2-7b on h100-sxm (its shapes are profiled there, so every GEMM and element-wise kernel is corrected)
against the same preset with the corrections removed; 3000 random decode / mixed steps, CPU time per call,
best of 5 rounds (the correction factors are cached per token count: round 1 fills the cache).
Run: .venv/bin/python benchmarks/bench_cost_step.py
"""

from __future__ import annotations

import random
import time

from kvbalance.perf.cost import CostModel
from kvbalance.specs import get_gpu


def steps(n: int = 3000, seed: int = 0) -> list[list[tuple[int, int, bool]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = [(1, rng.randint(50, 2000), True)] * rng.randint(1, 64)
        if rng.random() < 0.3:
            m = rng.randint(16, 2048)
            s.append((m, m, True))
        out.append(s)
    return out


def main() -> dict:
    hw = get_gpu("h100-sxm")
    work = steps()
    models = {"physical": CostModel("llama-2-7b", hw.with_(shape_corrections={})),
              "corrected": CostModel("llama-2-7b", hw)}  # fmt: skip
    best = {k: float("inf") for k in models}
    for _ in range(5):
        for name, cm in models.items():  # interleaved: both see the same machine load
            t = time.process_time()
            for s in work:
                cm.step(s)
            best[name] = min(best[name], (time.process_time() - t) / len(work))
    for name, v in best.items():
        print(f"{name:>10}: {v * 1e6:6.1f} us CPU per CostModel.step (best of 5)")
    print(f"{'ratio':>10}: {best['corrected'] / best['physical']:.2f}")
    return best


if __name__ == "__main__":
    main()
