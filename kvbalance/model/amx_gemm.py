"""An AMX bf16 GEMM for the decode step's linears: ``y = x @ W^T (+ bias)``, bf16 in, float32 tile
accumulation, the output rounded once to bf16 (nearest even). :mod:`kvbalance.model.packed` calls it
for calls of few rows (a decode step's batch).

These shapes are memory-bound (each weight read once per step for a few dozen rows); oneDNN's AMX
matmul on one thread streams SmolLM2's weights at ~7-8 GB/s. This kernel streams the **plain**
row-major weight (no packed copy) at 9-13 GB/s up to 32 rows and ~7.5-8.5 GB/s at 64:

- **Transposed product** ``y^T = W x^T``: A tiles are 16 rows of W x 32 K, loaded in place with the
  row stride; B tiles are the activations in VNNI pairs ``(x[m][2p], x[m][2p + 1])``, packed at each
  call into contiguous 16 x 16-word tiles (one tile load reads 16 adjacent lines).
- **Blocking**: C^T is 2 x 2 tiles of 16 x 16 float32 (32 weight rows x 32 activation rows, tmm0-3),
  two W tiles (tmm4, 5), two x tiles (tmm6, 7). W goes through in contiguous blocks of 32 rows, each
  meeting the activations 32 rows at a time while it sits in L1/L2 (above 32 rows the activations'
  tile loads hint T1, so the block keeps L1 for its next pass); the next block is prefetched into L2.
- **Epilogue**: C^T tiles go to a float32 buffer; bias (widened bf16) added in float32, each 16 x 16
  block transposed in registers and rounded once (``vcvtneps2bf16``), two blocks after each of the
  next chunk's first K steps, while its tile products are in flight.

Numerics: K is summed in order in the tile accumulator, pair by pair (``tdpbf16ps``): bit-identical
to oneDNN's AMX kernel for calls of up to 32 rows (so to oneDNN on each 32-row slice of any call) and
within an ulp of its kernel for more rows (which orders a few sums differently).

The C source is ``kvbalance/native/amx_gemm.c``. K must be a multiple of 32 (:func:`supports`; callers
keep oneDNN otherwise); W and activation rows past N and M are zero-padded copies. The tile configuration is loaded at every call (oneDNN and the
attention kernel configure tiles their own way on the same thread) and released after. Runs where the
CPU has AMX-BF16 and the process was granted tile data (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XTILEDATA)``), the compiler knows AMX, and ``KVBALANCE_NATIVE_AMX`` / ``KVBALANCE_NATIVE`` are not 0.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from kvbalance.model import cbuild

SOURCES = ("amx_gemm.c",)
FALLBACK = "oneDNN's bf16 matmul"
# the instructions it needs, whatever -march=native says (amx_available() checks the CPU before it runs)
FLAGS = (
    *cbuild.DEFAULT_FLAGS,
    "-mamx-tile",
    "-mamx-bf16",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
)
K_STEP = 32  # K per tile product (16 pairs)
_lock = threading.Lock()
_lib: list[ctypes.CDLL | None] = []


def _library() -> ctypes.CDLL | None:
    """The compiled kernel where it can run here (compiler, CPU and OS permission), else None."""
    if _lib:
        return _lib[0]
    with _lock:
        if not _lib:
            lib = None
            # built only where the CPU has AMX: elsewhere it could never run
            cpu = cbuild.cpu_has("amx_bf16", "avx512_bf16")
            out = cbuild.build("amx_gemm", SOURCES, FLAGS, FALLBACK, remember_failure=True) if cpu else None
            if out is not None:
                try:
                    lib = ctypes.CDLL(str(out))
                    lib.amx_available.restype = ctypes.c_int
                    fn = lib.amx_linear
                    fn.argtypes = [
                        ctypes.c_void_p,
                        ctypes.c_int64,
                        *[ctypes.c_void_p] * 3,
                        *[ctypes.c_int64] * 4,
                        ctypes.c_int,
                    ]
                    fn.restype = ctypes.c_int
                    if not lib.amx_available():
                        lib = None
                except OSError:
                    lib = None
            _lib.append(lib)
    return _lib[0]


def available() -> bool:
    """Whether the kernel runs here (and is not switched off by ``KVBALANCE_NATIVE_AMX=0``)."""
    return (
        os.environ.get("KVBALANCE_NATIVE_AMX", "1") != "0"
        and cbuild.native_enabled()
        and _library() is not None
    )


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight: [N, K] bf16 on the CPU, contiguous, K a multiple of 32."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[1] % K_STEP == 0
        and weight.is_contiguous()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` for ``x`` [..., K] bf16 through the AMX kernel (rows with a stride are
    read in place; a last dim with a stride is copied first); the caller checks :func:`available`."""
    if not supports(weight):
        raise ValueError(
            f"weight: [N, K] contiguous bf16 with K % {K_STEP} == 0 required, got {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: last dim {x.shape[-1]} differs from the weight's K {k}")
    if x.dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
        raise ValueError(f"x, bias: bf16 required, got {x.dtype} and {None if bias is None else bias.dtype}")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m:
        if bias is not None:
            bias = bias.contiguous()
        rc = _library().amx_linear(
            x2.data_ptr(),
            x2.stride(0),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            n,
            m,
            n,
            k,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"amx_linear failed with code {rc}")
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)
