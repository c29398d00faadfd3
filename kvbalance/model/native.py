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

It is compiled with the system C compiler on first use for each shape (~2 CPU seconds, cached by
source hash in ``$KVBALANCE_CACHE`` or ``~/.cache/kvbalance``) and loaded with ctypes; where no
compiler is available (it needs GCC >= 12 or Clang for ``__builtin_shufflevector``), or
``KVBALANCE_NATIVE=0``, callers fall back to the PyTorch path. The cache is float32 or bfloat16 (a
bf16 cache is widened to float32 in registers as it is read: half the bytes, the same float32
arithmetic); the head dim must be a multiple of 16.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* compiled per shape: -DGROUP=<query heads per KV head> -DNVEC=<head_dim / 16>, -DKV_BF16=<0 | 1> (cache
   dtype), -DIO_BF16=<0 | 1> (queries and output) */
#define D (16 * NVEC)
#define MAX_BS 256

typedef float vf __attribute__((vector_size(64), aligned(4))); /* 16 floats, any alignment */
typedef int32_t vi __attribute__((vector_size(64), aligned(4)));
typedef float h8 __attribute__((vector_size(32)));
typedef float h4 __attribute__((vector_size(16)));

static inline vf load(const float *p) { return *(const vf *)p; }
static inline void store(float *p, vf x) { *(vf *)p = x; }
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* a bf16 is the top half of a float32: widening is a zero-extend and a shift; narrowing rounds to
   nearest even (as torch's .to(torch.bfloat16)), NaN kept a quiet NaN */
typedef uint16_t vh __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(64)));
static inline vf load_bf16(const uint16_t *p) {
    vu w = __builtin_convertvector(*(const vh *)p, vu) << 16;
    vf x;
    memcpy(&x, &w, sizeof x);
    return x;
}
static inline void store_bf16(uint16_t *p, vf x) {
    vu b;
    memcpy(&b, &x, sizeof b);
    vu r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    vi nan = x != x;
    r = (vu)((nan & (vi)((b >> 16) | 0x40u)) | (~nan & (vi)r));
    vh h = __builtin_convertvector(r, vh);
    memcpy(p, &h, sizeof h);
}

#if KV_BF16
typedef uint16_t kv_t;
static inline vf load_kv(const kv_t *p) { return load_bf16(p); }
#else
typedef float kv_t;
static inline vf load_kv(const kv_t *p) { return load(p); }
#endif
#if IO_BF16
typedef uint16_t io_t;
static inline vf load_io(const io_t *p) { return load_bf16(p); }
static inline void store_io(io_t *p, vf x) { store_bf16(p, x); }
#else
typedef float io_t;
static inline vf load_io(const io_t *p) { return load(p); }
static inline void store_io(io_t *p, vf x) { store(p, x); }
#endif

static inline vf vmax(vf a, vf b) {
    vi a_bigger = a > b;
    return (vf)((a_bigger & (vi)a) | (~a_bigger & (vi)b));
}

