"""A small native kernel for CPU decode attention straight over the paged KV cache.

PyTorch has no paged attention on the CPU: the portable path gathers every sequence's blocks into
a contiguous copy and then runs ``scaled_dot_product_attention`` — the copy costs about as much as
the attention. This C kernel reads each sequence's K/V blocks in place through the block table,
once per KV head for the whole GQA group, with an online softmax (one pass, no score matrix).

Decode attention is memory-bound, so the kernel is written to keep the memory system busy: the
group's queries and output accumulators stay in vector registers (the kernel is compiled for
one (GQA group, head dim) shape at a time), 16 keys' dot products are reduced together by a
transpose-and-add tree, the exponentials are a vectorised polynomial, and the next block of K
and V (blocks are scattered, so the hardware prefetcher stops at each) is prefetched into L2
while the current one is used. On the 2-core development machine it reads the cache at about
9 GB/s on one thread (a plain single-thread read of memory runs at 10-11 GB/s), 3x the
previous kernel.

Where the CPU has AMX-BF16 and both the queries and the cache are bfloat16 (a bf16 model), the
scores come from AMX tile products read straight from the cache rows and each thread runs its
sequences as one pipeline (the next window of keys prefetched and scored while this one is
weighted): ``kvbalance/native/decode_attention_amx.c``. The portable kernel stays the path everywhere else,
and ``KVBALANCE_NATIVE_AMX=0`` (or ``amx=False``) keeps it on an AMX machine too.

It is compiled with the system C compiler on first use for each shape (~2 CPU seconds, cached; see
:mod:`kvbalance.model.cbuild`) and loaded with ctypes; where no compiler is available (it needs GCC >= 12
or Clang for ``__builtin_shufflevector``) or the build fails (one warning is logged), or
``KVBALANCE_NATIVE=0``, callers fall back to the PyTorch path. The cache is float32 or bfloat16 (a
bf16 cache is widened to float32 in registers as it is read: half the bytes, the same float32
arithmetic); the head dim must be a multiple of 16. The C source is ``kvbalance/native/decode_attention.c``
(the portable kernel and the entry points) with ``decode_attention_amx.c``, ``decode_attention_avx2.c``
and the shared ``decode_attention.h``.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from kvbalance.model import cbuild

SOURCES = ("decode_attention.c", "decode_attention_amx.c", "decode_attention_avx2.c")
FALLBACK = "PyTorch's attention over a gathered copy of the cache"
_AMX_FLAGS = ("-DHAVE_AMX=1", "-mamx-tile", "-mamx-bf16")

MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 16, 256, 256
_FLAGS = (*cbuild.DEFAULT_FLAGS, "-ffp-contract=fast")
_lock = threading.Lock()
_libs: dict[tuple[int, int, bool, bool], ctypes.CDLL | None] = {}
KV_DTYPES = (torch.float32, torch.bfloat16)


def build_flags(group: int, head_dim: int, kv_bf16: bool, io_bf16: bool, amx: bool) -> tuple[str, ...]:
    """The compiler flags of the library for one shape: the AMX path compiled in where ``amx``."""
    shape = (
        f"-DGROUP={group}",
        f"-DNVEC={head_dim // 16}",
        f"-DKV_BF16={int(kv_bf16)}",
        f"-DIO_BF16={int(io_bf16)}",
    )
    return (*_FLAGS, *shape, *(_AMX_FLAGS if amx else ("-DHAVE_AMX=0",)))


def _build(group: int, head_dim: int, kv_bf16: bool, io_bf16: bool) -> ctypes.CDLL | None:
    kind = "".join("b" if x else "f" for x in (kv_bf16, io_bf16))
    name = f"paged_attention_g{group}_d{head_dim}_{kind}"
    out = None
    # the AMX path where the CPU has AMX (the build then also holds the portable kernel); else without it
    if kv_bf16 and io_bf16 and cbuild.cpu_has("amx_bf16", "avx512f"):
        flags = build_flags(group, head_dim, kv_bf16, io_bf16, amx=True)
        out = cbuild.build(name + "_amx", SOURCES, flags, "the portable kernel", remember_failure=True)
    if out is None:
        out = cbuild.build(name, SOURCES, build_flags(group, head_dim, kv_bf16, io_bf16, amx=False), FALLBACK)
    if out is None:
        return None
    lib = ctypes.CDLL(str(out))
    fn = lib.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr] * 6 + [i64] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn.restype = None
    lib.write_kv.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64]
    lib.write_kv.restype = None
    lib.amx_available.restype = ctypes.c_int
    lib.amx = bool(
        lib.amx_available()
    )  # compiled in for this shape, cpuid says AMX-BF16, the OS granted tiles
    lib.attention_avx2.restype = ctypes.c_int
    lib.avx2 = bool(lib.attention_avx2())  # built for AVX2 without AVX-512: decode_attention_avx2.c's kernel
    return lib


def native_library(
    group: int = 1,
    head_dim: int = 64,
    kv_dtype: torch.dtype = torch.float32,
    io_dtype: torch.dtype = torch.float32,
) -> ctypes.CDLL | None:
    """The kernel compiled for this (GQA group, head dim, cache dtype, query/output dtype), or None where
    it is disabled or cannot be built."""
    if kv_dtype not in KV_DTYPES or io_dtype not in KV_DTYPES:
        return None
    key = (int(group), int(head_dim), kv_dtype == torch.bfloat16, io_dtype == torch.bfloat16)
    if key in _libs:
        return _libs[key]
    with _lock:
        if key not in _libs:
            lib = None
            if cbuild.native_enabled() and _supported_shape(*key[:2]):
                try:
                    lib = _build(*key)
                except OSError:
                    lib = None
            _libs[key] = lib
    return _libs[key]


def _supported_shape(group: int, head_dim: int) -> bool:
    return 1 <= group <= MAX_GROUP and 16 <= head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0


def can_use(q: torch.Tensor, k_cache: torch.Tensor, group: int) -> bool:
    kvh, _, bs, hd = k_cache.shape
    return (
        q.device.type == "cpu"
        and q.dtype in KV_DTYPES
        and k_cache.dtype in KV_DTYPES
        and k_cache.is_contiguous()
        and bs <= MAX_BLOCK_SIZE
        and _supported_shape(group, hd)
        and native_library(group, hd, k_cache.dtype, q.dtype) is not None
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    amx: bool | None = None,
) -> torch.Tensor:
    """``q`` [B, kv_heads, group, head_dim] -> attention output of the same shape and dtype.

    ``k_cache``/``v_cache`` are head-major ``[kv_heads, num_blocks, block_size, head_dim]``, float32 or
    bfloat16 (widened to float32 as they are read); ``block_table`` [B, max_blocks] int64;
    ``context_lens`` [B] int64 (keys each query attends, >= 1). Queries, scores, softmax and the
    weighted sum are float32 whatever the dtypes; a bfloat16 ``q`` gets a bfloat16 output (rounded to
    nearest even once, at the end).
    """
    b, kvh, g, d = q.shape
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"v_cache: dtype {v_cache.dtype} differs from k_cache's {k_cache.dtype}")
    lib = native_library(g, d, k_cache.dtype, q.dtype)
    assert lib is not None
    use_amx = has_amx(g, d) if amx is None else amx and lib.amx
    q = q.contiguous()
    table = block_table.contiguous()
    ctx = context_lens.contiguous()
    nb, bs = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    lib.paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        table.data_ptr(),
        ctx.data_ptr(),
        out.data_ptr(),
        b,
        kvh,
        nb,
        bs,
        table.shape[1],
        float(scale),
        torch.get_num_threads(),
        int(use_amx),
    )
    return out


def has_amx(group: int = 3, head_dim: int = 64) -> bool:
    """Whether the AMX score path runs here for bf16 queries and cache of this shape (the CPU has
    AMX-BF16, the compiler knows it, and ``KVBALANCE_NATIVE_AMX`` is not ``0``)."""
    lib = native_library(group, head_dim, torch.bfloat16, torch.bfloat16)
    return lib is not None and lib.amx and os.environ.get("KVBALANCE_NATIVE_AMX", "1") != "0"


def can_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`write_kv` takes these: CPU, new K/V already in the cache's dtype, heads contiguous."""
    kvh, _, _, hd = k_cache.shape
    return (
        k.device.type == "cpu"
        and k.dtype == v.dtype == k_cache.dtype
        and k.stride()[1:] == v.stride()[1:] == (hd, 1)
        and k_cache.is_contiguous()
        and native_library(1, hd, k_cache.dtype) is not None
    )


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """``k``/``v`` [T, kv_heads, head_dim] into cache slots ``slots`` [T] (block * block_size + offset)
    of head-major ``[kv_heads, num_blocks, block_size, head_dim]`` caches: one C loop of row copies in
    place of two ``index_copy_`` calls (each ~0.2 ms for a 64-token step)."""
    kvh, nb, bs, hd = k_cache.shape
    lib = native_library(1, hd, k_cache.dtype)
    slots = slots.contiguous()
    lib.write_kv(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        k.shape[0],
        kvh,
        nb * bs,
    )
