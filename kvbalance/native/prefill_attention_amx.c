/* The AMX flash-attention kernel for one prefill chunk over the paged bf16 KV cache
   (kvbalance/model/native_prefill.py explains the algorithm and loads it). Built with the compiler's AMX
   and AVX512-BF16 flags; amx_available() says whether the CPU runs it. -DTAU=0.0f rescales at every new
   maximum (10-15% slower). Measured and left out: the weights rounded once to bf16 as torch does (16
   instead of 24 tile products a block, 10-15% faster) flipped a 0.05-margin greedy token of the real
   SmolLM2 in tests/test_bf16.py and was less accurate than torch's SDPA on random inputs (with the lazy
   maximum: the largest weight is no longer exactly 1). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#define D 64
#define KB 64 /* keys per softmax block */
#ifndef TAU
#define TAU 8.0f /* conditional rescaling: weights stay <= 2^TAU */
#endif

#include "amx.h"
#include "exp2_avx512.h"

int amx_available(void) { return amx_cpu_and_permission(0); }

/* every tile 16 rows x 64 bytes. Scores: 0, 1 Q^T (B), 2 S^T (C), 3 K rows (A); weighted sums: 0, 1 P^T
   hi and lo (B), 2, 3 V^T (A); 4 .. 7 the O^T accumulators (C) throughout */
static void amx_configure(void) {
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_load_config(colsb);
}

typedef struct {
    const uint16_t *q, *k, *v;
    const int64_t *tab;
    uint16_t *vt, *out;
    int64_t qs, os, n, q_start, ctx, heads, group, nb, bs, lps;
    float c2; /* scale * log2(e) */
} args_t;

/* 16 x 16 32-bit transpose in registers: r[i] lane c -> r[c] lane i */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* u[4 i + m], 128-bit lane L: rows 4 i .. 4 i + 3 of column 4 L + m */
    for (int m = 0; m < 4; m++) {
        const __m512i v01 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88), w01 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xDD);
        const __m512i v23 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88),
                      w23 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xDD);
        r[m] = _mm512_shuffle_i32x4(v01, v23, 0x88);
        r[8 + m] = _mm512_shuffle_i32x4(v01, v23, 0xDD);
        r[4 + m] = _mm512_shuffle_i32x4(w01, w23, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(w01, w23, 0xDD);
    }
}

static inline const uint16_t *v_row(const args_t *a, int64_t kh, int64_t j) {
    return a->v + ((kh * a->nb + a->tab[j / a->bs]) * a->bs + j % a->bs) * D;
}

/* V^T of keys j0 .. j0 + 63 of KV head kh into the scratch (zero past the context), 32 keys a chunk:
   the chunk [64 dims][32 keys] is contiguous, four A tiles of 16 dims one after another. Whole chunks
   in registers: key pairs (2k, 2k + 1) interleaved into 32-bit words per dim, then 16 x 16 transposes. */
static void transpose_v(const args_t *a, int64_t kh, int64_t j0) {
    static const uint16_t pair_lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                         8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    static const uint16_t pair_hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                         24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo = _mm512_loadu_si512(pair_lo), hi = _mm512_loadu_si512(pair_hi);
    uint16_t *vt = a->vt + kh * D * a->lps;
    for (int64_t c0 = j0; c0 < j0 + KB; c0 += 32) {
        uint16_t *chunk = vt + c0 * D;
        if (c0 + 32 <= a->ctx) {
            __m512i w[4][16]; /* [16-dim group][key pair]: words (V[2k][d], V[2k + 1][d]) */
            for (int k = 0; k < 16; k++) {
                const uint16_t *r0 = v_row(a, kh, c0 + 2 * k), *r1 = v_row(a, kh, c0 + 2 * k + 1);
                const __m512i a0 = _mm512_loadu_si512(r0), b0 = _mm512_loadu_si512(r0 + 32);
                const __m512i a1 = _mm512_loadu_si512(r1), b1 = _mm512_loadu_si512(r1 + 32);
                w[0][k] = _mm512_permutex2var_epi16(a0, lo, a1);
                w[1][k] = _mm512_permutex2var_epi16(a0, hi, a1);
                w[2][k] = _mm512_permutex2var_epi16(b0, lo, b1);
                w[3][k] = _mm512_permutex2var_epi16(b0, hi, b1);
            }
            for (int g = 0; g < 4; g++) {
                transpose16(w[g]);
                for (int d = 0; d < 16; d++) _mm512_store_si512(chunk + (16 * g + d) * 32, w[g][d]);
            }
            continue;
        }
        for (int64_t j = c0; j < c0 + 32; j++) {
            const uint16_t *row = j < a->ctx ? v_row(a, kh, j) : NULL;
            for (int d = 0; d < D; d++) chunk[d * 32 + j - c0] = row ? row[d] : 0;
        }
    }
}

