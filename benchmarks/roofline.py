"""Roofline of a real-engine workload on this CPU: the output rate no engine can beat at a given DRAM read
rate and GEMM rate (used by ``bench_real_engine.py``; not a test).

Decode on a CPU is memory-bound: every step reads all the layer weights once (whatever its batch) and
every running sequence's whole KV cache, while its matmuls (a few dozen rows) take a fraction of that
time. The model is the best schedule for a batch submitted at once (all prompts prefilled first, then
every sequence decoding in one batch from its first step):

- prefill: ``max(FLOPs / GEMM rate, weight bytes / read rate)`` over all prompts, FLOPs = 2 x layer
  parameters per prompt token + the LM head per prompt + causal attention (2 L^2 head_dim per head and
  layer: QK^T and PV over the lower triangle);
- decode step ``j`` (1 .. longest output - 1): the sequences that still generate a token feed their
  token ``j`` and attend over ``input + j`` positions; the step takes ``max(bytes / read rate, FLOPs /
  GEMM rate)`` with bytes = all weights (layers + LM head) + those positions' K and V in every layer.

A real engine also pays activations, sampling, host work and the schedule it chooses (chunked prefill
mixes the two phases), so its share of this limit is below 100%. The read rate is measured by
:func:`stream_read_gbs` on the cores the engines will run on.
"""

from __future__ import annotations

import time


def _native_reader():
    """The compiled read loop (kvbalance.model.cbuild), or None where it cannot be built."""
    import ctypes

    from kvbalance.model import cbuild

    lib = cbuild.load("roofline_read", ("roofline_read.c",), fallback="torch's sum")  # kvbalance/native/
    if lib is None:
        return None
    lib.read_sum.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)
    lib.read_sum.restype = ctypes.c_float
    return lib.read_sum


def stream_read_gbs(threads: int, gib: float = 1.0) -> float:
    """Best DRAM read rate (GB/s) over a ``gib``-GiB float32 buffer with ``threads`` threads.

    A tight compiled loop of aligned 64-byte loads (four accumulators per thread) where a C compiler
    is available: on the development machine it reads 14-16 GB/s on one core where torch's float32
    ``sum`` reads 10-11 (its reduction, not the memory, limits it), so the torch figure would place
    the roofline too low. Falls back to torch's sum.
    """
    import torch

    torch.set_num_threads(threads)
    buf = torch.ones(int(gib * 2**30) // 256 * 64, dtype=torch.float32)  # 256-byte aligned chunks
    reader = _native_reader()
    if reader is not None and buf.data_ptr() % 64 == 0:
        run = lambda: reader(buf.data_ptr(), buf.numel(), threads)  # noqa: E731
    else:
        run = buf.sum
    run()  # fault the pages in
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        run()
        best = max(best, buf.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def _sizes(config, weight_bytes: int, kv_bytes: int) -> tuple[float, float, float, float]:
    h, i = config.hidden_size, config.intermediate_size
    qkvo = h * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    layer_params = config.num_layers * (qkvo + 3 * h * i)
    head_params = h * config.vocab_size
    all_weight_bytes = (layer_params + head_params) * weight_bytes
    kv_per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * kv_bytes
    return layer_params, head_params, all_weight_bytes, kv_per_token


def roofline_seconds(
    config,
    lengths: list[tuple[int, int]],
    read_gbs: float,
    gemm_gflops: float,
    weight_bytes: int = 2,
    kv_bytes: int = 2,
) -> dict[str, float]:
    """Lower-bound seconds of prefill and decode for requests ``(input_len, output_len)`` (module docstring)."""
    if read_gbs <= 0 or gemm_gflops <= 0:
        raise ValueError(f"read_gbs / gemm_gflops: must be > 0, got {read_gbs} / {gemm_gflops}")
    layer_params, head_params, all_weight_bytes, kv_per_token = _sizes(config, weight_bytes, kv_bytes)
    attn = 2 * config.head_dim * config.num_heads * config.num_layers  # per (query, key) pair: QK^T + PV
    bw, rate = read_gbs * 1e9, gemm_gflops * 1e9
    prefill_flops = sum(
        2 * layer_params * n + 2 * head_params + attn * n * n for n, _ in lengths
    )  # causal: n^2 / 2 pairs, 2 FLOPs each per matmul
    prefill_s = max(prefill_flops / rate, all_weight_bytes / bw)
    decode_s = 0.0
    for j in range(1, max((o for _, o in lengths), default=0)):
        live = [n + j for n, o in lengths if o > j]
        if not live:
            break
        step_bytes = all_weight_bytes + sum(live) * kv_per_token
        step_flops = len(live) * 2 * (layer_params + head_params) + 2 * attn * sum(live)
        decode_s += max(step_bytes / bw, step_flops / rate)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "total_s": prefill_s + decode_s}
