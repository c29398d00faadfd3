/* The prefill flash-attention kernel for AVX-512 CPUs with bf16 dot products but no AMX (AMD Zen 4/5,
   Intel Cooper Lake): kvbalance/model/native_prefill.py loads it where the AMX kernel does not run, with
   the same entry point and arguments. Its code is in only where the target has AVX-512F and AVX512-BF16
   (avx512_bf16_available() also asks the CPU); elsewhere the entry point returns -2.

   Measured on the AMD EPYC (Zen 4) development machine, one thread: torch's SDPA (what the engine ran
   here) reached 32-42 GFLOP/s on SmolLM2's prefill chunks (bf16, head dim 64, causal), ~20% of a
   2,048-token prefill step of 256-token prompts and ~44% of one of 1,024-token prompts, against ~230
   GFLOP/s of bf16 dot products the core can do.

   FlashAttention-2 (Dao 2023) over the paged cache, with the work laid out for 32 zmm registers:
   - Rows: a kv head's (position, query head) pairs in position-major order; a tile is QR = 6 of them (two
     positions of a GQA group of 3 in SmolLM2), so the tile's rows share every key they read.
   - K, transposed once per call: each kv head's keys 0 .. q_start + n - 1 (read through the block table)
     are laid out as [64-key step][32 dim pairs][64 keys] 32-bit pairs, zero past the context: one scratch
     per kv head, shared by every tile of it.
   - Scores S [6 rows x 64 keys]: 24 float32 accumulators; per dim pair, the 4 vectors of 16 keys' pairs
     meet each row's broadcast query pair in vdpbf16ps (two bf16 x bf16 products, exact in float32, added
     to a float32 accumulator), so a score is a float32 sum of exact products, as on AMX.
   - Online softmax per row in base 2 (2^(scale log2(e) s), the AMX kernel's degree-5 polynomial and
     vscalefps), causal mask by lane, the running maximum raised (and the accumulator rescaled) only when
     a step's maximum exceeds it; the weights stay float32.
   - Weighted values O [6 rows x 64 dims] += P V in float32 FMAs: each V row (read in place from the
     cache) is widened once into registers in "paired" order (even and odd dims of each 32-dim half: one
     64-byte load, a shift and a mask) and meets the 6 rows' weights; the weights are not rounded (rounded
     once to bf16, as torch does, they flipped a greedy token of the real SmolLM2 on the AMX kernel).
   - The output is normalised and rounded to bf16 once. Tiles are independent (OpenMP over them, the
     costliest first), so any thread count gives the same bits. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#define D 64
#define DPAIRS 32 /* dim pairs of a row */
#define KB 64     /* keys per step: 4 vectors of 16 */
#define QR 6      /* rows (position, query head) per tile */

#if defined(__AVX512F__) && defined(__AVX512BF16__)
int avx512_bf16_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
}


#include "exp2_avx512.h"

typedef struct {
    const uint16_t *q, *k, *v;
    const int64_t *tab;
    uint32_t *kt; /* [kvh][steps][DPAIRS][KB] */
    uint16_t *out;
    int64_t qs, os, n, q_start, ctx, heads, kvh, group, nb, bs, steps;
    float c2; /* scale * log2(e) */
} args_t;

static inline const uint16_t *cache_row(const args_t *a, const uint16_t *base, int64_t kh, int64_t j) {
    return base + ((kh * a->nb + a->tab[j / a->bs]) * a->bs + j % a->bs) * D;
}

/* kv head kh's keys of step s into the transposed scratch (zero past the context): 32 stores a key,
   ~1 ms of a 2,048-token step's 30 layers */
static void transpose_k(const args_t *a, int64_t kh, int64_t s) {
    uint32_t *dst = a->kt + (kh * a->steps + s) * DPAIRS * KB;
    for (int64_t t = 0; t < KB; t++) {
        const int64_t j = s * KB + t;
        const uint32_t *row = j < a->ctx ? (const uint32_t *)cache_row(a, a->k, kh, j) : NULL;
        for (int dp = 0; dp < DPAIRS; dp++) dst[dp * KB + t] = row ? row[dp] : 0u;
    }
}