/* lanes (queries at p0 + lane) that may attend key j */
static inline __mmask16 allowed(int64_t j, int64_t p0, int64_t ctx) {
    if (j >= ctx) return 0;
    if (j <= p0) return 0xFFFF;
    return j - p0 >= 16 ? 0 : (__mmask16)(0xFFFFu << (j - p0));
}

/* raw scores of keys j .. j + 15 (K rows in place, the A tile) x the 16 queries (tiles 0, 1) into dst */
static inline void score_rows(const args_t *a, const uint16_t *kbase, int64_t j, float *dst) {
    if (j >= a->ctx) return; /* rows past the context: masked in block_max */
    const uint16_t *kr = kbase + (a->tab[j / a->bs] * a->bs + j % a->bs) * D;
    _tile_zero(2);
    TILE_LOAD(3, kr, 2 * D);
    _tile_dpbf16ps(2, 3, 0);
    TILE_LOAD(3, kr + 32, 2 * D);
    _tile_dpbf16ps(2, 3, 1);
    TILE_STORE(2, dst, 64);
}

/* The block's maximum (masking keys a lane may not attend: past the context or the lane's position),
   the running maximum m2 raised where it exceeds it by more than TAU, and the correction of l and of
   the accumulators (all ones, *rescale = 0: none). */
static __m512 block_max(float (*s)[16], int64_t rows, int64_t j0, int64_t p0, const args_t *a, __m512 *m2,
                        __m512 *l, int *rescale) {
    const __m512 low = _mm512_set1_ps(-3.0e38f), c2 = _mm512_set1_ps(a->c2);
    const int masked = j0 + rows > (p0 + 1 < a->ctx ? p0 + 1 : a->ctx);
    __m512 bm0 = low, bm1 = low;
    for (int64_t r = 0; r < rows; r += 2) {
        __m512 x0 = _mm512_load_ps(s[r]), x1 = _mm512_load_ps(s[r + 1]);
        if (masked) {
            x0 = _mm512_mask_mov_ps(low, allowed(j0 + r, p0, a->ctx), x0);
            x1 = _mm512_mask_mov_ps(low, allowed(j0 + r + 1, p0, a->ctx), x1);
            _mm512_store_ps(s[r], x0);
            _mm512_store_ps(s[r + 1], x1);
        }
        bm0 = _mm512_max_ps(bm0, x0);
        bm1 = _mm512_max_ps(bm1, x1);
    }
    const __m512 bm = _mm512_mul_ps(_mm512_max_ps(bm0, bm1), c2);
    const __mmask16 up = _mm512_cmp_ps_mask(bm, _mm512_add_ps(*m2, _mm512_set1_ps(TAU)), _CMP_GT_OQ);
    *rescale = up != 0;
    if (!up) return _mm512_set1_ps(1.0f);
    const __m512 mn = _mm512_mask_mov_ps(*m2, up, bm);
    const __m512 corr = exp2v(_mm512_sub_ps(*m2, mn));
    *l = _mm512_mul_ps(*l, corr);
    *m2 = mn;
    return corr;
}

/* O^T += V^T P^T for one chunk of 32 keys (V^T [64 dims][32 keys] at vc; weights pt[0 .. 16), their residuals
   at pt[KB / 2 ..]) into accumulator tiles 4 .. 7; tiles 0 .. 3 are overwritten */
