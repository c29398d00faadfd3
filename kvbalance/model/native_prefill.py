"""An AMX flash-attention kernel for one prefill chunk over the paged bfloat16 KV cache (CPU).

The chunk's queries ``q`` [n, heads, 64] (bf16, rows of any stride: the view out of the fused QKV
output) at positions ``q_start .. q_start + n - 1`` attend causally to keys ``0 .. q_start + n - 1``,
read in place from the head-major cache ``[kv_heads, num_blocks, block_size, 64]`` through the
sequence's block table (the chunk's own K/V are written before attention runs), so a whole prompt
(``q_start = 0``) and a later chunk take the same path: no gathered copy, no float mask.

FlashAttention-2 (Dao 2023, Algorithm 1) on AMX tiles. One unit is 16 queries of one head; its key
blocks of 64 keys (those wholly above the diagonal skipped) run in three phases:

- scores ``S^T = K Q^T`` [16 keys x 16 queries]: the cache rows are the A tile (loaded in place with
  the row stride, as the decode kernel in :mod:`kvbalance.model.native_amx` does) and the queries,
  repacked once per unit into the VNNI pair layout, the B tile; ``tdpbf16ps`` (bf16 products exact in
  float32, float32 sums);
- online softmax in float32 with the 16 queries as the 16 vector lanes (maxima and sums need no
  horizontal reductions), in base 2 (``exp(scale s) = 2^(scale log2(e) s)``, degree-6 polynomial and
  ``vscalefps``). The running maximum is raised only where a block's maximum exceeds it by more than
  8 (FlashAttention-4's conditional rescaling): weights stay <= 2^8, exact in the final normalisation,
  and the accumulator tiles are stored, rescaled and reloaded only then (rarely after the first blocks);
- ``O^T += V^T P^T`` [64 dims x 16 queries] in four resident float32 C tiles, with ``P`` rounded to
  bf16 as torch's CPU flash kernel does for bf16 (its ``_exp_reduce_sum_fusion_kernel`` writes the
  weights in the input dtype; sums stay float32) and ``V^T`` transposed once per call into a scratch
  buffer (zero past the context). The output is normalised and rounded to bf16 once.

Head dim 64 only (128 would need 8 accumulator tiles of the 8), block size a multiple of 16, any GQA
group. Units are independent, so with several threads (OpenMP over units) the bits do not change.
:func:`can_use` is False (callers keep ``scaled_dot_product_attention``) without a compiler, AMX-BF16
or the kernel's permission for tile data, with ``KVBALANCE_NATIVE_AMX=0`` or ``KVBALANCE_NATIVE=0``,
and for other dtypes, shapes or devices.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from kvbalance.model import cbuild

HEAD_DIM = 64

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define D 64
#define KB 64 /* keys per softmax block */
#define TAU 8.0f /* conditional rescaling: weights stay <= 2^TAU */

/* asm tile loads and stores the compiler keeps in order (see native_amx.py); BARRIER where C code
   and tiles meet in memory */
#define TL_(t, base, stride) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t : : "r"(base), "r"((long)(stride)))
#define TS_(t, base, stride) __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" : : "r"(base), "r"((long)(stride)))
#define TL(t, b, s) TL_(t, b, s)
#define TS(t, b, s) TS_(t, b, s)
#define BARRIER() __asm__ volatile("" : : : "memory")

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

int amx_available(void) {
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512f")) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* every tile 16 rows x 64 bytes: 0, 1 Q^T (B), 2 scores (C), 3 K rows (A), 4..7 O^T (C) */
static void amx_configure(void) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

static inline __m512 exp2v(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-200.0f)); /* -inf -> 2^-200 = 0 */
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

typedef struct {
    const uint16_t *q, *k, *v;
    const int64_t *tab;
    uint16_t *vt, *out;
    int64_t qs, os, n, q_start, ctx, heads, group, nb, bs, lps;
    float c2; /* scale * log2(e) */
} args_t;

/* V^T of keys j0 .. j0 + 63 of KV head kh into the scratch rows (zero past the context) */
static void transpose_v(const args_t *a, int64_t kh, int64_t j0) {
    uint16_t *vt = a->vt + kh * D * a->lps;
    for (int64_t j = j0; j < j0 + KB; j++) {
        if (j >= a->ctx) {
            for (int d = 0; d < D; d++) vt[d * a->lps + j] = 0;
            continue;
        }
        const uint16_t *row = a->v + ((kh * a->nb + a->tab[j / a->bs]) * a->bs + j % a->bs) * D;
        for (int d = 0; d < D; d++) vt[d * a->lps + j] = row[d];
    }
}

/* lanes (queries at p0 + lane) that may attend key j */
static inline __mmask16 allowed(int64_t j, int64_t p0, int64_t ctx) {
    if (j >= ctx) return 0;
    if (j <= p0) return 0xFFFF;
    return j - p0 >= 16 ? 0 : (__mmask16)(0xFFFFu << (j - p0));
}

/* weights of one block (rows s[0 .. rows)) in place of the scores; raises m2 where needed and
   returns the correction of the accumulators (all ones: none) */
static __m512 block_softmax(float (*s)[16], int64_t rows, int64_t j0, int64_t p0, const args_t *a,
                            __m512 *m2, __m512 *l, uint32_t (*pt)[16], int *rescale) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY), c2 = _mm512_set1_ps(a->c2);
    const int masked = j0 + rows > (p0 + 1 < a->ctx ? p0 + 1 : a->ctx);
    __m512 bm = ninf;
    for (int64_t r = 0; r < rows; r++) {
        __m512 x = _mm512_load_ps(s[r]);
        if (masked) {
            x = _mm512_mask_mov_ps(ninf, allowed(j0 + r, p0, a->ctx), x);
            _mm512_store_ps(s[r], x);
        }
        bm = _mm512_max_ps(bm, x);
    }
    bm = _mm512_mul_ps(bm, c2);
    const __mmask16 up = _mm512_cmp_ps_mask(bm, _mm512_add_ps(*m2, _mm512_set1_ps(TAU)), _CMP_GT_OQ);
    __m512 corr = _mm512_set1_ps(1.0f);
    *rescale = up != 0;
    if (up) {
        const __m512 mn = _mm512_mask_mov_ps(*m2, up, bm);
        corr = exp2v(_mm512_sub_ps(*m2, mn));
        *l = _mm512_mul_ps(*l, corr);
        *m2 = mn;
    }
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                           22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r += 2) {
        const __m512 p0v = exp2v(_mm512_fmsub_ps(_mm512_load_ps(s[r]), c2, *m2));
        const __m512 p1v = exp2v(_mm512_fmsub_ps(_mm512_load_ps(s[r + 1]), c2, *m2));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0v, p1v));
        const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(p1v, p0v); /* keys r (low half), r + 1 */
        _mm512_store_si512(pt[r / 2], _mm512_permutexvar_epi16(inter, b));
    }
    *l = _mm512_add_ps(*l, sum);
    return corr;
}

/* 16 queries i0 .. of head h */
static void attend_unit(const args_t *a, int64_t h, int64_t i0) {
    uint32_t qt[2][16][16] __attribute__((aligned(64)));
    float s[KB][16] __attribute__((aligned(64)));
    uint32_t pt[KB / 2][16] __attribute__((aligned(64)));
    float ob[D][16] __attribute__((aligned(64)));
    const int64_t nq = a->n - i0 < 16 ? a->n - i0 : 16, p0 = a->q_start + i0, kh = h / a->group;
    memset(qt, 0, sizeof qt);
    for (int64_t lane = 0; lane < nq; lane++) {
        const uint32_t *w = (const uint32_t *)(a->q + (i0 + lane) * a->qs + h * D);
        for (int sl = 0; sl < 2; sl++)
            for (int k = 0; k < 16; k++) qt[sl][k][lane] = w[16 * sl + k];
    }
    const uint16_t *kbase = a->k + kh * a->nb * a->bs * D, *vt = a->vt + kh * D * a->lps;
    const int64_t limit = a->ctx < p0 + 16 ? a->ctx : p0 + 16, vstride = 2 * a->lps;
    __m512 m2 = _mm512_set1_ps(-1.0e30f), l = _mm512_setzero_ps();
    BARRIER();
    TL(0, qt[0], 64);
    TL(1, qt[1], 64);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t j0 = 0; j0 < limit; j0 += KB) {
        const int64_t nk = limit - j0 < KB ? limit - j0 : KB, nc = (nk + 31) / 32;
        for (int64_t t = 0; t < 2 * nc; t++) {
            const int64_t j = j0 + 16 * t;
            if (j >= a->ctx) break; /* rows past the context: masked in block_softmax */
            const uint16_t *kr = kbase + (a->tab[j / a->bs] * a->bs + j % a->bs) * D;
            _tile_zero(2);
            TL(3, kr, 2 * D);
            _tile_dpbf16ps(2, 3, 0);
            TL(3, kr + 32, 2 * D);
            _tile_dpbf16ps(2, 3, 1);
            TS(2, s[16 * t], 64);
        }
        BARRIER();
        int rescale;
        const __m512 corr = block_softmax(s, 32 * nc, j0, p0, a, &m2, &l, pt, &rescale);
        if (rescale && j0 > 0) {
            TS(4, ob[0], 64);
            TS(5, ob[16], 64);
            TS(6, ob[32], 64);
            TS(7, ob[48], 64);
            BARRIER();
            for (int d = 0; d < D; d++) _mm512_store_ps(ob[d], _mm512_mul_ps(_mm512_load_ps(ob[d]), corr));
            BARRIER();
            TL(4, ob[0], 64);
            TL(5, ob[16], 64);
            TL(6, ob[32], 64);
            TL(7, ob[48], 64);
        }
        BARRIER();
        for (int64_t c = 0; c < nc; c++) {
            const uint16_t *vc = vt + j0 + 32 * c;
            TL(0, pt[16 * c], 64);
            TL(1, vc, vstride);
            _tile_dpbf16ps(4, 1, 0);
            TL(2, vc + 16 * a->lps, vstride);
            _tile_dpbf16ps(5, 2, 0);
            TL(3, vc + 32 * a->lps, vstride);
            _tile_dpbf16ps(6, 3, 0);
            TL(1, vc + 48 * a->lps, vstride);
            _tile_dpbf16ps(7, 1, 0);
        }
        TL(0, qt[0], 64);
        TL(1, qt[1], 64);
    }
    TS(4, ob[0], 64);
    TS(5, ob[16], 64);
    TS(6, ob[32], 64);
    TS(7, ob[48], 64);
    BARRIER();
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    uint16_t row[16] __attribute__((aligned(32)));
    for (int d = 0; d < D; d++) {
        _mm256_store_si256((__m256i *)row, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(ob[d]), inv)));
        for (int64_t lane = 0; lane < nq; lane++) a->out[(i0 + lane) * a->os + h * D + d] = row[lane];
    }
}

/* returns 0, or -1 where the scratch could not be allocated */
int paged_prefill_attention(const uint16_t *q, int64_t qs, const uint16_t *k, const uint16_t *v,
                            const int64_t *tab, uint16_t *out, int64_t os, int64_t n, int64_t q_start,
                            int64_t heads, int64_t kvh, int64_t nb, int64_t bs, float scale, int threads) {
    const int64_t ctx = q_start + n, lp = (ctx + KB - 1) / KB * KB;
    args_t a = {q, k, v, tab, NULL, out, qs, os, n, q_start, ctx, heads, heads / kvh, nb, bs, lp + 32,
                scale * 1.4426950408889634f};
    a.vt = aligned_alloc(64, (size_t)(kvh * D * a.lps * 2));
    if (a.vt == NULL) return -1;
    const int64_t nqb = (n + 15) / 16, units = heads * nqb, chunks = lp / KB;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < kvh * chunks; u++) transpose_v(&a, u / chunks, (u % chunks) * KB);
        amx_configure();
        /* the costliest units (last query blocks) first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) attend_unit(&a, u % heads, (nqb - 1 - u / heads) * 16);
    }
    free(a.vt);
    return 0;
}
"""

