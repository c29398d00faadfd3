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

K must be a multiple of 32 (:func:`supports`; callers keep oneDNN otherwise); W and activation rows
past N and M are zero-padded copies. The tile configuration is loaded at every call (oneDNN and the
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
from kvbalance.model.amx_prelude import AMX_PRELUDE

_SOURCE = (
    r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;
#define PF_BLOCKS 1 /* 32-row blocks of W prefetched ahead (into L2); 2 measured no better */
#define X_L1_ROWS 32 /* above: activation tile loads hint T1 (tileloaddt1), keeping L1 for the W block */
#define TILE_LOAD_T1_(t, base, stride) \
    __asm__ volatile("tileloaddt1 (%0,%1,1), %%tmm" #t : : "r"(base), "r"((long)(stride)))
#define TILE_LOAD_T1(t, base, stride) TILE_LOAD_T1_(t, base, stride)
/* an activation tile (contiguous), hinted T1 where the activations stream */
#define X_LOAD(t, base) do { if (g->x_stream) TILE_LOAD_T1(t, base, 64); else TILE_LOAD(t, base, 64); } while (0)

"""
    + AMX_PRELUDE
    + r"""
int amx_available(void) { return amx_cpu_and_permission(1); }

static void configure(void) { /* all eight tiles 16 rows x 64 bytes */
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_load_config(colsb);
}

/* 16 x 16 transpose of 32-bit lanes in registers: r[i][j] -> r[j][i] */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* B tile (kb, j) of the packed activations: K step kb (pairs p = 16 kb .. 16 kb + 15), activation rows
   m = 16 j .. 16 j + 15; each tile 16 x 16 words, contiguous (row stride 64 bytes) */
static inline const uint32_t *x_tile(const uint32_t *xt, int64_t Mp, int64_t kb, int64_t j) {
    return xt + (kb * (Mp / 16) + j) * 256;
}

/* x [M, K] (row stride ldx) as B tiles: word (p, m) = (x[m][2p], x[m][2p + 1]) at row p % 16, column m % 16
   of tile (p / 16, m / 16), p < K/2, m < Mp (M padded to 16 with zero rows) */
static void pack_x(const bf16 *x, int64_t ldx, int64_t M, int64_t Mp, int64_t K, uint32_t *xt) {
    for (int64_t m0 = 0; m0 < Mp; m0 += 16)
        for (int64_t p0 = 0; p0 < K / 2; p0 += 16) {
            __m512i r[16]; /* rows past M: masked-off loads (zeros, no memory touched) */
            for (int i = 0; i < 16; i++)
                r[i] = _mm512_maskz_loadu_epi32(m0 + i < M ? 0xFFFF : 0, x + (m0 + i) * ldx + 2 * p0);
            transpose16(r);
            uint32_t *tile = (uint32_t *)x_tile(xt, Mp, p0 / 16, m0 / 16);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)(tile + 16 * j), r[j]);
        }
}

typedef struct {
    const bf16 *w, *bias, *wtail; /* wtail: W's last partial 16-row tile, zero-padded */
    const uint32_t *xt;
    bf16 *y;
    int64_t ldy, M, Mp, N, K;
    int x_stream; /* more activations than stay in L1 beside a W block: their tile loads hint T1 */
} gemm_t;

static inline const bf16 *w_tile(const gemm_t *g, int64_t n0) {
    if (n0 >= g->N) return g->w; /* past N (the second tile of a last block of 16 rows): results unused */
    return n0 + 16 <= g->N ? g->w + n0 * g->K : g->wtail;
}

/* C^T block buf[n][m] (16 x 16 floats, row stride 32) + bias[n] in float32, transposed, rounded once
   to bf16 (nearest even) into y rows m0 .. (< M), columns n0 .. n0 + 15 (< N) */
static void epilogue16(const gemm_t *g, const float *buf, int64_t n0, int64_t m0) {
    if (n0 >= g->N || m0 >= g->M) return;
    const int64_t cols = g->N - n0 < 16 ? g->N - n0 : 16, rows = g->M - m0 < 16 ? g->M - m0 : 16;
    const __mmask16 mask = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    __m512i r[16];
    for (int i = 0; i < 16; i++) {
        __m512 v = _mm512_loadu_ps(buf + 32 * i);
        if (g->bias && i < cols) {
            uint32_t b = (uint32_t)g->bias[n0 + i] << 16;
            float bf;
            memcpy(&bf, &b, 4);
            v = _mm512_add_ps(v, _mm512_set1_ps(bf));
        }
        r[i] = _mm512_castps_si512(v);
    }
    transpose16(r);
    for (int64_t j = 0; j < rows; j++)
        _mm256_mask_storeu_epi16(g->y + (m0 + j) * g->ldy + n0, mask,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[j])));
}

/* A chunk's C^T tiles waiting in buf for their epilogue, run in parts while the next chunk's products
   are in flight (the vector work then overlaps the tile unit's); done: 16 x 16 blocks finished */
typedef struct {
    float (*buf)[32];
    int64_t n0, m0;
    int nt, done;
} pending_t;

/* the next of the pending chunk's four 16 x 16 blocks (n tile done % 2, m tile done / 2) */
static void finish_one(const gemm_t *g, pending_t *p) {
    if (!p->buf) return;
    BARRIER(p->buf);
    const int i = p->done++, ni = i & 1, mi = i >> 1;
    if (mi < p->nt) epilogue16(g, &p->buf[16 * ni][16 * mi], p->n0 + 16 * ni, p->m0 + 16 * mi);
    if (p->done == 4) p->buf = NULL;
}