/* one tile: rows r0 .. r0 + nr - 1 of kv head kh (row r: position r / group, query head kh * group + r % group) */
static void attend_tile(const args_t *a, int64_t kh, int64_t r0, int64_t nr) {
    const uint32_t *qp[QR];
    int64_t pos[QR];
    for (int r = 0; r < QR; r++) {
        const int64_t row = r0 + (r < nr ? r : nr - 1); /* past the last row: repeat it, result dropped */
        const int64_t i = row / a->group, h = kh * a->group + row % a->group;
        qp[r] = (const uint32_t *)(a->q + i * a->qs + h * D);
        pos[r] = a->q_start + i;
    }
    float o[QR][D] __attribute__((aligned(64))); /* accumulators, paired order */
    float p[QR][KB] __attribute__((aligned(64))); /* this step's weights */
    float m[QR], l[QR];
    for (int r = 0; r < QR; r++) {
        memset(o[r], 0, sizeof o[r]);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t last = pos[QR - 1] > pos[0] ? pos[QR - 1] : pos[0];
    const __m512 c2 = _mm512_set1_ps(a->c2), floor2 = _mm512_set1_ps(-200.0f);
    for (int64_t s = 0; s * KB <= last; s++) {
        const uint32_t *kt = a->kt + (kh * a->steps + s) * DPAIRS * KB;
        __m512 acc[QR][4];
        for (int r = 0; r < QR; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 2
        for (int dp = 0; dp < DPAIRS; dp++) {
            __m512bh kv[4];
            for (int c = 0; c < 4; c++) kv[c] = (__m512bh)_mm512_loadu_si512(kt + dp * KB + 16 * c);
            for (int r = 0; r < QR; r++) {
                const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qp[r][dp]);
                for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], kv[c], qb);
            }
        }
        /* online softmax per row, base 2; lanes past the row's position (or the context) weigh 0 */
        const int64_t j0 = s * KB;
        for (int r = 0; r < QR; r++) {
            __mmask16 ok[4];
            __m512 x[4], mx = _mm512_set1_ps(-INFINITY);
            for (int c = 0; c < 4; c++) {
                const int64_t allowed = pos[r] - (j0 + 16 * c) + 1;
                ok[c] = allowed >= 16 ? (__mmask16)0xFFFF : allowed <= 0 ? 0 : (__mmask16)((1u << allowed) - 1);
                x[c] = _mm512_mul_ps(acc[r][c], c2);
                mx = _mm512_mask_max_ps(mx, ok[c], mx, x[c]);
            }
            const float bm = _mm512_reduce_max_ps(mx), mn = bm > m[r] ? bm : m[r];
            if (mn > m[r]) { /* a new maximum: rescale what was accumulated (a no-op on the first step) */
                const float cf = m[r] == -INFINITY ? 0.0f : exp2v(_mm512_set1_ps(m[r] - mn))[0];
                const __m512 cv = _mm512_set1_ps(cf);
                for (int c = 0; c < 4; c++) _mm512_store_ps(o[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(o[r] + 16 * c), cv));
                l[r] *= cf;
                m[r] = mn;
            }
            const __m512 mv = _mm512_set1_ps(mn);
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < 4; c++) {
                const __m512 w = _mm512_maskz_mov_ps(ok[c], exp2v(_mm512_max_ps(_mm512_sub_ps(x[c], mv), floor2)));
                sum = _mm512_add_ps(sum, w);
                _mm512_store_ps(p[r] + 16 * c, w);
            }
            l[r] += _mm512_reduce_add_ps(sum);
        }
        /* weighted values: the step's V rows (those in the context) widened once, 6 rows of weights each */
        __m512 ov[QR][4];
        for (int r = 0; r < QR; r++)
            for (int c = 0; c < 4; c++) ov[r][c] = _mm512_load_ps(o[r] + 16 * c);
        const int64_t keys = a->ctx - j0 < KB ? a->ctx - j0 : KB;
        const int64_t upto = last - j0 + 1 < keys ? last - j0 + 1 : keys;
        for (int64_t t = 0; t < upto; t++) {
            const uint16_t *vr = cache_row(a, a->v, kh, j0 + t);
            __m512 vv[4];
            for (int h = 0; h < 2; h++) {
                const __m512i w = _mm512_loadu_si512(vr + 32 * h);
                vv[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
                vv[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
            }
            for (int r = 0; r < QR; r++) {
                const __m512 pw = _mm512_set1_ps(p[r][t]);
                for (int c = 0; c < 4; c++) ov[r][c] = _mm512_fmadd_ps(pw, vv[c], ov[r][c]);
            }
        }
        for (int r = 0; r < QR; r++)
            for (int c = 0; c < 4; c++) _mm512_store_ps(o[r] + 16 * c, ov[r][c]);
    }
    /* normalise, back to natural dim order, round to bf16 once */
    for (int r = 0; r < nr; r++) {
        const int64_t row = r0 + r, i = row / a->group, h = kh * a->group + row % a->group;
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        uint16_t *dst = a->out + i * a->os + h * D;
        for (int hh = 0; hh < 2; hh++) {
            const __m512 ev = _mm512_mul_ps(_mm512_load_ps(o[r] + 32 * hh), inv);
            const __m512 od = _mm512_mul_ps(_mm512_load_ps(o[r] + 32 * hh + 16), inv);
            /* dims 32hh + 2i (even) and + 2i + 1 (odd) -> one bf16 pair per lane */
            const __m256i e16 = (__m256i)_mm512_cvtneps_pbh(ev), o16 = (__m256i)_mm512_cvtneps_pbh(od);
            const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(e16),
                                                 _mm512_slli_epi32(_mm512_cvtepu16_epi32(o16), 16));
            _mm512_storeu_si512(dst + 32 * hh, pair);
        }
    }
}

