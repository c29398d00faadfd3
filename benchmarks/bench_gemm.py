"""The AMX bf16 GEMM (kvbalance/model/amx_gemm.py) and, where the CPU has AVX512-BF16, the AVX-512 one
(kvbalance/model/avx512_gemm.py, column ``AVX512``) against oneDNN's matmul on SmolLM2-135M's linears.

``layers``: one decode step's 120 layer linears (30 layers x fused QKV [960x576], o [576x576], fused
gate-up [3072x576], down [576x1536]) with 30 layers of distinct weights (212 MB, so nothing stays in
cache, as in the real model), then the tied LM head [49152x576]; ms per step, GB/s of weight read,
GFLOP/s, for oneDNN's pre-packed weight (what packed.py runs above ``AMX_MAX_ROWS`` rows), oneDNN on
the plain weight (``F.linear``, for reference) and the AMX kernel (on the plain weight). The paths
alternate run by run (the machine is shared: each sees the same load); each figure is the best of
``--reps``.

``avx2``: the same shapes in float32, MKL's packed GEMM (what packed.py runs for float32 where the AVX2
kernel is not preferred) against the AVX2 kernel of kvbalance/model/avx2_gemm.py (on its packed panels).
For the figure an AVX2-only CPU would give, run it with MKL held to AVX2 (``MKL_ENABLE_INSTRUCTIONS=AVX2``).

``engine``: the real engine's decode step (``--batch`` sequences at context ``--context``), steps
alternating in one process between oneDNN (``packed.AMX_MAX_ROWS`` = 0) and the AMX kernel (its
value, or ``--amx-rows``): CPU ms per step and of it the layers' linears and the LM head
(``compute_logits``), medians over ``--steps`` steps each.

    taskset -c 1 .venv/bin/python benchmarks/bench_gemm.py layers --reps 7
    taskset -c 1 .venv/bin/python benchmarks/bench_gemm.py layers --rows 32 40 48 56 64 80 96 128
    taskset -c 1 .venv/bin/python benchmarks/bench_gemm.py engine --batch 64 --context 300
    MKL_ENABLE_INSTRUCTIONS=AVX2 taskset -c 1 .venv/bin/python benchmarks/bench_gemm.py avx2 --reps 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvbalance.model import amx_gemm, avx2_gemm, avx512_gemm

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K) of one layer's linears
LAYERS = 30
HEAD_SHAPE = (49152, 576)
ROWS = (1, 8, 16, 32, 40, 48, 56, 64, 80, 96, 128, 256, 512)


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, 64)


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _best_alternating(runs: dict, reps: int) -> dict[str, float]:
    best = dict.fromkeys(runs, float("inf"))
    for run in runs.values():
        run()  # warm-up
    for _ in range(reps):
        for name, run in runs.items():
            t0 = time.process_time()
            run()
            best[name] = min(best[name], time.process_time() - t0)
    return best


def bench_shapes(shapes: tuple[tuple[int, int], ...], layers: int, rows: tuple[int, ...], reps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = [
        [torch.randn(n, k, generator=gen).mul_(0.02).bfloat16() for n, k in shapes] for _ in range(layers)
    ]
    packs = {"oneDNN": [[_onednn_pack(w) for w in ws] for ws in weights], "plain": weights}
    if amx_gemm.available():
        packs["AMX"] = weights
    if avx512_gemm.available():  # its packed panels, with N
        packs["AVX512"] = [[(avx512_gemm.pack(w), w.shape[0]) for w in ws] for ws in weights]
    calls = {
        "oneDNN": _onednn,
        "plain": F.linear,
        "AMX": amx_gemm.linear,
        "AVX512": lambda x, pn: avx512_gemm.linear(x, pn[0], pn[1]),
    }
    weight_bytes = sum(n * k * 2 for n, k in shapes) * layers
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for _, k in shapes}
        runs = {
            name: (
                lambda ps=ps, f=calls[name], xs=xs: [
                    f(xs[k], p) for row in ps for (_, k), p in zip(shapes, row)
                ]
            )
            for name, ps in packs.items()
        }
        best = _best_alternating(runs, reps)
        cells = []
        for name, t in best.items():
            gflops = 2 * m * weight_bytes / 2 / t / 1e9
            cells.append(f"{name} {1e3 * t:7.2f} ms {weight_bytes / t / 1e9:5.1f} GB/s {gflops:5.0f} GFLOP/s")
        ratio = "".join(
            f"  {name}/oneDNN {best['oneDNN'] / best[name]:.2f}x"
            for name in ("AMX", "AVX512")
            if name in best
        )
        print(f"M={m:4d}: " + " | ".join(cells) + ratio, flush=True)


def bench_shapes_f32(
    shapes: tuple[tuple[int, int], ...], layers: int, rows: tuple[int, ...], reps: int
) -> None:
    """float32: MKL's packed GEMM against the AVX2 kernel, alternating, best of ``reps`` (CPU time)."""
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen).mul_(0.02) for n, k in shapes] for _ in range(layers)]
    mkl = [[(torch.ops.mkl._mkl_reorder_linear_weight(w, 64), w) for w in ws] for ws in weights]
    panels = [[(avx2_gemm.pack(w), w.shape[0]) for w in ws] for ws in weights]
    weight_bytes = sum(n * k * 4 for n, k in shapes) * layers
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for _, k in shapes}
        runs = {
            "MKL": lambda xs=xs, m=m: [
                torch.ops.mkl._mkl_linear(xs[k], p, w, None, m)
                for row in mkl
                for (_, k), (p, w) in zip(shapes, row)
            ],
            "AVX2": lambda xs=xs: [
                avx2_gemm.linear(xs[k], p, n) for row in panels for (_, k), (p, n) in zip(shapes, row)
            ],
        }
        best = _best_alternating(runs, reps)
        cells = []
        for name, t in best.items():
            gflops = 2 * m * weight_bytes / 4 / t / 1e9
            cells.append(f"{name} {1e3 * t:7.2f} ms {weight_bytes / t / 1e9:5.1f} GB/s {gflops:5.0f} GFLOP/s")
        print(f"M={m:4d}: " + " | ".join(cells) + f"  AVX2/MKL {best['MKL'] / best['AVX2']:.2f}x", flush=True)


