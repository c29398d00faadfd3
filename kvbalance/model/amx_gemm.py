"""An AMX bf16 GEMM for the decode step's linears: ``y = x @ W^T (+ bias)``, bf16 in, float32 tile
accumulation, the output rounded once to bf16 (nearest even).

A decode step's linears are memory-bound: each weight is read once per step for a few dozen rows.
oneDNN's AMX matmul on one thread streams SmolLM2's weights at ~7.7 GB/s at 64 rows (below this
core's ~10 GB/s DRAM rate). This kernel packs each weight once into the tile layout it streams, so
the weight passes through the core as one contiguous stream per call:

- **Packed layout** (:func:`pack`): N is padded with zero rows to a multiple of 32 and cut into
  *panel pairs* of 32 output columns. A pair is ``K / 32`` steps of two B tiles (16 K pairs x 16
  columns, VNNI: ``tile[r][c] = (W[n0 + c, k0 + 2r], W[n0 + c, k0 + 2r + 1])``), 2 KB per step, so a
  pair is contiguous and the pairs follow each other: the hardware prefetcher streams it, and the
  kernel prefetches ``PF_PAIRS`` pairs ahead into L2 by software as well.
- **Tiles**: C is a 2 x 2 block of 16 x 16 float32 tiles (32 rows x 32 columns, tmm0-3), two A tiles of
  16 rows x 32 K (tmm4, 5: the activations, from L1/L2), two B tiles (tmm6, 7). For each pair the rows
  run in chunks of 32 (the pair stays in L1/L2 while they reuse it); rows are blocked by ``M_BLOCK``
  outside the pairs so the activations of a block stay in L2 for large M. A last row tile with fewer
  than 16 rows is copied into a zero-padded buffer first (tile loads read 16 rows).
- **Epilogue**: C tiles are stored to a float32 buffer, the bias (bf16, widened) added in float32,
  and each value rounded once to bf16 (``vcvtneps2bf16``: nearest even).

K must be a multiple of 32 (otherwise :func:`pack` returns None and the caller keeps oneDNN). The
tile configuration is loaded at every call (oneDNN and the attention kernel configure tiles their own
way on the same thread) and released after. Runs only where the CPU has AMX-BF16 and the kernel was
granted tile data (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``), the compiler knows AMX, and
``KVBALANCE_NATIVE_AMX`` / ``KVBALANCE_NATIVE`` are not ``0``.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from kvbalance.model import cbuild

_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef uint16_t bf16;
#ifndef PF_PAIRS
#define PF_PAIRS 2 /* panel pairs prefetched ahead */
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1 /* into L2 */
#endif
#ifndef M_BLOCK
#define M_BLOCK 256 /* rows whose activations stay in L2 while every pair passes */
#endif

/* tile numbers are literals; the asm claims no memory, so BARRIER orders C accesses around it */
#define TLOAD_(t, base, stride) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t : : "r"(base), "r"((long)(stride)))
#define TSTORE_(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" : : "r"(base), "r"((long)(stride)))
#define TLOAD(t, base, stride) TLOAD_(t, base, stride)
#define TSTORE(t, base, stride) TSTORE_(t, base, stride)
#define BARRIER(p) __asm__ volatile("" : : "r"(p) : "memory")

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

int amx_available(void) {
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512bf16")) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

static void configure(void) { /* all eight tiles 16 rows x 64 bytes */
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    __asm__ volatile("ldtilecfg %0" : : "m"(c)); /* not _tile_loadconfig: see native_amx.py */
}

typedef struct {
    const bf16 *x, *w, *bias, *tail; /* tail: the last partial row tile, zero-padded to 16 rows */
    bf16 *y;
    int64_t ldx, ldy, M, N, K;
} gemm_t;

static inline const bf16 *row_tile(const gemm_t *g, int64_t t, int64_t *stride) {
    if (16 * (t + 1) <= g->M) {
        *stride = 2 * g->ldx;
        return g->x + 16 * t * g->ldx;
    }
    *stride = 2 * g->K;
    return g->tail;
}

/* C values buf[rows][ld] (floats) + bias in float32, rounded once to bf16 (nearest even), into y at
   (r0, n0): the real rows (< M) and columns (< N) of a block of rows x cols (16 or 32) */
static void epilogue(const gemm_t *g, const float *buf, int64_t ld, int64_t r0, int64_t rows, int64_t n0, int64_t cols) {
    if (g->M - r0 < rows) rows = g->M - r0;
    if (g->N - n0 < cols) cols = g->N - n0;
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (g->bias) {
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m0, g->bias + n0)), 16));
        b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m1, g->bias + n0 + 16)), 16));
    }
    for (int64_t r = 0; r < rows; r++) {
        bf16 *yr = g->y + (r0 + r) * g->ldy + n0;
        const float *br = buf + r * ld;
        _mm256_mask_storeu_epi16(yr, m0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(br), b0)));
        if (m1) _mm256_mask_storeu_epi16(yr + 16, m1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(br + 16), b1)));
    }
}

/* rows of row tiles t0 .. t0 + nt - 1 (nt = 1 or 2) x the 32 columns of pair q; pf_step bytes of the
   prefetch stream pf (NULL: none) issued per K step */
static void chunk(const gemm_t *g, int64_t q, int64_t t0, int nt, const char *pf, int pf_step, float (*buf)[32]) {
    const int64_t KB = g->K / 32;
    const bf16 *bq = g->w + q * KB * 1024;
    int64_t s0, s1 = 0;
    const bf16 *a0 = row_tile(g, t0, &s0), *a1 = nt > 1 ? row_tile(g, t0 + 1, &s1) : a0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < KB; kb++) {
        if (pf)
            for (int l = 0; l < pf_step; l += 64) _mm_prefetch(pf + kb * pf_step + l, PF_HINT);
        TLOAD(4, a0 + 32 * kb, s0);
        TLOAD(6, bq + kb * 1024, 64);
        TLOAD(7, bq + kb * 1024 + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (nt > 1) {
            TLOAD(5, a1 + 32 * kb, s1);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    TSTORE(0, &buf[0][0], 128);
    TSTORE(1, &buf[0][16], 128);
    if (nt > 1) {
        TSTORE(2, &buf[16][0], 128);
        TSTORE(3, &buf[16][16], 128);
    }
    BARRIER(buf);
    epilogue(g, &buf[0][0], 32, 16 * t0, nt * 16, 32 * q, 32);
}
/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T (+ bias), W packed by pack(); 0 on success */
int amx_linear(const bf16 *x, int64_t ldx, const bf16 *w, const bf16 *bias, bf16 *y, int64_t ldy, int64_t M,
               int64_t N, int64_t K, int nthreads) {
    if (K % 32 != 0 || M < 1 || N < 1) return -1;
    bf16 *tail = NULL;
    if (M % 16 != 0) { /* the last row tile, zero-padded to 16 rows */
        tail = calloc(16 * K, sizeof(bf16));
        if (!tail) return -2;
        const int64_t t = M / 16;
        for (int64_t r = 0; r < M - 16 * t; r++) memcpy(tail + r * K, x + (16 * t + r) * ldx, K * sizeof(bf16));
    }
    BARRIER(tail);
    const gemm_t g = {x, w, bias, tail, y, ldx, ldy, M, N, K};
    const int64_t pairs = (N + 31) / 32, tiles = (M + 15) / 16;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        configure(); /* per thread, at every call: others configure tiles their own way */
        float buf[64][32] __attribute__((aligned(64)));
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t q0 = pairs * id / nt, q1 = pairs * (id + 1) / nt;
        for (int64_t tb = 0; tb < tiles; tb += M_BLOCK / 16) {
            const int64_t te = tb + M_BLOCK / 16 < tiles ? tb + M_BLOCK / 16 : tiles;
            /* the pair PF_PAIRS ahead is prefetched in equal parts over this pair's row chunks */
            const int64_t chunks = (te - tb + 1) / 2, step = (2048 / chunks + 63) & ~63;
            for (int64_t q = q0; q < q1; q++) {
                const char *pf = q + PF_PAIRS < q1 ? (const char *)(w + (q + PF_PAIRS) * (K / 32) * 1024) : NULL;
                for (int64_t t = tb, c = 0; t < te; t += 2, c++)
                    chunk(&g, q, t, te - t >= 2 ? 2 : 1, pf ? pf + c * (K / 32) * step : NULL, (int)step, buf);
            }
        }
        _tile_release();
    }
    free(tail);
    return 0;
}
"""

