/* The AMX path of the paged decode-attention kernel (bf16 queries and cache), compiled into the
   library with decode_attention.c; its code is in only where the build says -DHAVE_AMX=1 (with the
   compiler's AMX flags) and the shape fits, and it runs only where the CPU has AMX (amx_available():
   cpuid, and the kernel's permission for tile data).

   The scores K q^T of 16 keys x the GQA group are one AMX tile product per 32 dims (tdpbf16ps: bf16 x
   bf16 products, exact in float32, summed in float32), read straight from the cache rows (a 16-row tile
   load with the row stride), so the score phase costs no vector work: no widening of K and no 16-lane
   reductions. The online softmax runs over windows of up to 256 keys (several blocks) on the scores as
   the tile stores them, key-major [key][group], and the weighted sum of V stays in float32 vector
   registers as in the portable path (weights are never rounded).

   Decode attention is memory-bound, so each thread runs its (sequence, head) units as one pipeline of
   windows: while window i is weighted (V rows, vector units), window i + 1 -- the same head's next keys
   or the next unit's first -- is scored 32 keys at a time (tile unit), and one prefetch stream per
   thread brings K and V rows into L2 up to 384 rows ahead of the weighted ones, across window and unit
   ends, so the memory system and both units stay busy across block and sequence boundaries. */
#include "decode_attention.h"

#if HAVE_AMX && KV_BF16 && IO_BF16 && (D == 32 || D == 64 || D == 128)
/* tile numbers are literals (the intrinsics name the register in the assembly) */
#define NH (D / 32) /* 32-dim slices of a row: one B tile (q^T) each, tiles 0 .. NH-1 */
#define TA0 4       /* two A tiles (16 cache rows of one slice) */
#define TA1 5
#define TC0 6 /* two C tiles (16 keys x GROUP scores) */
#define TC1 7
#define WIN 256 /* keys per softmax window */
/* tunables (measured with benchmarks/bench_decode_attention.py): rows (K and V) the thread's prefetch
   stream issues per weighted row, at most PF_LEAD rows ahead of the weighted rows; the scores of 32 keys of
   the next window computed every SCORE_EVERY + 1 (a power of two) weighted rows once SCORE_LAG rows are
   done (behind the prefetch) */
#ifndef PF_RATE
#define PF_RATE 3
#endif
#ifndef PF_LEAD
#define PF_LEAD 384
#endif
#ifndef SCORE_EVERY
#define SCORE_EVERY 31
#endif
#ifndef SCORE_LAG
#define SCORE_LAG 63
#endif
#include "amx.h"

int amx_available(void) { return amx_cpu_and_permission(0); }

static void amx_configure(void) {
    uint16_t colsb[8];
    for (int t = 0; t < 8; t++) colsb[t] = (t >= NH && t < TC0) ? 64 : 4 * GROUP; /* A: 16 rows x 32 bf16 */
    amx_load_config(colsb);
}

/* raw scores of 16 keys (rows k0[0..15]) and of rows k1 into s0, s1 ([16][GROUP] floats each); each
   chunk slice has its own A tile (4, 5 for slice 0; 2, 3 for slice 1: loads need not wait for the
   products still reading a tile) */
