"""Flash-attention kernels for one prefill chunk over the paged bfloat16 KV cache (CPU): AMX, and on CPUs
with AVX512-BF16 but no AMX (AMD Zen 4) the vector kernel of ``kvbalance/native/prefill_attention_avx512.c``
(same entry point; ~100-117 vs SDPA's 33-59 GFLOP/s on one Zen 4 core). The rest of this docstring is the
AMX kernel's (``kvbalance/native/prefill_attention_amx.c``).

The chunk's queries ``q`` [n, heads, 64] (bf16, rows of any stride: the view out of the fused QKV
output) at positions ``q_start .. q_start + n - 1`` attend causally to keys ``0 .. q_start + n - 1``,
read in place from the head-major cache ``[kv_heads, num_blocks, block_size, 64]`` through the
sequence's block table (the chunk's own K/V are written before attention runs), so a whole prompt
(``q_start = 0``) and a later chunk take the same path: no gathered copy, no float mask.

FlashAttention-2 (Dao 2023, Algorithm 1) on AMX tiles. One unit is 16 queries of one head; its key
blocks of 64 keys (those wholly above the diagonal skipped) run in three phases:

- scores ``S^T = K Q^T`` [16 keys x 16 queries]: the cache rows are the A tile (loaded in place with
  the row stride, as the decode kernel in ``decode_attention_amx.c`` does) and the queries,
  repacked once per unit into the VNNI pair layout, the B tile; ``tdpbf16ps`` (bf16 products exact in
  float32, float32 sums);
- online softmax in float32 with the 16 queries as the 16 vector lanes (maxima and sums need no
  horizontal reductions), in base 2 (``exp(scale s) = 2^(scale log2(e) s)``, degree-5 polynomial and
  ``vscalefps``). The running maximum is raised only where a block's maximum exceeds it by more than
  8 (FlashAttention-4's conditional rescaling): weights stay <= 2^8, exact in the final normalisation,
  and the accumulator tiles are stored, rescaled and reloaded only then (rarely after the first blocks);
- ``O^T += V^T P^T`` [64 dims x 16 queries] in four resident float32 C tiles, ``V^T`` transposed once
  per call into a scratch buffer (zero past the context). Torch's CPU flash kernel rounds the weights
  ``P`` to bf16 for this product (its ``_exp_reduce_sum_fusion_kernel`` writes them in the input dtype;
  sums stay float32); here ``P = hi + lo``, two bf16s (``hi`` the upper half of the float32, ``lo``
  the rest truncated: 2^-16 relative), and both are multiplied (24 instead of 16 tile products a block),
  so the weights are float32-accurate: rounded once, they flipped a greedy token of the real SmolLM2 at
  a 0.05 logit margin (tests/test_bf16.py); the split costs 10-15% of the time.
  The output is normalised and rounded to bf16 once.

Measured on one thread of the 2-core AMX development machine (benchmarks/bench_prefill_attention.py,
``taskset -c 1``, best of runs on a shared core; GFLOP/s counting causal FLOPs, SDPA as the engine called
it, gather and mask included): a whole prompt of 1,024 / 2,048 tokens 179 / 215 -> ~330 / ~370 GFLOP/s;
later chunks of 512 / 1,024 after 1,024 cached tokens 205 / 162 -> ~390 / ~400 GFLOP/s. The tile unit
bounds it (the exponentials cost ~20%; the scores ~30%, the weighted sums, twice the products with
the split, ~45%): the AMX peak here is ~1,100 GFLOP/s on bf16 GEMMs.

Head dim 64 only (128 would need 8 accumulator tiles of the 8), block size a multiple of 16, any GQA
group. Units are independent, so with several threads (OpenMP over units) the bits do not change.
:func:`can_use` is False (callers keep ``scaled_dot_product_attention``) without a compiler, AMX-BF16
or the kernel's permission for tile data (and no AVX512-BF16), with ``KVBALANCE_NATIVE=0``, and for
other dtypes, shapes or devices; ``KVBALANCE_NATIVE_AMX=0`` leaves the AVX-512 kernel where it runs.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from kvbalance.model import cbuild

HEAD_DIM = 64
FALLBACK = "PyTorch's scaled_dot_product_attention over a gathered copy of the cache"
AMX_SOURCES, AVX512_SOURCES = ("prefill_attention_amx.c",), ("prefill_attention_avx512.c",)
# the instructions each needs whatever -march=native says (amx_available() / avx512_bf16_available()
# check the CPU before it runs)
AMX_FLAGS = (
    *cbuild.DEFAULT_FLAGS,
    "-mamx-tile",
    "-mamx-bf16",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
)
AVX512_FLAGS = (*cbuild.DEFAULT_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}


def _cached(key: str, build) -> ctypes.CDLL | None:
    if key not in _state:
        with _lock:
            if key not in _state:
                _state[key] = build()
    return _state[key]


def amx_library() -> ctypes.CDLL | None:
    """The AMX kernel (built once, cached; ``.amx``: whether it runs here), or None where it cannot be built."""
    return _cached("amx", _build_amx)


def avx512_library() -> ctypes.CDLL | None:
    """The AVX-512 BF16 kernel (``.avx512``: whether it runs here), or None where it cannot be built."""
    return _cached("avx512", _build_avx512)


def library() -> ctypes.CDLL | None:
    """The kernel this process runs: the AMX one where it runs and ``KVBALANCE_NATIVE_AMX`` is not ``0``,
    else the AVX-512 BF16 one where the CPU has it; None where neither runs or native kernels are off."""
    if not cbuild.native_enabled():
        return None
    if os.environ.get("KVBALANCE_NATIVE_AMX", "1") != "0":
        lib = amx_library()
        if lib is not None and lib.amx:
            return lib
    lib = avx512_library()
    return lib if lib is not None and lib.avx512 else None


def _load(out) -> ctypes.CDLL | None:
    if out is None:
        return None
    try:
        lib = ctypes.CDLL(str(out))
    except OSError:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.paged_prefill_attention
    # q, q row stride, k, v, table, out, out row stride, n, q_start, heads, kv heads, blocks, block size
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, *[i64] * 7, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def _build_amx() -> ctypes.CDLL | None:
    if not cbuild.cpu_has("amx_bf16", "avx512_bf16"):  # elsewhere it could never run
        return None
    fallback = "the AVX512-BF16 kernel or " + FALLBACK
    lib = _load(cbuild.build("paged_prefill_amx", AMX_SOURCES, AMX_FLAGS, fallback, remember_failure=True))
    if lib is not None:
        lib.amx_available.restype = ctypes.c_int
        lib.amx = bool(lib.amx_available())  # cpuid says AMX-BF16 and the OS granted tile data
        lib.avx512 = False
    return lib


def _build_avx512() -> ctypes.CDLL | None:
    if not cbuild.cpu_has("avx512f", "avx512_bf16"):  # elsewhere it could never run
        return None
    lib = _load(cbuild.build("paged_prefill_avx512", AVX512_SOURCES, AVX512_FLAGS, FALLBACK))
    if lib is not None:
        lib.avx512_bf16_available.restype = ctypes.c_int
        lib.avx512 = bool(lib.avx512_bf16_available())  # built for AVX512-BF16, and the CPU has it
        lib.amx = False
    return lib


def available() -> bool:
    """Whether a prefill kernel runs here (see :func:`library`)."""
    return library() is not None


def can_use(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_prefill_attention` takes these (else callers run SDPA)."""
    if k_cache.dim() != 4 or q.dim() != 3:
        return False
    kvh, _, bs, hd = k_cache.shape
    return (
        q.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
        and hd == HEAD_DIM
        and q.shape[2] == hd
        and q.shape[1] % kvh == 0
        and q.stride(2) == 1
        and q.stride(1) == hd
        and bs % 16 == 0
        and v_cache.shape == k_cache.shape
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and available()
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_start: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk ``q`` [n, heads, 64] at positions ``q_start ..`` over its
    cached context -> ``[n, heads * 64]`` bf16 (see the module docstring). ``block_table`` [>= blocks
    of ``q_start + n`` keys] int64 physical block ids (valid ids: the executor checks them)."""
    if not can_use(q, k_cache, v_cache):
        raise ValueError(
            "q: needs bf16 [n, heads, 64] rows with contiguous heads over bf16 caches, and AMX or AVX512-BF16"
        )
    n, heads, hd = q.shape
    kvh, nb, bs, _ = k_cache.shape
    if q_start < 0 or n < 1:
        raise ValueError(f"q_start, q: need q_start >= 0 and n >= 1, got {q_start} and {n}")
    table = block_table.to(torch.int64).contiguous()
    if table.numel() * bs < q_start + n:
        raise ValueError(f"block_table: {table.numel()} blocks of {bs} hold fewer than {q_start + n} keys")
    out = torch.empty(n, heads * hd, dtype=torch.bfloat16)
    rc = library().paged_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        table.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        n,
        int(q_start),
        heads,
        kvh,
        nb,
        bs,
        float(scale),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("paged_prefill_attention: could not allocate the kernel's scratch (V^T or K^T)")
    return out
