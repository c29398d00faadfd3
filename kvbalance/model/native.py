"""A small native kernel for CPU decode attention straight over the paged KV cache.

PyTorch has no paged attention on the CPU: the portable path gathers every sequence's blocks into
a contiguous copy and then runs ``scaled_dot_product_attention`` — the copy costs about as much as
the attention. This C kernel reads each sequence's K/V blocks in place through the block table,
once per KV head for the whole GQA group, with an online softmax (one pass, no score matrix).

It is compiled with the system C compiler on first use (well under a second, cached by source
hash in ``$KVBALANCE_CACHE`` or ``~/.cache/kvbalance``) and loaded with ctypes; where no compiler is
available, or ``KVBALANCE_NATIVE=0``, callers fall back to the PyTorch path. float32 only.
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
#include <math.h>
#include <stdint.h>

#define MAX_G 64
#define MAX_D 256
#define MAX_BS 256

typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline float hsum(v8 x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* q, out: [B, KVH, G, D]; k, v: [KVH, NB, BS, D]; table: [B, MAXB]; ctx: [B] (tokens with KV). */
void paged_decode_attention(const float *restrict q, const float *restrict k, const float *restrict v,
                            const int64_t *restrict table, const int64_t *restrict ctx, float *restrict out,
                            int64_t B, int64_t KVH, int64_t G, int64_t D, int64_t NB, int64_t BS, int64_t MAXB,
                            float scale, int nthreads) {
    #pragma omp parallel for collapse(2) schedule(dynamic) num_threads(nthreads)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < KVH; h++) {
            const float *qh = q + (b * KVH + h) * G * D;
            float m[MAX_G], l[MAX_G];
            float acc[MAX_G * MAX_D] __attribute__((aligned(64)));
            float s[MAX_G * MAX_BS] __attribute__((aligned(64)));  /* [g][t]: scores, then weights */
            for (int64_t g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.0f; }
            for (int64_t i = 0; i < G * D; i++) acc[i] = 0.0f;
            int64_t n_ctx = ctx[b];
            int64_t n_blocks = (n_ctx + BS - 1) / BS;
            for (int64_t blk = 0; blk < n_blocks; blk++) {
                int64_t pb = table[b * MAXB + blk];
                int64_t n = n_ctx - blk * BS < BS ? n_ctx - blk * BS : BS;
                const float *kb = k + ((h * NB + pb) * BS) * D;
                const float *vb = v + ((h * NB + pb) * BS) * D;
                if (blk + 1 < n_blocks) { /* blocks are scattered: the hardware prefetcher stops at each */
                    int64_t nb2 = table[b * MAXB + blk + 1];
                    const char *nk = (const char *)(k + ((h * NB + nb2) * BS) * D);
                    const char *nv = (const char *)(v + ((h * NB + nb2) * BS) * D);
                    for (int64_t off = 0; off < BS * D * (int64_t)sizeof(float); off += 64) {
                        __builtin_prefetch(nk + off, 0, 0);
                        __builtin_prefetch(nv + off, 0, 0);
                    }
                }
                if (blk + 1 < n_blocks) { /* the next block is elsewhere in memory: fetch it early */
                    int64_t nb2 = table[b * MAXB + blk + 1];
                    const char *nk = (const char *)(k + ((h * NB + nb2) * BS) * D);
                    const char *nv = (const char *)(v + ((h * NB + nb2) * BS) * D);
                    for (int64_t off = 0; off < BS * D * 4; off += 64) {
                        __builtin_prefetch(nk + off, 0, 3);
                        __builtin_prefetch(nv + off, 0, 3);
                    }
                }
                int64_t t0 = 0;
                if (D % 8 == 0) {
                    /* four keys at a time: four independent FMA chains per query */
                    for (; t0 + 4 <= n; t0 += 4) {
                        const float *k0 = kb + t0 * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
                        for (int64_t g = 0; g < G; g++) {
                            const float *qg = qh + g * D;
                            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                            for (int64_t d = 0; d < D; d += 8) {
                                v8 qv = *(const v8 *)(qg + d);
                                a0 += qv * *(const v8 *)(k0 + d);
                                a1 += qv * *(const v8 *)(k1 + d);
                                a2 += qv * *(const v8 *)(k2 + d);
                                a3 += qv * *(const v8 *)(k3 + d);
                            }
                            s[g * BS + t0 + 0] = hsum(a0) * scale;
                            s[g * BS + t0 + 1] = hsum(a1) * scale;
                            s[g * BS + t0 + 2] = hsum(a2) * scale;
                            s[g * BS + t0 + 3] = hsum(a3) * scale;
                        }
                    }
                }
                for (int64_t t = t0; t < n; t++)
                    for (int64_t g = 0; g < G; g++) s[g * BS + t] = dot(qh + g * D, kb + t * D, D) * scale;
                for (int64_t g = 0; g < G; g++) {
                    float *sg = s + g * BS;
                    float bm = m[g];
                    for (int64_t t = 0; t < n; t++) bm = sg[t] > bm ? sg[t] : bm;
                    float c = expf(m[g] - bm);
                    m[g] = bm;
                    float sum = 0.0f;
                    for (int64_t t = 0; t < n; t++) { /* vectorised exp (libmvec) */
                        sg[t] = expf(sg[t] - bm);
                        sum += sg[t];
                    }
                    l[g] = l[g] * c + sum;
                    if (c != 1.0f)
                        for (int64_t d = 0; d < D; d++) acc[g * D + d] *= c;
                }
                for (int64_t t = 0; t < n; t++) {
                    const float *vt = vb + t * D;
                    for (int64_t g = 0; g < G; g++) axpy(acc + g * D, s[g * BS + t], vt, D);
                }
            }
            float *oh = out + (b * KVH + h) * G * D;
            for (int64_t g = 0; g < G; g++) {
                float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
                for (int64_t d = 0; d < D; d++) oh[g * D + d] = acc[g * D + d] * inv;
            }
        }
    }
}
"""

MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 64, 256, 256
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-funroll-loops", "-fopenmp", "-fPIC", "-shared"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    base = os.environ.get("KVBALANCE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvbalance")
    return Path(base) / "native"


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    tag = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + cc).encode()).hexdigest()[:16]
    out = _cache_dir() / f"paged_attention_{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src = Path(tmp) / "paged_attention.c"
            src.write_text(_SOURCE)
            so = Path(tmp) / "paged_attention.so"
            proc = subprocess.run(
                [cc, *_FLAGS, str(src), "-o", str(so), "-lm"], capture_output=True, text=True
            )
            if proc.returncode != 0:
                return None
            os.replace(so, out)  # atomic: concurrent builders never load a half-written file
    lib = ctypes.CDLL(str(out))
    fn = lib.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr] * 6 + [i64] * 7 + [ctypes.c_float, ctypes.c_int]
    fn.restype = None
    return lib


def native_library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it is disabled or cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("KVBALANCE_NATIVE", "1") != "0":
                try:
                    _lib = _build()
                except OSError:
                    _lib = None
            _tried = True
    return _lib


def can_use(q: torch.Tensor, k_cache: torch.Tensor, group: int) -> bool:
    kvh, _, bs, hd = k_cache.shape
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and k_cache.dtype == torch.float32
        and k_cache.is_contiguous()
        and group <= MAX_GROUP
        and hd <= MAX_HEAD_DIM
        and bs <= MAX_BLOCK_SIZE
        and native_library() is not None
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q`` [B, kv_heads, group, head_dim] -> attention output of the same shape.

    ``k_cache``/``v_cache`` are head-major ``[kv_heads, num_blocks, block_size, head_dim]``;
    ``block_table`` [B, max_blocks] int64; ``context_lens`` [B] int64 (keys each query attends).
    """
    lib = native_library()
    assert lib is not None
    q = q.contiguous()
    table = block_table.contiguous()
    ctx = context_lens.contiguous()
    b, kvh, g, d = q.shape
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
        g,
        d,
        nb,
        bs,
        table.shape[1],
        float(scale),
        torch.get_num_threads(),
    )
    return out