static inline void qk_pair(const uint16_t *k0, const uint16_t *k1, float *s0, float *s1) {
    _tile_zero(TC0);
    _tile_zero(TC1);
    TILE_LOAD(TA0, k0, 2 * D);
    TILE_LOAD(TA1, k1, 2 * D);
#if NH == 2
    TILE_LOAD(2, k0 + 32, 2 * D);
    TILE_LOAD(3, k1 + 32, 2 * D);
#endif
    _tile_dpbf16ps(TC0, TA0, 0);
    _tile_dpbf16ps(TC1, TA1, 0);
#if NH == 2
    _tile_dpbf16ps(TC0, 2, 1);
    _tile_dpbf16ps(TC1, 3, 1);
#endif
#if NH == 4
    TILE_LOAD(TA0, k0 + 32, 2 * D);
    TILE_LOAD(TA1, k1 + 32, 2 * D);
    _tile_dpbf16ps(TC0, TA0, 1);
    _tile_dpbf16ps(TC1, TA1, 1);
    TILE_LOAD(TA0, k0 + 64, 2 * D);
    TILE_LOAD(TA1, k1 + 64, 2 * D);
    _tile_dpbf16ps(TC0, TA0, 2);
    _tile_dpbf16ps(TC1, TA1, 2);
    TILE_LOAD(TA0, k0 + 96, 2 * D);
    TILE_LOAD(TA1, k1 + 96, 2 * D);
    _tile_dpbf16ps(TC0, TA0, 3);
    _tile_dpbf16ps(TC1, TA1, 3);
#endif
    TILE_STORE(TC0, s0, 4 * GROUP);
    TILE_STORE(TC1, s1, 4 * GROUP);
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

/* Prefetches a window's K and V rows into L2, one row per step (blocks are scattered: the hardware
   prefetcher stops at each); pfstream_t chains it over the windows. */
typedef struct {
    span_t span;
    int64_t blk, row, left;
    const char *kb, *vb;
} prefetcher_t;
static inline void prefetcher_start(prefetcher_t *p, span_t span, int64_t BS) {
    p->span = span;
    p->blk = p->row = 0;
    p->left = span.n;
    p->kb = p->vb = NULL;
    if (span.n > 0) {
        p->kb = (const char *)(span.k + span.tab[0] * BS * D);
        p->vb = (const char *)(span.v + span.tab[0] * BS * D);
    }
}
static inline void prefetcher_step(prefetcher_t *p, int64_t BS) {
    if (p->left <= 0) return;
    for (int64_t off = 0; off < 2 * D; off += 64) {
        __builtin_prefetch(p->kb + p->row * 2 * D + off, 0, 2); /* into L2 */
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

/* A softmax window: blocks b0 .. b1 of unit u (sequence u / KVH, KV head u % KVH), its n keys. */
typedef struct {
    int64_t u, b0, b1, n;
} win_t;

/* The (sequence, head) units u0 .. u1 of one call, and what every window needs from them. */
typedef struct {
    const io_t *q;
    const kv_t *k, *v;
    const int64_t *table, *ctx;
    int64_t KVH, NB, BS, MAXB, per_win, u1;
} run_t;

static inline const kv_t *head_k(const run_t *r, int64_t u) { return r->k + (u % r->KVH) * r->NB * r->BS * D; }
static inline const kv_t *head_v(const run_t *r, int64_t u) { return r->v + (u % r->KVH) * r->NB * r->BS * D; }
static inline const int64_t *unit_tab(const run_t *r, int64_t u) { return r->table + (u / r->KVH) * r->MAXB; }

/* the window from block b0 of unit u (n = 0 past the last unit) */
static inline win_t window_at(const run_t *r, int64_t u, int64_t b0) {
    win_t w = {u, b0, b0, 0};
    if (u >= r->u1) return w;
    const int64_t n_ctx = r->ctx[u / r->KVH], n_blocks = (n_ctx + r->BS - 1) / r->BS;
    w.b1 = b0 + r->per_win < n_blocks ? b0 + r->per_win : n_blocks;
    w.n = (w.b1 * r->BS < n_ctx ? w.b1 * r->BS : n_ctx) - b0 * r->BS;
    return w;
}
static inline win_t window_after(const run_t *r, win_t w) {
    const int64_t n_blocks = (r->ctx[w.u / r->KVH] + r->BS - 1) / r->BS;
    return w.b1 < n_blocks ? window_at(r, w.u, w.b1) : window_at(r, w.u + 1, 0);
}

/* The thread's one prefetch stream over all its windows, across window and unit ends, kept up to PF_LEAD
   rows ahead of the weighted rows. (A stream restarted at each window, one row per weighted row, fell
   behind after every short window, the last of a unit: the next window's keys were then scored from
   DRAM, each tile load stalling. Measured at 64 sequences x 300 keys, 30 layers: 47-48 -> 40-42 ms.) */
typedef struct {
    const run_t *r;
    win_t w;
    prefetcher_t p;
    int64_t issued;
} pfstream_t;
static inline void pfstream_span(pfstream_t *s) {
    const span_t span = {head_k(s->r, s->w.u), head_v(s->r, s->w.u), unit_tab(s->r, s->w.u) + s->w.b0, s->w.n};
    prefetcher_start(&s->p, span, s->r->BS);
}
static inline void pfstream_start(pfstream_t *s, const run_t *r, win_t w) {
    s->r = r;
    s->w = w;
    s->issued = 0;
    pfstream_span(s);
}
static inline void pfstream_step(pfstream_t *s) {
    if (s->p.left <= 0) {
        if (s->w.n == 0) return;
        s->w = window_after(s->r, s->w);
        if (s->w.n == 0) return;
        pfstream_span(s);
    }
    prefetcher_step(&s->p, s->r->BS);
    s->issued++;
}

/* q^T of unit u into the B tiles (pairs of dims, as tdpbf16ps takes them) */
static inline void load_queries(const run_t *r, int64_t u) {
    uint32_t qt[NH][16][GROUP] __attribute__((aligned(64)));
    const io_t *qh = r->q + u * GROUP * D;
    for (int g = 0; g < GROUP; g++)
        for (int h = 0; h < NH; h++)
            for (int p = 0; p < 16; p++) memcpy(&qt[h][p][g], qh + g * D + 32 * h + 2 * p, 4);
    BARRIER(qt);
    TILE_LOAD(0, qt[0], 4 * GROUP);
#if NH > 1
    TILE_LOAD(1, qt[1], 4 * GROUP);
#endif
#if NH > 2
    TILE_LOAD(2, qt[2], 4 * GROUP);
    TILE_LOAD(3, qt[3], 4 * GROUP);
#endif
}

/* The scores of one window, 32 keys (one qk_pair) at a time, so they can be interleaved with the
   previous window's weighted sum (the tile unit works while the vector units do); keys past n get
   -inf in scorer_finish. */
typedef struct {
    const kv_t *k;
    const int64_t *tab;
    float (*s)[GROUP];
    int64_t n, n16, t;
} scorer_t;
static inline void scorer_start(scorer_t *sc, const run_t *r, win_t w, float (*s)[GROUP]) {
    sc->k = head_k(r, w.u);
    sc->tab = unit_tab(r, w.u) + w.b0;
    sc->s = s;
    sc->n = w.n;
    sc->n16 = (w.n + 15) & ~(int64_t)15;
    sc->t = 0;
}
static inline void scorer_step(scorer_t *sc, int64_t BS) {
    if (sc->t >= sc->n16) return;
    const int64_t t = sc->t, t1 = t + 16 < sc->n16 ? t + 16 : t; /* a chunk never crosses a block */
    qk_pair(sc->k + sc->tab[t / BS] * BS * D + (t % BS) * D, sc->k + sc->tab[t1 / BS] * BS * D + (t1 % BS) * D,
            sc->s[t], sc->s[t + 16]);
    sc->t += 32;
}
/* the remaining pairs, then -inf for the keys past n (after the tile stores that wrote them) */
static inline void scorer_finish(scorer_t *sc, int64_t BS) {
    while (sc->t < sc->n16) scorer_step(sc, BS);
    BARRIER(sc->s);
    for (int64_t u = sc->n; u < sc->n16; u++)
        for (int g = 0; g < GROUP; g++) sc->s[u][g] = -3.0e38f;
}

/* Units u0 .. r->u1 on this thread, window after window: while window i is weighted (V rows, vector
   units), window i + 1 is scored (K rows, tile unit) and its K and V rows are prefetched into L2. */
static void attend_run_amx(const run_t *r, int64_t u0, float scale, io_t *restrict out) {
    float s[2][WIN + 32][GROUP] __attribute__((aligned(64)));
    vf acc[GROUP][NVEC];
    float m[GROUP], l[GROUP], c[GROUP];
    const int64_t BS = r->BS;
    win_t w = window_at(r, u0, 0);
    if (w.n == 0) return;
    scorer_t sc;
    load_queries(r, w.u);
    scorer_start(&sc, r, w, s[0]);
    scorer_finish(&sc, BS);
    pfstream_t pfs; /* from the second window on: the first is scored at once */
    pfstream_start(&pfs, r, window_after(r, w));
    int64_t weighted = 0; /* rows weighted so far on this thread */
    for (int64_t i = 0; w.n > 0; i++) {
        float(*sw)[GROUP] = s[i & 1];
        if (w.b0 == 0)
            for (int g = 0; g < GROUP; g++) {
                for (int j = 0; j < NVEC; j++) acc[g][j] = splat(0.0f);
                m[g] = -3.0e38f;
                l[g] = 0.0f;
            }
        const int64_t n16 = (w.n + 15) & ~(int64_t)15;
        window_softmax(&sw[0][0], n16, scale, m, l, c);
        for (int g = 0; g < GROUP; g++)
            if (c[g] != 1.0f)
                for (int j = 0; j < NVEC; j++) acc[g][j] *= splat(c[g]);
        const win_t nw = window_after(r, w);
        if (nw.n > 0 && nw.u != w.u) load_queries(r, nw.u);
        scorer_start(&sc, r, nw, s[(i + 1) & 1]);
        const kv_t *v = head_v(r, w.u);
        const int64_t *tab = unit_tab(r, w.u);
        int64_t done = 0;
        for (int64_t blk = w.b0; blk < w.b1; blk++) {
            const kv_t *vb = v + tab[blk] * BS * D;
            const int64_t base = (blk - w.b0) * BS, rows = w.n - base < BS ? w.n - base : BS;
            for (int64_t row = 0; row < rows; row++, done++) {
                vf vr[NVEC];
                for (int rep = 0; rep < PF_RATE && pfs.issued < weighted + PF_LEAD; rep++) pfstream_step(&pfs);
                weighted++;
                if ((done & SCORE_EVERY) == SCORE_EVERY && done >= SCORE_LAG) scorer_step(&sc, BS);
                load_row(vb + row * D, vr);
                for (int g = 0; g < GROUP; g++) {
                    const vf p = splat(sw[base + row][g]);
                    for (int j = 0; j < NVEC; j++) acc[g][j] += p * vr[j];
                }
            }
        }
        scorer_finish(&sc, BS);
        if (nw.u != w.u) { /* the unit's last window: normalise and store */
            float row[D] __attribute__((aligned(64)));
            io_t *oh = out + w.u * GROUP * D;
            for (int g = 0; g < GROUP; g++) {
                const vf inv = splat(1.0f / l[g]);
                for (int j = 0; j < NVEC; j++) acc[g][j] *= inv;
                from_row_order(acc[g], row);
                for (int j = 0; j < NVEC; j++) store_io(oh + g * D + 16 * j, load(row + 16 * j));
            }
        }
        w = nw;
    }
}

int decode_attention_amx(const io_t *restrict q, const kv_t *restrict k, const kv_t *restrict v,
                         const int64_t *restrict table, const int64_t *restrict ctx, io_t *restrict out,
                         int64_t B, int64_t KVH, int64_t NB, int64_t BS, int64_t MAXB, float scale,
                         int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        amx_configure(); /* tile configuration is per thread */
        /* each thread a contiguous run of (sequence, head) units (about equal keys), so it knows the
           next to prefetch */
        int64_t u0, u1;
        thread_units(ctx, B, KVH, &u0, &u1);
        const int64_t per_win = BS >= WIN ? 1 : WIN / BS;
        const run_t run = {q, k, v, table, ctx, KVH, NB, BS, MAXB, per_win, u1};
        attend_run_amx(&run, u0, scale, out);
        _tile_release();
    }
    return 0;
}
#else
int amx_available(void) { return 0; }
int decode_attention_amx(const io_t *restrict q, const kv_t *restrict k, const kv_t *restrict v,
                         const int64_t *restrict table, const int64_t *restrict ctx, io_t *restrict out,
                         int64_t B, int64_t KVH, int64_t NB, int64_t BS, int64_t MAXB, float scale,
                         int nthreads) {
    return -1; /* not compiled in for this build or shape */
}
#endif