static inline void chunk_pv(const uint16_t *vc, uint32_t (*pt)[16]) {
    TILE_LOAD(0, pt[0], 64);
    TILE_LOAD(1, pt[KB / 2], 64);
    TILE_LOAD(2, vc, 64);
    TILE_LOAD(3, vc + 16 * 32, 64);
    _tile_dpbf16ps(4, 2, 0);
    _tile_dpbf16ps(5, 3, 0);
    _tile_dpbf16ps(4, 2, 1);
    _tile_dpbf16ps(5, 3, 1);
    TILE_LOAD(2, vc + 32 * 32, 64);
    TILE_LOAD(3, vc + 48 * 32, 64);
    _tile_dpbf16ps(6, 2, 0);
    _tile_dpbf16ps(7, 3, 0);
    _tile_dpbf16ps(6, 2, 1);
    _tile_dpbf16ps(7, 3, 1);
}

/* Tile work deferred into a block's exponentials: the next block's scores (nsub groups of 16 rows from
   key j1, into nxt) and the previous block's weighted sum (chunks of 32 keys of V^T at vt, weights pt),
   each followed by reloading the queries (tiles 0, 1) it needs. */
typedef struct {
    const uint16_t *kbase, *vt, *vnext;
    uint32_t (*qt)[16][16];
    float (*nxt)[16];
    uint32_t (*pt)[16];
    int64_t j1, nsub, chunks, t, c;
} deferred_t;

static inline void reload_queries(uint32_t (*qt)[16][16]) {
    TILE_LOAD(0, qt[0], 64);
    TILE_LOAD(1, qt[1], 64);
}
static inline void defer_score(const args_t *a, deferred_t *w) {
    if (w->t < w->nsub) score_rows(a, w->kbase, w->j1 + 16 * w->t, w->nxt[16 * w->t]);
    w->t++;
}
static inline void defer_pv(deferred_t *w) {
    if (w->c >= w->chunks) return;
    chunk_pv(w->vt + 32 * D * w->c, w->pt + 16 * w->c);
    reload_queries(w->qt);
    w->c++;
}
static inline void defer_finish(const args_t *a, deferred_t *w) {
    while (w->c < w->chunks) defer_pv(w);
    while (w->t < w->nsub) defer_score(a, w);
}

/* The weights 2^(c2 s - m2) of rows s[0 .. rows) into pt (bf16 key pairs, the B layout), summed into
   l, with the deferred tile work spread between them (so the tile unit works while the vector units
   do) and the block after next's K rows and the next V^T prefetched into L1. */
static void block_weights(float (*s)[16], int64_t rows, const args_t *a, __m512 m2, __m512 *l, uint32_t (*pt)[16],
                          deferred_t *w) {
    const __m512 c2 = _mm512_set1_ps(a->c2);
    /* the upper halves of keys r, r + 1 interleaved (bf16 pairs) */
    const __m512i halves = _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17, 47, 15,
                                            45, 13, 43, 11, 41, 9, 39, 7, 37, 5, 35, 3, 33, 1);
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r += 2) {
        if ((r & 15) == 0) defer_score(a, w);
        if ((r & 15) == 8) defer_pv(w);
        if (w->j1 + KB + r + 1 < a->ctx) {
            const int64_t j = w->j1 + KB + r;
            const char *kr = (const char *)(w->kbase + (a->tab[j / a->bs] * a->bs + j % a->bs) * D);
            for (int o = 0; o < 256; o += 64) _mm_prefetch(kr + o, _MM_HINT_T0);
        }
        if (w->j1 + r < a->ctx)
            for (int o = 0; o < 256; o += 64) _mm_prefetch((const char *)(w->vnext + r * D) + o, _MM_HINT_T0);
        const __m512 p0v = exp2v(_mm512_fmsub_ps(_mm512_load_ps(s[r]), c2, m2));
        const __m512 p1v = exp2v(_mm512_fmsub_ps(_mm512_load_ps(s[r + 1]), c2, m2));
        sum0 = _mm512_add_ps(sum0, p0v);
        sum1 = _mm512_add_ps(sum1, p1v);
        /* P = hi + lo: hi the upper half of each float32 (exact), lo the rest (rounded toward zero) */
        const __m512 lo0 = _mm512_sub_ps(p0v, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(p0v), top))),
                     lo1 = _mm512_sub_ps(p1v, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(p1v), top)));
        _mm512_store_si512(pt[r / 2], _mm512_permutex2var_epi16(_mm512_castps_si512(p0v), halves, _mm512_castps_si512(p1v)));
        _mm512_store_si512(pt[KB / 2 + r / 2],
                           _mm512_permutex2var_epi16(_mm512_castps_si512(lo0), halves, _mm512_castps_si512(lo1)));
    }
    defer_finish(a, w);
    *l = _mm512_add_ps(*l, _mm512_add_ps(sum0, sum1));
}

