"""A float32 GEMM for CPUs with AVX2 and FMA but no AVX-512: ``y = x @ W^T (+ bias)`` over a packed weight.

On such CPUs (AMD Zen 2/3, older Intel) torch's float32 linears go through MKL, whose kernels there reach
well under the core's FMA peak at the shapes of an LLM's decode step. Measured on the AMD EPYC (Zen 3)
development machine, one thread, SmolLM2-135M's shapes at 64 rows (``benchmarks/bench_gemm.py avx2``):
MKL's packed GEMM 44-77 GFLOP/s (the tied LM head 29-47), this kernel 71-83 (the LM head 53-70), against
a peak of ~82 measured with everything in L1.

- **Layout**: the weight ``[N, K]`` is packed once into panels of 16 output columns, each ``[K][16]``
  contiguous (the last panel zero-padded), so a panel streams in order and every K step of the micro-kernel
  reads one 64-byte line of it.
- **Micro-kernel**: 6 rows x 16 columns of float32 accumulators (12 of the 16 ymm registers); each K step
  loads the panel's two vectors, broadcasts one activation per row and issues 12 FMAs.
- **Blocking**: K in even slices of at most 384 (a panel slice of <= 24 KiB stays in L1 while every row
  block of the call passes over it); rows in blocks of 96 (their activation slice stays in L2). While the
  row blocks run over one panel slice, the next slice is prefetched into L1, spread across them and
  evenly over each one's K loop (bursts of prefetches measured up to 1.15x slower at 16-48 rows).
- **Threads**: the panels are split evenly among torch's intra-op threads (the same OpenMP runtime); each
  thread owns its output columns, so no two threads write the same line.

Numerics: each output sums its K products in order within each K slice (FMA, float32), then the slices in
order, then the bias: the same bits whatever the row count, the row's place in the batch and the thread
count (batch-invariant), within float32 rounding of MKL (which orders sums differently).

Runs where the CPU has AVX2 and FMA (cpuid) and the C compiler builds it; :func:`preferred` says whether
:mod:`kvbalance.model.packed` takes it over MKL: on CPUs without AVX-512F (where MKL has its AVX-512
kernels) unless ``KVBALANCE_NATIVE_GEMM`` says ``0`` (never) or ``1`` (wherever it runs).
"""

from __future__ import annotations

import torch

from kvbalance.model import cbuild, panel_gemm

PANEL = 16  # output columns per packed panel

SOURCES = ("avx2_gemm.c",)
# without -funroll-loops: unrolling the K loop on top of the 12 FMAs per step measured 30-40% slower
FLAGS = (*(f for f in cbuild.DEFAULT_FLAGS if f != "-funroll-loops"), "-mavx2", "-mfma")


def packed_size(n: int, k: int) -> int:
    return (n + PANEL - 1) // PANEL * k * PANEL


_KERNEL = panel_gemm.PanelGemm(
    "avx2_gemm",
    SOURCES,
    FLAGS,
    ("avx2", "fma"),
    "MKL's float32 GEMM",
    torch.float32,
    packed_size,
    "avx2_panels",
    "cpu_avx512",
)


def available() -> bool:
    """Whether the kernel runs here: the CPU has AVX2 and FMA, native kernels are on and it builds."""
    return _KERNEL.available()


def preferred() -> bool:
    """Whether float32 linears take this kernel over MKL here (see the module docstring)."""
    return _KERNEL.preferred()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] float32 -> the packed panels (1-D, :func:`packed_size` values)."""
    return _KERNEL.pack(weight)


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] @ W^T (+ ``bias`` [N]) -> [..., N] float32, ``packed`` from :func:`pack` of W [N, K]."""
    return _KERNEL.linear(x, packed, n, bias)