def bench_engine(batch: int, context: int, steps: int, amx_rows: int | None) -> None:
    from decoding import decoding_engine

    from kvbalance.model import llama, packed

    if not amx_gemm.available():
        raise SystemExit("engine: needs the AMX kernel")
    eng = decoding_engine(batch, context, max_tokens=2 * steps + 40)
    model = eng.executor.model
    if model.embed.weight.dtype != torch.bfloat16:
        raise SystemExit("engine: needs a bf16 model")
    spent = {"linear": 0.0, "logits": 0.0}

    def timed(key: str, f):
        def wrapped(*args, **kwargs):
            t0 = time.process_time()
            try:
                return f(*args, **kwargs)
            finally:
                spent[key] += time.process_time() - t0

        return wrapped

    llama.linear = timed("linear", llama.linear)
    model.compute_logits = timed("logits", model.compute_logits)
    rows_amx = packed.AMX_MAX_ROWS if amx_rows is None else amx_rows
    figures = {name: {"step": [], "linear": [], "logits": []} for name in ("oneDNN", "AMX")}
    for i in range(2 * steps + 2):  # two warm-up steps
        name = "AMX" if i % 2 else "oneDNN"
        packed.AMX_MAX_ROWS = rows_amx if name == "AMX" else 0
        spent.update(linear=0.0, logits=0.0)
        t0 = time.process_time()
        eng.step()
        if i >= 2:
            figures[name]["step"].append(time.process_time() - t0)
            figures[name]["linear"].append(spent["linear"])
            figures[name]["logits"].append(spent["logits"])
    for name, fig in figures.items():
        cells = ", ".join(f"{k} {1e3 * statistics.median(v):.1f}" for k, v in fig.items())
        print(f"B={batch} ctx={context} {name}: CPU ms (median of {steps}): {cells}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("layers", "avx2", "engine"))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--amx-rows", type=int, default=None, help="engine: AMX_MAX_ROWS on the AMX side")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"AMX kernel available: {amx_gemm.available()}; AVX-512 BF16 kernel: {avx512_gemm.available()}")
    if args.what == "engine":
        bench_engine(args.batch, args.context, args.steps, args.amx_rows)
        return
    if args.what == "avx2":
        if not avx2_gemm.available():
            raise SystemExit("avx2: the AVX2 kernel does not run here (no AVX2 + FMA, or no compiler)")
        print(f"-- float32, {LAYERS} layers of SmolLM2-135M linears (cold weights), per decode step")
        bench_shapes_f32(LAYER_SHAPES, LAYERS, tuple(args.rows), args.reps)
        print(f"-- tied LM head {HEAD_SHAPE[0]}x{HEAD_SHAPE[1]}")
        bench_shapes_f32((HEAD_SHAPE,), 1, tuple(args.rows), args.reps)
        return
    print(f"-- {LAYERS} layers of SmolLM2-135M linears (cold weights), per decode step")
    bench_shapes(LAYER_SHAPES, LAYERS, tuple(args.rows), args.reps)
    print(f"-- tied LM head {HEAD_SHAPE[0]}x{HEAD_SHAPE[1]}")
    bench_shapes((HEAD_SHAPE,), 1, tuple(args.rows), args.reps)


if __name__ == "__main__":
    main()