int paged_prefill_attention(const uint16_t *q, int64_t qs, const uint16_t *k, const uint16_t *v,
                            const int64_t *tab, uint16_t *out, int64_t os, int64_t n, int64_t q_start,
                            int64_t heads, int64_t kvh, int64_t nb, int64_t bs, float scale, int threads) {
    const int64_t ctx = q_start + n, steps = (ctx + KB - 1) / KB;
    args_t a = {q, k, v, tab, NULL, out, qs, os, n, q_start, ctx, heads, kvh, heads / kvh, nb, bs, steps,
                scale * 1.4426950408889634f};
    a.kt = aligned_alloc(64, (size_t)(kvh * steps * DPAIRS * KB * 4));
    if (a.kt == NULL) return -1;
    const int64_t rows = n * a.group, tiles = (rows + QR - 1) / QR;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < kvh * steps; u++) transpose_k(&a, u / steps, u % steps);
        /* the costliest tiles (last positions) first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < kvh * tiles; u++) {
            const int64_t kh = u % kvh, t = tiles - 1 - u / kvh;
            attend_tile(&a, kh, t * QR, rows - t * QR < QR ? rows - t * QR : QR);
        }
    }
    free(a.kt);
    return 0;
}
#else
int avx512_bf16_available(void) { return 0; }
int paged_prefill_attention(const uint16_t *q, int64_t qs, const uint16_t *k, const uint16_t *v,
                            const int64_t *tab, uint16_t *out, int64_t os, int64_t n, int64_t q_start,
                            int64_t heads, int64_t kvh, int64_t nb, int64_t bs, float scale, int threads) {
    return -2; /* not built for AVX512-BF16 */
}
#endif