static void finish(const gemm_t *g, pending_t *p) { while (p->buf) finish_one(g, p); }

#define EPILOGUE_AT 1 /* pending epilogue: two blocks after K steps 1, 2 (all four at once: ~5% slower) */

/* W rows n0 .. n0 + 31 x the activations' columns of B tiles m0 .. m0 + 16 * nt - 1 (nt = 1 or 2):
   C^T in tmm0-3 (n tile i, m tile j: tmm 2 j + i), W tiles in tmm4, 5, x tiles in tmm6, 7; pf_step
   bytes of the prefetch stream pf (NULL: none) issued per K step. The tiles go to buf, and the
   epilogue of the previous chunk (pend) runs after EPILOGUE_AT K steps; this chunk's becomes pend. */
static void chunk(const gemm_t *g, int64_t n0, int64_t m0, int nt, const char *pf, int pf_step, float (*buf)[32],
                  pending_t *pend) {
    const int64_t KB = g->K / 32, sw = 2 * g->K, xs = 16 * g->Mp; /* xs: words from K step to K step */
    const bf16 *w0 = w_tile(g, n0), *w1 = w_tile(g, n0 + 16);
    const uint32_t *x0 = x_tile(g->xt, g->Mp, 0, m0 / 16), *x1 = x0 + 256;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < KB; kb++) {
        if (pf)
            for (int l = 0; l < pf_step; l += 64) _mm_prefetch(pf + kb * pf_step + l, _MM_HINT_T1);
        X_LOAD(6, x0 + kb * xs);
        TILE_LOAD(4, w0 + 32 * kb, sw);
        TILE_LOAD(5, w1 + 32 * kb, sw);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (nt > 1) {
            X_LOAD(7, x1 + kb * xs);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (kb == EPILOGUE_AT || kb == EPILOGUE_AT + 1) {
            finish_one(g, pend);
            finish_one(g, pend);
        }
        if (kb == KB - 1) finish(g, pend);
    }
    TILE_STORE(0, &buf[0][0], 128);
    TILE_STORE(1, &buf[16][0], 128);
    if (nt > 1) {
        TILE_STORE(2, &buf[0][16], 128);
        TILE_STORE(3, &buf[16][16], 128);
    }
    BARRIER(buf);
    *pend = (pending_t){buf, n0, m0, nt, 0};
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ w[N, K]^T (+ bias), w row-major and
   contiguous; 0 on success */
int amx_linear(const bf16 *x, int64_t ldx, const bf16 *w, const bf16 *bias, bf16 *y, int64_t ldy, int64_t M,
               int64_t N, int64_t K, int nthreads) {
    if (K % 32 != 0 || M < 1 || N < 1) return -1;
    const int64_t Mp = (M + 15) / 16 * 16, blocks = (N + 31) / 32;
    /* the packed activations and W's padded last row tile, in buffers kept per calling thread (a
       fresh allocation of this size is an mmap and its page faults at every call) */
    static __thread uint32_t *xt = NULL;
    static __thread size_t xt_size = 0;
    const size_t need = (size_t)(K / 2) * Mp * 4 + (size_t)32 * K;
    if (need > xt_size) {
        free(xt);
        xt = aligned_alloc(64, (need + 63) / 64 * 64);
        xt_size = xt ? need : 0;
        if (!xt) return -2;
    }
    pack_x(x, ldx, M, Mp, K, xt);
    bf16 *wtail = NULL;
    if (N % 16 != 0) { /* W's last row tile, zero-padded to 16 rows, after the activations */
        wtail = (bf16 *)(xt + (K / 2) * Mp);
        memset(wtail, 0, 32 * K);
        memcpy(wtail, w + N / 16 * 16 * K, (N % 16) * K * sizeof(bf16));
    }
    BARRIER(xt);
    BARRIER(wtail);
    const gemm_t g = {w, bias, wtail, xt, y, ldy, M, Mp, N, K, Mp > X_L1_ROWS};
    const int64_t chunks = (Mp / 16 + 1) / 2, step = (2048 / chunks + 63) & ~63;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        configure(); /* per thread, at every call: others configure tiles their own way */
        float buf[2][32][32] __attribute__((aligned(64))); /* this chunk's tiles, the previous one's */
        pending_t pend = {NULL, 0, 0, 0, 0};
        int flip = 0;
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t q0 = blocks * id / nt, q1 = blocks * (id + 1) / nt;
        /* W streams through in blocks of 32 rows (contiguous); the block PF_BLOCKS ahead is prefetched
           in equal parts over this block's chunks of 32 activation rows */
        for (int64_t q = q0; q < q1; q++) {
            const int64_t ahead = 32 * (q + PF_BLOCKS);
            const char *pf = q + PF_BLOCKS < q1 && ahead + 32 <= N ? (const char *)(w + ahead * K) : NULL;
            for (int64_t m0 = 0, c = 0; m0 < Mp; m0 += 32, c++)
                chunk(&g, 32 * q, m0, Mp - m0 >= 32 ? 2 : 1, pf ? pf + c * (K / 32) * step : NULL, (int)step,
                      buf[flip ^= 1], &pend);
        }
        finish(&g, &pend);
        _tile_release();
    }
    return 0;
}
"""
)

_FLAGS = (*cbuild.DEFAULT_FLAGS, "-mamx-tile", "-mamx-bf16", "-mavx512bf16")
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
            out = cbuild.build("amx_gemm", _SOURCE, _FLAGS, remember_failure=True)
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
