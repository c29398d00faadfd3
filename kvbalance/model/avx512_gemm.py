"""A bfloat16 GEMM for CPUs with AVX512-BF16 but no AMX: ``y = x @ W^T (+ bias)`` over a packed weight.

On such CPUs (AMD Zen 4/5) torch's bf16 linears go through oneDNN's AVX512-BF16 kernels. Measured on the
AMD EPYC (Zen 4) development machine, one thread, SmolLM2-135M's decode-step linears with cold weights
(``benchmarks/bench_gemm.py layers``, column ``AVX512``): oneDNN on its pre-packed weight 173-191 GFLOP/s
at 51-64 rows, this kernel 196-211 (1.05-1.10x; the LM head 1.10-1.12x), 1.2-1.3x at 1-12 rows (memory
bound), a tie at 512; ~231 GFLOP/s of ``vdpbf16ps`` with everything in registers.

- **Layout**: the weight ``[N, K]`` is packed once into panels of 32 output columns, each ``[K/2][32][2]``
  (pairs of consecutive K values of a column side by side: the operand order of ``vdpbf16ps``), the last
  panel zero-padded (and K, if odd), so a panel streams in order, two 64-byte lines per K pair.
- **Micro-kernel**: 12 rows x 32 columns of float32 accumulators (24 of the 32 zmm registers); each K
  pair loads the panel's two vectors and meets each row's broadcast pair of activations in 24
  ``vdpbf16ps`` (two bf16 x bf16 products, exact in float32, added to the float32 accumulator).
- **Blocking**: no K slicing: a panel (K/2 x 128 bytes: 36 KiB at K = 576, 96 KiB at 1,536) stays in L2
  while every row block of the call passes over it, and the next panel is prefetched into L2 meanwhile,
  spread over the row blocks; rows in blocks of ``MC`` (their activations stay in L2).
- **Threads**: the panels are split evenly among torch's intra-op threads; each owns its output columns.

Numerics: each output sums its K pairs in order (float32), adds the bias and is rounded to bf16 once
(round to nearest even): the same bits whatever the row count, the row's place and the thread count
(batch-invariant), within a bf16 rounding of oneDNN's (which orders sums differently).

Runs where the CPU has AVX-512F and AVX512-BF16 (cpuid) and the C compiler builds it; :func:`preferred`
says whether :mod:`kvbalance.model.packed` takes it over oneDNN: on CPUs without AMX (where oneDNN and
:mod:`kvbalance.model.amx_gemm` have the tile unit), unless ``KVBALANCE_NATIVE_GEMM`` says ``0`` (never)
or ``1`` (wherever it runs).
"""

from __future__ import annotations

import torch

from kvbalance.model import cbuild, panel_gemm

PANEL = 32  # output columns per packed panel

SOURCES = ("avx512_gemm.c",)
# without -funroll-loops (as avx2_gemm: unrolling the K loop on top of the unrolled rows measured slower);
# the instructions it needs whatever -march=native says (cpu_ok() checks the CPU before it runs)
FLAGS = (
    *(f for f in cbuild.DEFAULT_FLAGS if f != "-funroll-loops"),
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
)


def packed_size(n: int, k: int) -> int:
    return (n + PANEL - 1) // PANEL * ((k + 1) // 2) * 2 * PANEL


_KERNEL = panel_gemm.PanelGemm(
    "avx512_gemm",
    SOURCES,
    FLAGS,
    ("avx512f", "avx512_bf16"),
    "oneDNN's bf16 matmul",
    torch.bfloat16,
    packed_size,
    "avx512_panels",
    "cpu_amx",
)


def available() -> bool:
    """Whether the kernel runs here: the CPU has AVX512-BF16, native kernels are on and it builds."""
    return _KERNEL.available()


def preferred() -> bool:
    """Whether bf16 linears take this kernel over oneDNN here (see the module docstring)."""
    return _KERNEL.preferred()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] bfloat16 -> the packed panels (1-D, :func:`packed_size` values)."""
    return _KERNEL.pack(weight)


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] @ W^T (+ ``bias`` [N]) -> [..., N] bfloat16, ``packed`` from :func:`pack` of W [N, K]."""
    return _KERNEL.linear(x, packed, n, bias)