_FLAGS = (*cbuild.DEFAULT_FLAGS, "-mamx-tile", "-mamx-bf16")
_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}


def library() -> ctypes.CDLL | None:
    """The compiled kernel (built once, cached), or None where it is disabled or cannot be built."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _build()
    return _state["lib"]


def _build() -> ctypes.CDLL | None:
    out = cbuild.build("paged_prefill_amx", _SOURCE, _FLAGS, remember_failure=True)
    if out is None:
        return None
    try:
        lib = ctypes.CDLL(str(out))
    except OSError:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.paged_prefill_attention
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.amx_available.restype = ctypes.c_int
    lib.amx = bool(lib.amx_available())  # cpuid says AMX-BF16 and the OS granted tile data
    return lib


def available() -> bool:
    """Whether the kernel runs here: native kernels on, ``KVBALANCE_NATIVE_AMX`` not ``0``, built, AMX."""
    if not cbuild.native_enabled() or os.environ.get("KVBALANCE_NATIVE_AMX", "1") == "0":
        return False
    lib = library()
    return lib is not None and lib.amx


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
        raise ValueError("q: needs bf16 [n, heads, 64] rows with contiguous heads over bf16 caches, and AMX")
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
        raise MemoryError("paged_prefill_attention: could not allocate the V^T scratch")
    return out
