/* The paged decode-attention kernel for CPUs with AVX2 and FMA but no AVX-512, compiled into the library
   with decode_attention.c; its code is in only where the target is AVX2 + FMA without AVX-512F.

   The portable kernel (decode_attention.c) keeps a GQA group's queries, its output accumulators and 16
   keys' partial dot products in 16-float vectors: 32 registers' worth and more on AVX-512, but on a
   16-register AVX2 core most of that lives on the stack. Measured on the AMD EPYC (Zen 3) development
   machine, one thread, float32 cache, SmolLM2's shape (3 KV heads of 64, groups of 3), 64 sequences x
   300 keys: it read K/V at 2.3 GB/s, and 3.2 GB/s with the cache mostly in L3: bound by its own spills,
   not by memory.

   This kernel is laid out for 16 ymm registers, per (sequence, KV head) and block of keys:
   - Scores: the group's scaled queries stay in L1 (qs) and are FMA memory operands; one key's row is read
     8 floats at a time, each chunk meeting up to 8 query heads (one accumulator each). Eight keys' partial
     vectors are then reduced together (two hadd levels and a cross-lane add) into one vector of 8 scores.
   - Softmax: online, per block: the portable kernel's block_softmax.
   - Weighted values: the output accumulators live in L1 (acc) between blocks; within a block, 2 chunks x
     up to 4 heads of them (8 registers) run over the block's V rows (in L1/L2 by then), the weights
     broadcast from the score buffer.
   - Prefetch: while a block is scored and weighted, the next block's K and V rows are prefetched into L2,
     row by row (blocks are scattered, so the hardware prefetcher stops at each). Each thread runs a
     contiguous run of (sequence, head) units of about equal keys, in order, so a unit's last block
     prefetches the next unit's first. */
#include "decode_attention.h"

/* -DNO_AVX2_KERNEL=1 leaves it out (benchmarks/bench_decode_attention.py --avx2 times it against the
   portable kernel compiled for the same target) */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !NO_AVX2_KERNEL
int attention_avx2(void) { return 1; }
#include <immintrin.h>
#include <immintrin.h>
#define D8 (D / 8) /* 8-float chunks of a row */
#define GS 8       /* query heads scored together */
#define GV 4       /* query heads weighted together */
#define JV 2       /* 8-float chunks weighted together */

static inline __m256 load8_kv(const kv_t *p) {
#if KV_BF16
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#else
    return _mm256_loadu_ps(p);
#endif
}

