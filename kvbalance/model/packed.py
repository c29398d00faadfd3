"""Matmuls through pre-packed weights on the CPU: MKL's packed GEMM (float32; on CPUs with AVX2 but no
AVX-512 the AVX2 kernel of :mod:`kvbalance.model.avx2_gemm` over its own panels instead) and oneDNN's
blocked layout (bfloat16 on CPUs with native bf16 dot products; on those without AMX, e.g. AMD Zen 4, the
AVX512-BF16 kernel of :mod:`kvbalance.model.avx512_gemm` over its own panels instead). :func:`linear` is
``layer(x)`` through the layer's packed copy where ``LlamaModel.pack_weights_for_cpu`` made one.

bfloat16 calls of at most :data:`AMX_MAX_ROWS` rows (a decode step's linears and its LM head at up to
64 sequences) run the AMX kernel of :mod:`kvbalance.model.amx_gemm` instead, where it runs: it
streams the plain weight (no second packed copy) and reaches the memory rate these memory-bound shapes
need; larger calls (prefill) and every call it cannot take (grad mode, another dtype, K not a multiple of 32,
``KVBALANCE_NATIVE_AMX=0``) stay on oneDNN's packed weight.
"""

from __future__ import annotations

import torch
from torch import nn

from kvbalance.model import amx_gemm, avx2_gemm, avx512_gemm

PACK_ROWS_HINT = 64  # rows MKL tunes its packed weight layout for (a decode batch)
# Most rows a bf16 call runs through the AMX kernel. Measured on one shared core (benchmarks/bench_gemm.py
# layers, 30 cold layers of SmolLM2 + LM head, best of 7, four runs): 1.3-1.8x oneDNN at 32 rows;
# the layers 1.02-1.19x from 40 to 56 rows and 0.88-1.13x at 64, the LM head 0.9-1.5x there; a tie at
# 80-96, behind at 128 (0.8-0.9x). Up to 32 rows the two give the same bits; above, results are within
# an ulp of oneDNN's (which orders a few sums differently) and equal oneDNN's on each 32-row slice.
AMX_MAX_ROWS = 64


def _can_pack(w: torch.Tensor) -> bool:
    if w.device.type != "cpu":
        return False
    if w.dtype == torch.float32:
        return avx2_gemm.preferred() or (
            torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
        )
    return w.dtype == torch.bfloat16 and native_bf16_matmul()


def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX, through oneDNN)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def _pack(w: torch.Tensor) -> torch.Tensor:
    # The packed layouts (MKL's for float32, oneDNN's blocked one for bfloat16) depend on the weight's
    # shape only (the row count is a hint): one copy serves every batch size, and results equal the
    # unpacked GEMM's.
    if w.dtype == torch.float32:
        if avx2_gemm.preferred():
            return avx2_gemm.pack(w)
        return torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), PACK_ROWS_HINT)
    if avx512_gemm.preferred():
        return avx512_gemm.pack(w)
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS_HINT)


def _grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether autograd records this call (the native kernels do not take part in it)."""
    return torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )


def _amx_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        0 < rows <= AMX_MAX_ROWS
        and not _grad(x, weight, bias)
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and (bias is None or bias.dtype == torch.bfloat16)
        and amx_gemm.supports(weight)
        and amx_gemm.available()
    )


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # each packed copy runs the GEMM whose layout it holds, whatever the environment says now
    if getattr(packed, "avx512_panels", False):  # packed by avx512_gemm: checked first (no env lookups)
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or _grad(x, weight, bias):
            return torch.nn.functional.linear(x, weight, bias)
        return avx512_gemm.linear(x, packed, weight.shape[0], bias)
    if weight.dtype == torch.bfloat16 and _amx_takes(x, weight, bias):
        return amx_gemm.linear(x, weight, bias)  # few rows: the AMX kernel on the plain weight
    if weight.dtype == torch.float32:
        if getattr(packed, "avx2_panels", False):  # packed by avx2_gemm (see _pack)
            if x.dtype != torch.float32 or x.device.type != "cpu" or _grad(x, weight, bias):
                return torch.nn.functional.linear(x, weight, bias)
            return avx2_gemm.linear(x, packed, weight.shape[0], bias)
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.numel() // x.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _version(w: torch.Tensor) -> int | None:
    return None if w.is_inference() else w._version  # inference tensors keep no version counter


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(x)``, through pre-packed weights where :meth:`LlamaModel.pack_weights_for_cpu` made them.

    float32: MKL's packed GEMM; a decode step's few rows reached ~110 GFLOP/s with the plain weight on
    the earlier (AVX-512) development CPU and ~140 packed (the weight panels are laid out once instead of
    at every call). On AVX2-only CPUs the AVX2 kernel over its own panels (:mod:`avx2_gemm`).
    bfloat16: oneDNN's AMX matmul (bf16 products, float32 accumulation, one rounding of the output),
    ~250-330 GFLOP/s on one thread at 64 rows with the weight pre-blocked, ~190-250 without. A weight
    changed in place since it was packed (its version counter moved) is packed again.
    """
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        return layer(x)
    version = _version(layer.weight)
    if version != getattr(layer, "packed_version", None):
        packed = layer.packed_weight = _pack(layer.weight)
        layer.packed_version = version
    return _packed_linear(x, packed, layer.weight, layer.bias)
