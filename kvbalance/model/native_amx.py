"""C source of the AMX path of the paged decode-attention kernel (bf16 queries and cache).

Appended to :data:`kvbalance.model.native_src.SOURCE` when the compiler knows AMX (``-DHAVE_AMX=1``)
and called only where the CPU has it (``amx_available()``: cpuid and the kernel's permission for
tile data). The scores ``K q^T`` of 16 keys x the GQA group are one AMX tile product per 32 dims
(``tdpbf16ps``: bf16 x bf16 products, exact in float32, summed in float32), read straight from the
cache rows (a 16-row tile load with the row stride), so the score phase costs no vector work: no
widening of K and no 16-lane reductions. The online softmax runs over windows of up to 256 keys
(several blocks) on the scores as the tile stores them, key-major ``[key][group]``, and the weighted
sum of V stays in float32 vector registers as in the portable path (weights are never rounded).
"""

AMX_SOURCE = r"""
#if HAVE_AMX && KV_BF16 && IO_BF16 && (D == 32 || D == 64 || D == 128)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_PATH 1
/* tile numbers are literals (the intrinsics name the register in the assembly) */
#define NH (D / 32) /* 32-dim slices of a row: one B tile (q^T) each, tiles 0 .. NH-1 */
#define TA0 4       /* two A tiles (16 cache rows of one slice) */
#define TA1 5
#define TC0 6 /* two C tiles (16 keys x GROUP scores) */
#define TC1 7
#define WIN 256 /* keys per softmax window */
#ifndef PF_NEXT
#define PF_NEXT 1
#endif
#ifndef PF_V
#define PF_V 1
#endif

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

int amx_available(void) {
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512f")) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

static void amx_configure(void) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = (t >= NH && t < TC0) ? 64 : 4 * GROUP; /* A tiles: 16 rows x 32 bf16 */
    }
    /* not _tile_loadconfig: GCC 12's macro tells the compiler it reads 8 bytes, so it drops the rest */
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

/* raw scores of 16 keys (rows k0[0..15]) and of rows k1 into s0, s1 ([16][GROUP] floats each); each
   chunk slice has its own A tile (4, 5 for slice 0; 2, 3 for slice 1: loads need not wait for the
   products still reading a tile) */
static inline void qk_pair(const uint16_t *k0, const uint16_t *k1, float *s0, float *s1) {
    _tile_zero(TC0);
    _tile_zero(TC1);
    _tile_loadd(TA0, k0, 2 * D);
    _tile_loadd(TA1, k1, 2 * D);
#if NH == 2
    _tile_loadd(2, k0 + 32, 2 * D);
    _tile_loadd(3, k1 + 32, 2 * D);
#endif
    _tile_dpbf16ps(TC0, TA0, 0);
    _tile_dpbf16ps(TC1, TA1, 0);
#if NH == 2
    _tile_dpbf16ps(TC0, 2, 1);
    _tile_dpbf16ps(TC1, 3, 1);
#endif
#if NH == 4
    _tile_loadd(TA0, k0 + 32, 2 * D);
    _tile_loadd(TA1, k1 + 32, 2 * D);
    _tile_dpbf16ps(TC0, TA0, 1);
    _tile_dpbf16ps(TC1, TA1, 1);
    _tile_loadd(TA0, k0 + 64, 2 * D);
    _tile_loadd(TA1, k1 + 64, 2 * D);
    _tile_dpbf16ps(TC0, TA0, 2);
    _tile_dpbf16ps(TC1, TA1, 2);
    _tile_loadd(TA0, k0 + 96, 2 * D);
    _tile_loadd(TA1, k1 + 96, 2 * D);
    _tile_dpbf16ps(TC0, TA0, 3);
    _tile_dpbf16ps(TC1, TA1, 3);
#endif
    _tile_stored(TC0, s0, 4 * GROUP);
    _tile_stored(TC1, s1, 4 * GROUP);
}

static inline __m512 as_m(vf x) { __m512 y; memcpy(&y, &x, sizeof y); return y; }
static inline vf as_v(__m512 x) { vf y; memcpy(&y, &x, sizeof y); return y; }

/* Online softmax over one window's scores s ([n16][GROUP], keys >= n already -inf): new running
   maxima m, weights e^(scale (s - m)) in place, sums l, and each group's correction c. The scores
   vector i holds group (16 i + lane) % GROUP in each lane: GROUP vectors repeat the pattern. */
static void window_softmax(float *s, int64_t n16, float scale, float *m, float *l, float *c) {
    const int64_t nv = n16 * GROUP / 16;
    __mmask16 mask[GROUP][GROUP];
    for (int r = 0; r < GROUP; r++)
        for (int g = 0; g < GROUP; g++) {
            unsigned bits = 0;
            for (int j = 0; j < 16; j++) bits |= (unsigned)((16 * r + j) % GROUP == g) << j;
            mask[r][g] = (__mmask16)bits;
        }
    __m512 mx[GROUP], sm[GROUP], sum[GROUP];
    for (int r = 0; r < GROUP; r++) mx[r] = _mm512_set1_ps(-3.0e38f);
    for (int64_t i = 0; i < nv; i += GROUP)
        for (int r = 0; r < GROUP; r++) mx[r] = _mm512_max_ps(mx[r], _mm512_loadu_ps(s + 16 * (i + r)));
    for (int g = 0; g < GROUP; g++) {
        float bm = m[g];
        for (int r = 0; r < GROUP; r++) {
            const float x = _mm512_mask_reduce_max_ps(mask[r][g], mx[r]);
            bm = x > bm ? x : bm;
        }
        c[g] = vexp(splat(scale * (m[g] - bm)))[0];
        m[g] = bm;
    }
    for (int r = 0; r < GROUP; r++) {
        sm[r] = _mm512_setzero_ps();
        for (int g = 0; g < GROUP; g++) sm[r] = _mm512_mask_mov_ps(sm[r], mask[r][g], _mm512_set1_ps(scale * m[g]));
        sum[r] = _mm512_setzero_ps();
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < nv; i += GROUP)
        for (int r = 0; r < GROUP; r++) {
            float *p = s + 16 * (i + r);
            const __m512 w = as_m(vexp(as_v(_mm512_fmsub_ps(_mm512_loadu_ps(p), sc, sm[r]))));
            _mm512_storeu_ps(p, w);
            sum[r] = _mm512_add_ps(sum[r], w);
        }
    for (int g = 0; g < GROUP; g++) {
        float t = 0.0f;
        for (int r = 0; r < GROUP; r++) t += _mm512_mask_reduce_add_ps(mask[r][g], sum[r]);
        l[g] = l[g] * c[g] + t;
    }
}

/* One (sequence, KV head) as attend_head, for a bf16 cache and queries, BS a multiple of 16. */
/* The keys a window spans: blocks tab[0 ..] of the head's cache k, v; n keys (0: none). */
typedef struct {
    const kv_t *k, *v;
    const int64_t *tab;
    int64_t n;
} span_t;

/* Prefetches the next window's K and V into L2 one row per weighted row, so the memory system works
   on the next window while this one is summed (blocks are scattered: the hardware prefetcher stops
   at each). */
typedef struct {
    span_t span;
    int64_t blk, row, left;
    const char *kb, *vb;
} prefetcher_t;
static inline void prefetcher_start(prefetcher_t *p, span_t span, int64_t BS) {
    p->span = span;
    p->blk = p->row = 0;
    p->left = span.n;
    if (span.n > 0) {
        p->kb = (const char *)(span.k + span.tab[0] * BS * D);
        p->vb = (const char *)(span.v + span.tab[0] * BS * D);
    }
}
static inline void prefetcher_step(prefetcher_t *p, int64_t BS) {
    if (p->left <= 0) return;
    for (int64_t off = 0; off < 2 * D; off += 64) {
        __builtin_prefetch(p->kb + p->row * 2 * D + off, 0, 2);
        __builtin_prefetch(p->vb + p->row * 2 * D + off, 0, 2);
    }
    p->left--;
    if (++p->row == BS && p->left > 0) {
        p->row = 0;
        p->blk++;
        p->kb = (const char *)(p->span.k + p->span.tab[p->blk] * BS * D);
        p->vb = (const char *)(p->span.v + p->span.tab[p->blk] * BS * D);
    }
}

static void attend_head_amx(const io_t *restrict qh, const kv_t *restrict k, const kv_t *restrict v,
                            const int64_t *restrict tab, int64_t n_ctx, int64_t BS, float scale,
                            io_t *restrict oh, span_t next) {
    uint32_t qt[NH][16][GROUP] __attribute__((aligned(64))); /* q^T, pairs of dims (the B tiles) */
    float s[WIN + 32][GROUP] __attribute__((aligned(64)));
    vf acc[GROUP][NVEC];
    float m[GROUP], l[GROUP], c[GROUP];
    for (int g = 0; g < GROUP; g++) {
        for (int h = 0; h < NH; h++)
            for (int p = 0; p < 16; p++) memcpy(&qt[h][p][g], qh + g * D + 32 * h + 2 * p, 4);
        for (int j = 0; j < NVEC; j++) acc[g][j] = splat(0.0f);
        m[g] = -3.0e38f;
        l[g] = 0.0f;
    }
    _tile_loadd(0, qt[0], 4 * GROUP);
#if NH > 1
    _tile_loadd(1, qt[1], 4 * GROUP);
#endif
#if NH > 2
    _tile_loadd(2, qt[2], 4 * GROUP);
    _tile_loadd(3, qt[3], 4 * GROUP);
#endif
    const int64_t per_win = BS >= WIN ? 1 : WIN / BS, n_blocks = (n_ctx + BS - 1) / BS;
    for (int64_t b0 = 0; b0 < n_blocks; b0 += per_win) {
        const int64_t b1 = b0 + per_win < n_blocks ? b0 + per_win : n_blocks;
        const int64_t n = (b1 * BS < n_ctx ? b1 * BS : n_ctx) - b0 * BS, n16 = (n + 15) & ~(int64_t)15;
        /* scores: 16-key chunks in pairs (a chunk never crosses a block: BS % 16 == 0) */
        for (int64_t t = 0; t < n16; t += 32) {
            const kv_t *k0 = k + tab[b0 + t / BS] * BS * D + (t % BS) * D;
            const int64_t t1 = t + 16 < n16 ? t + 16 : t;
            const kv_t *k1 = k + tab[b0 + t1 / BS] * BS * D + (t1 % BS) * D;
            qk_pair(k0, k1, s[t], s[t + 16]);
#if PF_V /* the V rows of these keys, for the weighted sum after the softmax */
            const char *v0 = (const char *)(v + (k0 - k)), *v1 = (const char *)(v + (k1 - k));
            for (int64_t off = 0; off < 32 * D; off += 64) {
                __builtin_prefetch(v0 + off, 0, 3);
                __builtin_prefetch(v1 + off, 0, 3);
            }
#endif
        }
        for (int64_t u = n; u < n16; u++)
            for (int g = 0; g < GROUP; g++) s[u][g] = -3.0e38f;
        window_softmax(&s[0][0], n16, scale, m, l, c);
        for (int g = 0; g < GROUP; g++)
            if (c[g] != 1.0f)
                for (int j = 0; j < NVEC; j++) acc[g][j] *= splat(c[g]);
        /* weighted values, block by block, prefetching the next window (this head's or the next's) */
        prefetcher_t pf;
        if (b1 < n_blocks) {
            const span_t more = {k, v, tab + b1, n_ctx - b1 * BS < per_win * BS ? n_ctx - b1 * BS : per_win * BS};
            prefetcher_start(&pf, more, BS);
        } else {
            if (next.n > per_win * BS) next.n = per_win * BS;
            prefetcher_start(&pf, next, BS);
        }
        for (int64_t blk = b0; blk < b1; blk++) {
            const kv_t *vb = v + tab[blk] * BS * D;
            const int64_t base = (blk - b0) * BS, rows = n - base < BS ? n - base : BS;
            for (int64_t i = 0; i < rows; i++) {
                vf vr[NVEC];
                if (PF_NEXT) prefetcher_step(&pf, BS);
                load_row(vb + i * D, vr);
                for (int g = 0; g < GROUP; g++) {
                    const vf p = splat(s[base + i][g]);
                    for (int j = 0; j < NVEC; j++) acc[g][j] += p * vr[j];
                }
            }
        }
    }
    float row[D] __attribute__((aligned(64)));
    for (int g = 0; g < GROUP; g++) {
        const vf inv = splat(1.0f / l[g]);
        for (int j = 0; j < NVEC; j++) acc[g][j] *= inv;
        from_row_order(acc[g], row);
        for (int j = 0; j < NVEC; j++) store_io(oh + g * D + 16 * j, load(row + 16 * j));
    }
}
#else
#define AMX_PATH 0
int amx_available(void) { return 0; }
#endif
"""
