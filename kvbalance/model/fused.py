"""Fused element-wise CPU kernels for the bfloat16 (and float32) model: RMSNorm (plain, and fused with the residual
add), SiLU-and-mul and RoPE, each one pass over its rows in C.

PyTorch runs each as several passes over bf16 activations (its bf16 RMSNorm is ~8 ops, RoPE ~10): a
decode step of SmolLM2 paid ~600 small ops. vLLM fuses the same ops (``fused_add_rms_norm``,
``silu_and_mul``, ``rotary_embedding``). Measured here on one thread (64 / 2,048 rows of SmolLM2's
shapes, torch -> fused, us): RMSNorm 60 -> 25 / 2,080 -> 405, add + RMSNorm 57 -> 26 / 2,575 -> 632,
SiLU-and-mul 103 -> 100 / 3,384 -> 2,343 (exp-bound), RoPE 83 -> 16 / 2,465 -> 565. Arithmetic is
float32 inside (bf16 widened exactly), rounded to bf16 to nearest even as torch does:

- :func:`add_rms_norm`: ``h += delta`` in place (rounded once, bit-identical to torch's bf16 add), then
  ``normed = h * rsqrt(mean(h^2) + eps) * weight`` from the rounded ``h``, rounded once (torch's bf16
  ``F.rms_norm`` does the same float32 maths; only the order of the sum of squares differs, so results
  are within one bf16 ulp). :func:`rms_norm` is the same row function without the add, so the fused and
  the unfused orders give identical bits.
- :func:`silu_and_mul`: ``silu(gate) * up`` over the fused gate/up rows ``[T, 2I] -> [T, I]``, rounded
  once. Torch's bf16 ``F.silu(gate) * up`` rounds silu to bf16 before the product; the two are within
  one bf16 ulp (rounding silu first moves the product by at most half an ulp), and this one is the
  closer to float32. Against the float32 composition rounded once it differs only where its polynomial
  exp (~2e-7 relative) tips a rounding.
- :func:`rope_`: rotate-half RoPE (HF layout) in place over the leading heads of each row (the q and k
  heads of the fused QKV output), with bf16 cos/sin tables: the float32 maths of
  :func:`kvbalance.model.llama.apply_rope` on the widened inputs in the same op order, rounded once
  (bit-identical to it). The tables are bf16 as HF's bf16 model rounds them: float32 tables (more
  accurate, no faster: 1.1 ms per decode step either way) flipped a near-tied greedy token of the real
  SmolLM2 against transformers (the slow test in tests/test_bf16.py).

The same source built with ``-DELEM_F32=1`` serves float32 rows (:func:`library` per dtype; the float32
model on the CPU takes it): the residual add is exact, RMSNorm within a few float32 ulps of ``F.rms_norm``
(its sum of squares is ordered differently), SiLU-and-mul within its exp's ~2e-7, RoPE bit-identical to
``apply_rope``. On the AVX2 development machine (Zen 3) a decode step of 64 sequences spent ~45 ms in
torch's float32 element-wise ops (``F.rms_norm`` alone ~290 us a call at 64 x 576); with these, the torch ops
left take ~5 ms (torch.profiler; the kernels' own time is not in that figure: one pass over the rows each).

The C source is ``kvbalance/native/fused.c``, compiled on first use (:mod:`kvbalance.model.cbuild`); where
it is unavailable (no compiler or a failed build, each logged once as a warning, or ``KVBALANCE_NATIVE=0``)
:func:`library` is None and the model runs its PyTorch code.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from kvbalance.model import cbuild

# -ffp-contract=off: no fused multiply-adds, so each kernel rounds where torch's float32 composition does
FLAGS = (*cbuild.DEFAULT_FLAGS, "-ffp-contract=off")
DTYPES = (torch.bfloat16, torch.float32)
SOURCES = ("fused.c",)
FALLBACK = "PyTorch's element-wise ops (RMSNorm, SiLU, RoPE, argmax)"
_libs: dict[torch.dtype, ctypes.CDLL | None] = {}
_lock = threading.Lock()


def build_flags(dtype: torch.dtype) -> tuple[str, ...]:
    """The compiler flags of the library for rows of ``dtype`` (bfloat16, or float32: ``-DELEM_F32=1``)."""
    return (*FLAGS, "-DELEM_F32=1") if dtype == torch.float32 else FLAGS


def _load(name: str, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    lib = cbuild.load(name, SOURCES, flags, FALLBACK)
    if lib is None:
        return None
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    signatures = {
        "rms_norm": [ptr, i64, ptr, ptr, i64, i64, i64, f32, i32],
        "add_rms_norm": [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, f32, i32],
        "silu_and_mul": [ptr, i64, ptr, i64, i64, i64, i32],
        "rope": [ptr, i64, i64, i64, i64, ptr, ptr, i64, i32],
        "argmax_rows": [ptr, i64, i64, i64, ptr, i32],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    return lib


def library(dtype: torch.dtype = torch.bfloat16) -> ctypes.CDLL | None:
    """The kernels compiled for rows of ``dtype`` (bfloat16 or float32), or None where they are disabled
    or cannot be built (decided once per dtype)."""
    if dtype not in _libs:
        with _lock:
            if dtype not in _libs:
                name = "fused_f32" if dtype == torch.float32 else "fused"
                _libs[dtype] = _load(name, build_flags(dtype))
    return _libs[dtype]


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels run on ``x``'s kind of tensor: bfloat16 or float32 on the CPU, with the library
    built, and no autograd recording (inference; the C kernels record no gradients)."""
    return x.dtype in DTYPES and x.is_cpu and not torch.is_grad_enabled() and library(x.dtype) is not None


