"""Prefill attention alone, one thread, at SmolLM2-135M's shape: the paged kernel this CPU runs (AMX, or
AVX512-BF16 without AMX) vs SDPA as the engine called it before the kernel (and still does where the kernel
cannot run).

Cases: a whole prompt of 256 / 1,024 / 2,048 tokens (``q_start = 0``; SDPA ``is_causal=True`` on the
chunk's own K/V, the strided views out of the fused QKV output) and later chunks of 512 / 1,024
tokens after 1,024 cached ones (SDPA over the context gathered from the paged cache, with the float
bottom-right mask; the gather is timed too, as the engine pays it). 9 query heads, 3 KV heads, head
dim 64, bf16, blocks of 64 drawn at random from a 64k-token cache. The two alternate call by call (the
machine is shared: each sees the same load). Prints CPU ms per call (best of the repeats) and GFLOP/s
counting causal FLOPs (4 * head_dim per attended score per head: 2 L^2 D per head for a whole prompt).

``--engine`` also runs ``/tmp/prof4.py``'s measurement: CPU ms per 2,048-token prefill step of the
real SmolLM2 (prompts of ``--prompt`` tokens), with the kernel and with ``KVBALANCE_NATIVE_AMX=0``.

Run pinned to one core: taskset -c 1 .venv/bin/python benchmarks/bench_prefill_attention.py
[--repeats 7] [--engine --prompt 1024]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import time

import torch
import torch.nn.functional as F

from kvbalance.model import native_prefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK, CACHE_BLOCKS = 9, 3, 64, 64, 1024
SCALE = HEAD_DIM**-0.5
CASES = ((0, 256), (0, 1024), (0, 2048), (1024, 512), (1024, 1024))


def _setup(q_start: int, n: int, gen: torch.Generator):
    ctx = q_start + n
    kc = torch.randn(KV_HEADS, CACHE_BLOCKS, BLOCK, HEAD_DIM, generator=gen).bfloat16()
    vc = torch.randn(KV_HEADS, CACHE_BLOCKS, BLOCK, HEAD_DIM, generator=gen).bfloat16()
    table = torch.randperm(CACHE_BLOCKS, generator=gen)[: (ctx + BLOCK - 1) // BLOCK]
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).bfloat16()
    q, k, v = qkv.view(n, -1, HEAD_DIM).split((HEADS, KV_HEADS, KV_HEADS), dim=1)
    slots = table[(q_start + torch.arange(n)) // BLOCK] * BLOCK + (q_start + torch.arange(n)) % BLOCK
    kc.view(KV_HEADS, -1, HEAD_DIM)[:, slots] = k.transpose(0, 1)
    vc.view(KV_HEADS, -1, HEAD_DIM)[:, slots] = v.transpose(0, 1)
    pos = q_start + torch.arange(n)
    allowed = torch.arange(ctx)[None, :] <= pos[:, None]
    bias = torch.zeros(n, ctx).masked_fill(~allowed, float("-inf")).bfloat16()
    return q, k, v, kc, vc, table, bias


def _sdpa(q, k, v, kc, vc, table, bias, q_start):
    """The engine's path before the kernel (``Attention._attend``'s prefill branch)."""
    n, ctx = q.shape[0], q_start + q.shape[0]
    qp = q.transpose(0, 1).unsqueeze(0)
    if q_start == 0:
        kk, vv = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qp, kk, vv, is_causal=True, scale=SCALE, enable_gqa=True)
    else:

        def gather(cache):
            rows = cache.view(KV_HEADS, CACHE_BLOCKS, -1).index_select(1, table)
            return rows.view(KV_HEADS, 1, -1, HEAD_DIM).transpose(0, 1)[:, :, :ctx]

        out = F.scaled_dot_product_attention(
            qp, gather(kc), gather(vc), attn_mask=bias, scale=SCALE, enable_gqa=True
        )
    return out[0].transpose(0, 1).reshape(n, HEADS * HEAD_DIM)


def _best_ms_alternating(fns: list, repeats: int) -> list[float]:
    """Best CPU ms of each of ``fns`` over ``repeats`` rounds, the functions alternating within a round."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.process_time()
            fn()
            best[i] = min(best[i], time.process_time() - t)
    return [1e3 * b for b in best]


def kernel_table(repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    print(
        f"{'q_start':>7} {'n':>5} | {'SDPA ms':>8} {'GFLOP/s':>8} | {'kernel ms':>9} {'GFLOP/s':>8} | speedup"
    )
    for q_start, n in CASES:
        q, k, v, kc, vc, table, bias = _setup(q_start, n, gen)
        flops = HEADS * 4 * HEAD_DIM * (n * q_start + n * (n + 1) / 2)
        sdpa = functools.partial(_sdpa, q, k, v, kc, vc, table, bias, q_start)
        kernel = functools.partial(native_prefill.paged_prefill_attention, q, kc, vc, table, q_start, SCALE)
        torch.testing.assert_close(kernel().float(), sdpa().float(), atol=3e-2, rtol=2**-6)
        t_sdpa, t_kern = _best_ms_alternating([sdpa, kernel], repeats)
        g_sdpa, g_kern = flops / t_sdpa / 1e6, flops / t_kern / 1e6
        print(
            f"{q_start:>7} {n:>5} | {t_sdpa:>8.2f} {g_sdpa:>8.0f} | {t_kern:>9.2f} {g_kern:>8.0f} |"
            f" {t_sdpa / t_kern:.2f}x"
        )


def engine_step_ms(prompt: int, rounds: int = 3) -> tuple[float, int]:
    """CPU ms per step of 2,048-token prefill batches of the real SmolLM2 (``/tmp/prof4.py``)."""
    from kvbalance.llm import LLMEngine
    from kvbalance.request import SamplingParams

    eng = LLMEngine("smollm2-135m", num_threads=1)
    rng = random.Random(0)

    def batch() -> None:
        for _ in range(2048 // prompt):
            ids = [rng.randrange(1000, 40000) for _ in range(prompt)]
            eng.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))

    batch()
    eng.run_until_done()
    tot, steps = 0.0, 0
    for _ in range(rounds):
        batch()
        while eng.has_unfinished():
            t = time.process_time()
            eng.step()
            tot += time.process_time() - t
            steps += 1
    return 1e3 * tot / steps, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--engine", action="store_true", help="also time real SmolLM2 prefill steps")
    ap.add_argument("--prompt", type=int, default=1024, help="--engine: prompt length (2,048 tokens a step)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not native_prefill.available():
        raise SystemExit("no prefill kernel runs here (no AMX or AVX512-BF16, no compiler, or disabled)")
    print("kernel:", "AMX" if native_prefill.library().amx else "AVX512-BF16")
    kernel_table(args.repeats)
    if args.engine:
        for amx in ("1", "0"):
            os.environ["KVBALANCE_NATIVE_AMX"] = amx
            ms, steps = engine_step_ms(args.prompt)
            label = "kernel" if amx == "1" else "SDPA (KVBALANCE_NATIVE_AMX=0)"
            print(f"engine, prompts of {args.prompt}: {ms:.0f} ms CPU per step ({steps} steps), {label}")


if __name__ == "__main__":
    main()