static inline int64_t block_rows(int64_t j0, int64_t limit) { /* score rows of the block at j0 */
    const int64_t nk = limit - j0 < KB ? limit - j0 : KB;
    return j0 < limit ? (nk + 31) / 32 * 32 : 0;
}

static inline void store_acc(float (*ob)[16]) { /* accumulator tiles <-> ob [64 dims][16 queries] */
    TILE_STORE(4, ob[0], 64); TILE_STORE(5, ob[16], 64); TILE_STORE(6, ob[32], 64); TILE_STORE(7, ob[48], 64);
    BARRIER(0);
}
static inline void load_acc(float (*ob)[16]) {
    BARRIER(0);
    TILE_LOAD(4, ob[0], 64); TILE_LOAD(5, ob[16], 64); TILE_LOAD(6, ob[32], 64); TILE_LOAD(7, ob[48], 64);
}

/* 16 queries i0 .. of head h: block after block of 64 keys, block b's scores computed during block
   b - 1's exponentials and its weighted sum during block b + 1's (or at once where block b + 1 rescales) */
static void attend_unit(const args_t *a, int64_t h, int64_t i0) {
    uint32_t qt[2][16][16] __attribute__((aligned(64)));
    float s[2][KB][16] __attribute__((aligned(64)));
    uint32_t pt[2][KB][16] __attribute__((aligned(64))); /* weights, then their residuals */
    float ob[D][16] __attribute__((aligned(64)));
    const int64_t nq = a->n - i0 < 16 ? a->n - i0 : 16, p0 = a->q_start + i0, kh = h / a->group;
    memset(qt, 0, sizeof qt);
    for (int64_t lane = 0; lane < nq; lane++) {
        const uint32_t *w = (const uint32_t *)(a->q + (i0 + lane) * a->qs + h * D);
        for (int sl = 0; sl < 2; sl++)
            for (int k = 0; k < 16; k++) qt[sl][k][lane] = w[16 * sl + k];
    }
    const uint16_t *kbase = a->k + kh * a->nb * a->bs * D, *vt = a->vt + kh * D * a->lps;
    const int64_t limit = a->ctx < p0 + 16 ? a->ctx : p0 + 16;
    __m512 m2 = _mm512_set1_ps(-1.0e30f), l = _mm512_setzero_ps();
    BARRIER(0);
    reload_queries(qt);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t t = 0; t < block_rows(0, limit) / 16; t++) score_rows(a, kbase, 16 * t, s[0][16 * t]);
    deferred_t w = {kbase, vt, vt, qt, s[1], pt[1], 0, 0, 0, 0, 0}; /* nothing pending */
    for (int64_t j0 = 0, b = 0; j0 < limit; j0 += KB, b++) {
        const int64_t rows = block_rows(j0, limit);
        BARRIER(0);
        int rescale;
        const __m512 corr = block_max(s[b & 1], rows, j0, p0, a, &m2, &l, &rescale);
        if (rescale && j0 > 0) { /* the previous block's weighted sum first, then the correction */
            while (w.c < w.chunks) defer_pv(&w);
            store_acc(ob);
            for (int d = 0; d < D; d++) _mm512_store_ps(ob[d], _mm512_mul_ps(_mm512_load_ps(ob[d]), corr));
            load_acc(ob);
        }
        w.nxt = s[(b + 1) & 1];
        w.j1 = j0 + KB;
        w.nsub = block_rows(j0 + KB, limit) / 16;
        w.vnext = vt + (j0 + KB) * D;
        w.t = 0;
        block_weights(s[b & 1], rows, a, m2, &l, pt[b & 1], &w);
        BARRIER(0);
        w.vt = vt + j0 * D; /* this block's weighted sum: during the next one's exponentials */
        w.pt = pt[b & 1];
        w.chunks = rows / 32;
        w.c = 0;
    }
    while (w.c < w.chunks) defer_pv(&w);
    store_acc(ob);
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
    args_t a = {q, k, v, tab, NULL, out, qs, os, n, q_start, ctx, heads, heads / kvh, nb, bs, lp,
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
