/* An AMX bf16 GEMM for the decode step's linears, y = x @ W^T (+ bias), over the plain row-major weight
   (kvbalance/model/amx_gemm.py explains the blocking and numerics and loads it). Needs AMX-BF16 and
   AVX512-BF16 (built with the compiler's AMX and AVX-512 flags; amx_available() says whether it runs). */
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


#include "amx.h"

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