_FLAGS = (*cbuild.DEFAULT_FLAGS, "-mamx-tile", "-mamx-bf16", "-mavx512bf16")
PAIR = 32  # output columns per panel pair (two 16-column B tiles)
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
                    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
                    fn.argtypes += [ctypes.c_int64] * 4 + [ctypes.c_int]
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


class AmxPackedWeight:
    """A ``[N, K]`` bf16 weight in the kernel's tile layout (one copy: ``N`` padded to 32, nothing else)."""

    __slots__ = ("data", "n", "k")

    def __init__(self, data: torch.Tensor, n: int, k: int) -> None:
        self.data, self.n, self.k = data, n, k

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def pack(w: torch.Tensor) -> AmxPackedWeight | None:
    """``w`` [N, K] (bf16, CPU) in the tile layout of the module docstring, or None where the kernel
    cannot take it (another dtype or device, K not a multiple of 32)."""
    if w.dim() != 2 or w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.shape[1] % K_STEP != 0:
        return None
    n, k = w.shape
    n_pad = -n % PAIR
    w = w.detach()
    if n_pad:
        w = torch.cat([w, w.new_zeros(n_pad, k)])
    # [pair, j, c, kb, r, e] -> [pair, kb, j, r, c, e]: tile j of step kb holds W[n0 + 16 j + c, k0 + 2 r + e]
    tiles = w.reshape(-1, 2, 16, k // K_STEP, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
    return AmxPackedWeight(tiles, n, k)


def linear(x: torch.Tensor, packed: AmxPackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for ``x`` [..., K] bf16 through the AMX kernel (rows with a stride are read
    in place; a last dim with a stride is copied first); the caller checks :func:`available`."""
    k, n = packed.k, packed.n
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
            packed.data.data_ptr(),
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