def _rows(x: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> tuple[int, int]:
    ok = x.dtype == dtype if dtype is not None else x.dtype in DTYPES
    if not ok or not x.is_cpu or x.dim() != 2 or x.stride(1) != 1:
        want = "bfloat16 or float32" if dtype is None else str(dtype).removeprefix("torch.")
        raise ValueError(
            f"{name}: expected a 2-D CPU {want} tensor with contiguous rows, got {x.dtype} "
            f"{tuple(x.shape)} strides {x.stride()} on {x.device}"
        )
    return x.shape[0], x.shape[1]


def _weight(w: torch.Tensor, n: int, dtype: torch.dtype) -> None:
    if w.shape != (n,) or w.dtype != dtype or not w.is_contiguous():
        raise ValueError(f"weight: expected a contiguous {dtype} [{n}], got {w.dtype} {tuple(w.shape)}")


def _out(out: torch.Tensor | None, t: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(t, n, dtype=dtype)
    if _rows(out, "out", dtype) != (t, n):
        raise ValueError(f"out: expected shape {(t, n)}, got {tuple(out.shape)}")
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` [T, N] times ``weight`` [N] (into ``out`` if given)."""
    t, n = _rows(x, "x")
    _weight(weight, n, x.dtype)
    out = _out(out, t, n, x.dtype)
    if t:
        library(x.dtype).rms_norm(
            x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0), t, n, eps,
            torch.get_num_threads(),
        )  # fmt: skip
    return out


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``h += delta`` in place (the residual stream), then RMSNorm of the new ``h`` times ``weight``."""
    t, n = _rows(h, "h")
    if _rows(delta, "delta", h.dtype) != (t, n):
        raise ValueError(f"delta: expected shape {(t, n)} (as h), got {tuple(delta.shape)}")
    _weight(weight, n, h.dtype)
    out = _out(out, t, n, h.dtype)
    if t:
        library(h.dtype).add_rms_norm(
            h.data_ptr(), h.stride(0), delta.data_ptr(), delta.stride(0), weight.data_ptr(), out.data_ptr(),
            out.stride(0), t, n, eps, torch.get_num_threads(),
        )  # fmt: skip
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [T, 2I] (gate the first I columns) -> [T, I]."""
    t, n = _rows(gate_up, "gate_up")
    if n % 2:
        raise ValueError(f"gate_up: expected an even number of columns (gate, up), got {n}")
    out = torch.empty(t, n // 2, dtype=gate_up.dtype)
    if t:
        library(gate_up.dtype).silu_and_mul(
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), t, n // 2,
            torch.get_num_threads(),
        )  # fmt: skip
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """Rotate-half RoPE in place over the first ``num_heads`` heads of ``head_dim`` in each row of ``x``
    [T, >= num_heads * head_dim]; ``cos``/``sin`` [T, head_dim / 2] bfloat16 with contiguous rows."""
    t, n = _rows(x, "x")
    if head_dim % 2 or num_heads * head_dim > n:
        raise ValueError(f"num_heads: {num_heads} heads of {head_dim} do not fit a row of {n}")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.dtype != x.dtype or c.shape != (t, head_dim // 2) or c.stride(1) != 1:
            raise ValueError(
                f"{name}: expected {x.dtype} [{t}, {head_dim // 2}], got {c.dtype} {tuple(c.shape)}"
            )
    if cos.stride(0) != sin.stride(0):
        raise ValueError(f"sin: row stride {sin.stride(0)} differs from cos's {cos.stride(0)}")
    if t:
        library(x.dtype).rope(
            x.data_ptr(), x.stride(0), t, num_heads, head_dim, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
            torch.get_num_threads(),
        )  # fmt: skip


def argmax_rows(x: torch.Tensor) -> list[int]:
    """The first index of each row's maximum of ``x`` [T, N] (a NaN counts as the maximum), as
    ``torch.argmax(x, -1)``: the greedy token of a bf16 model's logits without a float32 copy."""
    t, n = _rows(x, "x")
    if n == 0:
        raise ValueError("x: rows are empty (no maximum)")
    out = torch.empty(t, dtype=torch.int64)
    if t:
        library(x.dtype).argmax_rows(x.data_ptr(), x.stride(0), t, n, out.data_ptr(), torch.get_num_threads())
    return out.tolist()