static inline float hsum(vf x) {
    h8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    h4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float hmax(vf x) {
    float m = x[0];
    for (int i = 1; i < 16; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* out[i] = sum of the lanes of p[i], for 16 vectors at once (a transpose-and-add tree). */
static inline vf reduce16(const vf *p) {
    vf x[8], y[4], z[2];
    for (int i = 0; i < 8; i++)
        x[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* e^x for x <= 0 (scores minus their running max): 2^n * p(r) with |r| <= ln2 / 2 and p the degree-6
   Taylor polynomial (relative error ~2e-7); x is clamped at -87, so e^x stays a normal float. */
static inline vf vexp(vf x) {
    x = vmax(x, splat(-87.0f));
    vf t = x * splat(1.44269504088896341f);
    vi neg = t < splat(0.0f);
    vf half = (vf)((neg & (vi)splat(-0.5f)) | (~neg & (vi)splat(0.5f)));
    vi n = __builtin_convertvector(t + half, vi); /* round to nearest */
    vf nf = __builtin_convertvector(n, vf);
    vf r = x - nf * splat(0.693145751953125f) - nf * splat(1.428606765330187e-06f); /* ln2, split */
    vf p = splat(1.0f / 720);
    p = p * r + splat(1.0f / 120);
    p = p * r + splat(1.0f / 24);
    p = p * r + splat(1.0f / 6);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    vi bits = (n + 127) << 23;
    vf two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* A cache row's D values as NVEC vectors, in "row order". PAIRED (a bf16 cache, D a multiple of 32):
   vector 2c holds the even elements of the row's c-th 32-value chunk and 2c + 1 the odd ones, so
   widening is one 64-byte load, a shift and a mask (no shuffles); queries and accumulators are kept
   in the same order (to_row_order / from_row_order, once per sequence and head). */
#define PAIRED (KV_BF16 && NVEC % 2 == 0)
static inline void load_row(const kv_t *p, vf *r) {
#if PAIRED
    for (int c = 0; c < NVEC / 2; c++) {
        vu w, e, o;
        memcpy(&w, p + 32 * c, sizeof w);
        e = w << 16;
        o = w & 0xFFFF0000u;
        memcpy(&r[2 * c], &e, sizeof e);
        memcpy(&r[2 * c + 1], &o, sizeof o);
    }
#else
    for (int j = 0; j < NVEC; j++) r[j] = load_kv(p + 16 * j);
#endif
}
static inline void to_row_order(const float *x, vf *r) {
#if PAIRED
    for (int c = 0; c < NVEC / 2; c++)
        for (int i = 0; i < 16; i++) {
            r[2 * c][i] = x[32 * c + 2 * i];
            r[2 * c + 1][i] = x[32 * c + 2 * i + 1];
        }
#else
    for (int j = 0; j < NVEC; j++) r[j] = load(x + 16 * j);
#endif
}
static inline void from_row_order(const vf *r, float *x) {
#if PAIRED
    for (int c = 0; c < NVEC / 2; c++)
        for (int i = 0; i < 16; i++) {
            x[32 * c + 2 * i] = r[2 * c][i];
            x[32 * c + 2 * i + 1] = r[2 * c + 1][i];
        }
#else
    for (int j = 0; j < NVEC; j++) store(x + 16 * j, r[j]);
#endif
}

/* One (sequence, KV head): the GROUP queries qh [GROUP, D] against the sequence's n_ctx keys, whose
   blocks tab[] lists; k, v point at this head's [NB, BS, D] cache. */
static void attend_head(const io_t *restrict qh, const kv_t *restrict k, const kv_t *restrict v,
                        const int64_t *restrict tab, int64_t n_ctx, int64_t BS, float scale, io_t *restrict oh) {
    vf q[GROUP][NVEC], acc[GROUP][NVEC];
    float m[GROUP], l[GROUP];
    float s[GROUP][MAX_BS + 16] __attribute__((aligned(64))); /* this block's scores, then weights */
    float row[D] __attribute__((aligned(64)));
    for (int g = 0; g < GROUP; g++) {
        for (int j = 0; j < NVEC; j++) store(row + 16 * j, load_io(qh + g * D + 16 * j) * splat(scale));
        to_row_order(row, q[g]);
        for (int j = 0; j < NVEC; j++) acc[g][j] = splat(0.0f);
        m[g] = -3.0e38f;
        l[g] = 0.0f;
    }
    const int64_t n_blocks = (n_ctx + BS - 1) / BS, row_bytes = D * (int64_t)sizeof(kv_t);
    for (int64_t blk = 0; blk < n_blocks; blk++) {
        const int64_t n = n_ctx - blk * BS < BS ? n_ctx - blk * BS : BS;
        const kv_t *kb = k + tab[blk] * BS * D, *vb = v + tab[blk] * BS * D;
        const int64_t next = tab[blk + 1 < n_blocks ? blk + 1 : blk] * BS * D;
        const char *nk = (const char *)(k + next), *nv = (const char *)(v + next);
        /* scores, 16 keys at a time; prefetch the next block's K row by row meanwhile */
        int64_t t = 0;
        for (; t + 16 <= n; t += 16) {
            vf part[GROUP][16];
            for (int u = 0; u < 16; u++) {
                const kv_t *kt = kb + (t + u) * D;
                for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(nk + (t + u) * row_bytes + off, 0, 1);
                vf kr[NVEC];
                load_row(kt, kr);
                for (int g = 0; g < GROUP; g++) {
                    vf a = q[g][0] * kr[0];
                    for (int j = 1; j < NVEC; j++) a += q[g][j] * kr[j];
                    part[g][u] = a;
                }
            }
            for (int g = 0; g < GROUP; g++) store(s[g] + t, reduce16(part[g]));
        }
        for (; t < n; t++) {
            vf kr[NVEC];
            load_row(kb + t * D, kr);
            for (int g = 0; g < GROUP; g++) {
                vf a = q[g][0] * kr[0];
                for (int j = 1; j < NVEC; j++) a += q[g][j] * kr[j];
                s[g][t] = hsum(a);
            }
        }
        /* online softmax: new running max, rescale what was accumulated, weights e^(s - max) */
        const int64_t n16 = (n + 15) & ~(int64_t)15;
        for (int g = 0; g < GROUP; g++) {
            float *sg = s[g];
            for (int64_t i = n; i < n16; i++) sg[i] = -3.0e38f;
            vf mv = splat(m[g]);
            for (int64_t i = 0; i < n16; i += 16) mv = vmax(load(sg + i), mv);
            const float bm = hmax(mv), c = vexp(splat(m[g] - bm))[0];
            const vf bmv = splat(bm);
            for (int64_t i = 0; i < n16; i += 16) store(sg + i, vexp(load(sg + i) - bmv));
            for (int64_t i = n; i < n16; i++) sg[i] = 0.0f;
            vf sum = splat(0.0f);
            for (int64_t i = 0; i < n16; i += 16) sum += load(sg + i);
            m[g] = bm;
            l[g] = l[g] * c + hsum(sum);
            if (c != 1.0f)
                for (int j = 0; j < NVEC; j++) acc[g][j] *= splat(c);
        }
        /* weighted values; prefetch the next block's V row by row meanwhile */
        for (int64_t i = 0; i < n; i++) {
            const kv_t *vt = vb + i * D;
            for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(nv + i * row_bytes + off, 0, 1);
            vf vr[NVEC];
            load_row(vt, vr);
            for (int g = 0; g < GROUP; g++) {
                const vf p = splat(s[g][i]);
                for (int j = 0; j < NVEC; j++) acc[g][j] += p * vr[j];
            }
        }
    }
    for (int g = 0; g < GROUP; g++) {
        const vf inv = splat(1.0f / l[g]);
        for (int j = 0; j < NVEC; j++) acc[g][j] *= inv;
        from_row_order(acc[g], row);
        for (int j = 0; j < NVEC; j++) store_io(oh + g * D + 16 * j, load(row + 16 * j));
    }
}

/* q, out: [B, KVH, GROUP, D]; k, v: [KVH, NB, BS, D]; table: [B, MAXB]; ctx: [B] (tokens with KV). */
void paged_decode_attention(const io_t *restrict q, const kv_t *restrict k, const kv_t *restrict v,
                            const int64_t *restrict table, const int64_t *restrict ctx, io_t *restrict out,
                            int64_t B, int64_t KVH, int64_t NB, int64_t BS, int64_t MAXB, float scale, int nthreads) {
    #pragma omp parallel for collapse(2) schedule(dynamic) num_threads(nthreads)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < KVH; h++)
            attend_head(q + (b * KVH + h) * GROUP * D, k + h * NB * BS * D, v + h * NB * BS * D, table + b * MAXB,
                        ctx[b], BS, scale, out + (b * KVH + h) * GROUP * D);
}

/* The step's new keys and values into their cache slots: kn, vn [T, KVH, D] with row strides (in
   elements; heads contiguous within a row); kc, vc [KVH, NSLOTS, D]; slots [T]. */
void write_kv(const kv_t *restrict kn, int64_t k_stride, const kv_t *restrict vn, int64_t v_stride,
              kv_t *restrict kc, kv_t *restrict vc, const int64_t *restrict slots, int64_t T, int64_t KVH,
              int64_t NSLOTS) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < KVH; h++) {
            memcpy(kc + (h * NSLOTS + slots[t]) * D, kn + t * k_stride + h * D, D * sizeof(kv_t));
            memcpy(vc + (h * NSLOTS + slots[t]) * D, vn + t * v_stride + h * D, D * sizeof(kv_t));
        }
}
"""

MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 16, 256, 256
_FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=fast",
    "-funroll-loops",
    "-fopenmp",
    "-fPIC",
    "-shared",
]
_lock = threading.Lock()
_libs: dict[tuple[int, int, bool, bool], ctypes.CDLL | None] = {}
KV_DTYPES = (torch.float32, torch.bfloat16)


def _cache_dir() -> Path:
    base = os.environ.get("KVBALANCE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvbalance")
    return Path(base) / "native"


def _build(group: int, head_dim: int, kv_bf16: bool, io_bf16: bool) -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    types = [f"-DKV_BF16={int(kv_bf16)}", f"-DIO_BF16={int(io_bf16)}"]
    flags = [*_FLAGS, f"-DGROUP={group}", f"-DNVEC={head_dim // 16}", *types]
    tag = hashlib.sha256((_SOURCE + " ".join(flags) + cc).encode()).hexdigest()[:16]
    kind = "".join("b" if x else "f" for x in (kv_bf16, io_bf16))
    out = _cache_dir() / f"paged_attention_g{group}_d{head_dim}_{kind}_{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src = Path(tmp) / "paged_attention.c"
            src.write_text(_SOURCE)
            so = Path(tmp) / "paged_attention.so"
            proc = subprocess.run([cc, *flags, str(src), "-o", str(so)], capture_output=True, text=True)
            if proc.returncode != 0:
                return None
            os.replace(so, out)  # atomic: concurrent builders never load a half-written file
    lib = ctypes.CDLL(str(out))
    fn = lib.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr] * 6 + [i64] * 5 + [ctypes.c_float, ctypes.c_int]
    fn.restype = None
    lib.write_kv.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64]
    lib.write_kv.restype = None
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
            if os.environ.get("KVBALANCE_NATIVE", "1") != "0" and _supported_shape(*key[:2]):
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
    )
    return out


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
