"""Validate the GPU cost model against the real PyTorch executor on a lent GPU (one short, prepared run).

Times ``TorchExecutor.execute`` for a grid of prefill chunks, decode batches x contexts and mixed steps of
a preset model with random weights (bf16 on CUDA), compares each with the cost model's prediction for the
chosen GPU preset, and fits the preset's efficiency factors to the measurements. Prints a table and writes
JSON. The executor's attention on CUDA is PyTorch SDPA over gathered blocks (no paged FlashAttention
kernel), so decode attention is slower than in vLLM; GEMM-dominated steps are the cleaner check.

    python benchmarks/gpu_validate.py --model llama-3-8b --gpu h200 --device cuda --dtype bfloat16
    python benchmarks/gpu_validate.py --model tiny-llama --gpu a100-80gb --device cpu --dtype float32 --quick
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvbalance.executor.torch import TorchExecutor
from kvbalance.model.llama import LlamaConfig
from kvbalance.model.weights import random_weights
from kvbalance.perf.calibrate import fit_hardware
from kvbalance.perf.cost import CostModel, breakdown_total_s
from kvbalance.profile import GridPoint, kv_blocks_for_grid, measure_grid
from kvbalance.specs import get_gpu, get_model

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def grid(quick: bool, max_context: int) -> list[GridPoint]:
    if quick:
        prefill, batches, contexts, mixed = (16, 64), (1, 4), (32, 96), ((4, 64, 32),)
    else:
        prefill = (128, 512, 2048, 4096)
        batches, contexts = (1, 8, 32, 128), (512, 2048)
        mixed = ((32, 1024, 480), (128, 1024, 384))
    pts = [GridPoint(f"prefill-{n}", [(n, n, True)]) for n in prefill if n <= max_context]
    pts += [
        GridPoint(f"decode-{b}x{c}", [(1, c, True)] * b)
        for b in batches
        for c in contexts
        if c <= max_context
    ]
    pts += [GridPoint(f"mixed-{b}x{c}+{n}", [(1, c, True)] * b + [(n, n, True)]) for b, c, n in mixed]
    return pts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--gpu", default="h200", help="GPU preset the measurements are compared with")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/gpu_validate.json")
    args = ap.parse_args()

    spec, hw = get_model(args.model), get_gpu(args.gpu)
    config = LlamaConfig.from_spec(spec)
    points = grid(args.quick, spec.max_context)
    t0 = time.perf_counter()
    weights = random_weights(config, seed=0, dtype=DTYPES[args.dtype])
    num_blocks = kv_blocks_for_grid(points, args.block_size) + 8
    ex = TorchExecutor(config, weights, num_blocks, args.block_size, args.device, DTYPES[args.dtype])
    del weights
    print(f"{args.model} on {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), "
          f"{num_blocks} KV blocks, set-up {time.perf_counter() - t0:.1f} s")  # fmt: skip

    samples = measure_grid(ex, points, vocab=config.vocab_size, warmup=2, repeats=5)
    cm = CostModel(spec, hw)
    rows = []
    print(f"{'step':<22} {'measured ms':>12} {'predicted ms':>13} {'error':>8}")
    for s in samples:
        pred = breakdown_total_s(cm.step(s.seqs))
        err = (pred - s.step_s) / s.step_s
        rows.append({"name": s.name, "measured_s": s.step_s, "predicted_s": pred, "rel_error": err})
        print(f"{s.name:<22} {s.step_s * 1e3:>12.2f} {pred * 1e3:>13.2f} {err:>+8.1%}")
    fit = fit_hardware(
        spec,
        hw,
        [(s.seqs, s.step_s) for s in samples],
        fit=(
            "compute_eff_max",
            "memory_eff_max",
            "attention_eff_ratio",
            "kv_memory_eff_ratio",
            "step_overhead_s",
        ),
        name=f"{hw.name}-fitted",
    )
    print(
        f"preset {hw.name}: median |error| {fit.base_median_rel_error:.1%}; fitted: {fit.median_rel_error:.1%} "
        f"(max {fit.max_rel_error:.1%}) with {fit.params}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": args.model,
                "gpu_preset": hw.name,
                "device": args.device,
                "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "dtype": args.dtype,
                "steps": rows,
                "fit": fit.to_dict(),
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