/* p[0..7] -> the vector of their 8 lane sums */
static inline __m256 reduce8(const __m256 *p) {
    __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
    __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(p[4], p[5]), _mm256_hadd_ps(p[6], p[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

static void attend_head_avx2(const io_t *restrict qh, const kv_t *restrict k, const kv_t *restrict v,
                             const int64_t *restrict tab, int64_t n_ctx, int64_t BS, float scale,
                             io_t *restrict oh, const kv_t *after_k, const kv_t *after_v) {
    float qs[GROUP * D] __attribute__((aligned(64))); /* scaled queries */
    float acc[GROUP * D] __attribute__((aligned(64))); /* weighted sums of values */
    float m[GROUP], l[GROUP];
    float s[GROUP][MAX_BS + 16] __attribute__((aligned(64))); /* this block's scores, then weights */
    for (int i = 0; i < GROUP * D; i += 16) {
        store(qs + i, load_io(qh + i) * splat(scale));
        store(acc + i, splat(0.0f));
    }
    for (int g = 0; g < GROUP; g++) {
        m[g] = -3.0e38f;
        l[g] = 0.0f;
    }
    const int64_t n_blocks = (n_ctx + BS - 1) / BS, row_bytes = D * (int64_t)sizeof(kv_t);
    for (int64_t blk = 0; blk < n_blocks; blk++) {
        const int64_t n = n_ctx - blk * BS < BS ? n_ctx - blk * BS : BS;
        const kv_t *kb = k + tab[blk] * BS * D, *vb = v + tab[blk] * BS * D;
        /* the next block's rows are prefetched meanwhile: after the last, the next unit's first block */
        const int64_t next = tab[blk + 1 < n_blocks ? blk + 1 : blk] * BS * D;
        const int last = blk + 1 == n_blocks && after_k;
        const char *nk = (const char *)(last ? after_k : k + next), *nv = (const char *)(last ? after_v : v + next);
        /* scores, 8 keys at a time (keys past n score 0 here; the softmax masks them) */
        for (int64_t t = 0; t < n; t += 8) {
            const int cnt = n - t < 8 ? (int)(n - t) : 8;
            for (int g0 = 0; g0 < GROUP; g0 += GS) {
                __m256 part[GS][8];
                for (int u = 0; u < 8; u++) {
                    __m256 a[GS];
#pragma GCC unroll 8
                    for (int gi = 0; gi < GS; gi++) a[gi] = _mm256_setzero_ps();
                    if (u < cnt) {
                        const kv_t *kt = kb + (t + u) * D;
                        if (g0 == 0)
                            for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(nk + (t + u) * row_bytes + off, 0, 1);
#pragma GCC unroll 16
                        for (int j = 0; j < D8; j++) {
                            const __m256 kj = load8_kv(kt + 8 * j);
#pragma GCC unroll 8
                            for (int gi = 0; gi < GS; gi++)
                                if (g0 + gi < GROUP)
                                    a[gi] = _mm256_fmadd_ps(kj, _mm256_load_ps(qs + (g0 + gi) * D + 8 * j), a[gi]);
                        }
                    }
#pragma GCC unroll 8
                    for (int gi = 0; gi < GS; gi++) part[gi][u] = a[gi];
                }
#pragma GCC unroll 8
                for (int gi = 0; gi < GS; gi++)
                    if (g0 + gi < GROUP) _mm256_store_ps(s[g0 + gi] + t, reduce8(part[gi]));
            }
        }
        /* online softmax: new running max, rescale what was accumulated, weights e^(s - max) */
        for (int g = 0; g < GROUP; g++) {
            const float c = block_softmax(s[g], n, &m[g], &l[g]);
            if (c != 1.0f)
                for (int j = 0; j < D; j += 16) store(acc + g * D + j, load(acc + g * D + j) * splat(c));
        }
        /* weighted values: 2 chunks x up to 4 heads of accumulators at a time over the block's rows */
        for (int g0 = 0; g0 < GROUP; g0 += GV)
            for (int j0 = 0; j0 < D8; j0 += JV) {
                __m256 o[GV][JV];
#pragma GCC unroll 4
                for (int gi = 0; gi < GV; gi++)
#pragma GCC unroll 2
                    for (int jj = 0; jj < JV; jj++)
                        o[gi][jj] = g0 + gi < GROUP ? _mm256_load_ps(acc + (g0 + gi) * D + 8 * (j0 + jj)) : _mm256_setzero_ps();
                for (int64_t i = 0; i < n; i++) {
                    const kv_t *vt = vb + i * D + 8 * j0;
                    if (g0 == 0 && j0 == 0)
                        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(nv + i * row_bytes + off, 0, 1);
                    __m256 vv[JV];
#pragma GCC unroll 2
                    for (int jj = 0; jj < JV; jj++) vv[jj] = load8_kv(vt + 8 * jj);
#pragma GCC unroll 4
                    for (int gi = 0; gi < GV; gi++)
                        if (g0 + gi < GROUP) {
                            const __m256 p = _mm256_broadcast_ss(s[g0 + gi] + i);
#pragma GCC unroll 2
                            for (int jj = 0; jj < JV; jj++) o[gi][jj] = _mm256_fmadd_ps(p, vv[jj], o[gi][jj]);
                        }
                }
#pragma GCC unroll 4
                for (int gi = 0; gi < GV; gi++)
                    if (g0 + gi < GROUP)
#pragma GCC unroll 2
                        for (int jj = 0; jj < JV; jj++) _mm256_store_ps(acc + (g0 + gi) * D + 8 * (j0 + jj), o[gi][jj]);
            }
    }
    for (int g = 0; g < GROUP; g++) {
        const vf inv = splat(1.0f / l[g]);
        for (int j = 0; j < D; j += 16) store_io(oh + g * D + j, load(acc + g * D + j) * inv);
    }
}
/* the units (sequence, KV head) in order, each thread a contiguous run of about equal keys, so each unit's
   last block prefetches the next unit's first */
int decode_attention_avx2(const io_t *restrict q, const kv_t *restrict k, const kv_t *restrict v,
                          const int64_t *restrict table, const int64_t *restrict ctx, io_t *restrict out,
                          int64_t B, int64_t KVH, int64_t NB, int64_t BS, int64_t MAXB, float scale,
                          int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        int64_t u0, u1;
        thread_units(ctx, B, KVH, &u0, &u1);
        for (int64_t u = u0; u < u1; u++) {
            const int64_t b = u / KVH, h = u % KVH;
            const kv_t *ak = 0, *av = 0;
            if (u + 1 < u1) {
                const int64_t nb = (u + 1) / KVH, nh = (u + 1) % KVH, first = table[nb * MAXB] * BS * D;
                ak = k + nh * NB * BS * D + first;
                av = v + nh * NB * BS * D + first;
            }
            attend_head_avx2(q + u * GROUP * D, k + h * NB * BS * D, v + h * NB * BS * D, table + b * MAXB, ctx[b],
                             BS, scale, out + u * GROUP * D, ak, av);
        }
    }
    return 0;
}
#else
int attention_avx2(void) { return 0; }
int decode_attention_avx2(const io_t *restrict q, const kv_t *restrict k, const kv_t *restrict v,
                          const int64_t *restrict table, const int64_t *restrict ctx, io_t *restrict out,
                          int64_t B, int64_t KVH, int64_t NB, int64_t BS, int64_t MAXB, float scale,
                          int nthreads) {
    return -1; /* not an AVX2-without-AVX-512 build */
}
#endif
