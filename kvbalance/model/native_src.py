"""C source of the portable paged decode-attention kernel (GCC/Clang vector extensions, any x86-64).

``KERNEL_SOURCE``: the per-(sequence, KV head) kernel ``attend_head`` and its helpers (bf16 widening
and rounding, the 16-key reduction tree, the vectorised exponential); ``ENTRY_SOURCE``: the exported
entry points, which dispatch to the AMX path of :mod:`kvbalance.model.native_amx` (compiled between
the two) where it is built and asked for. See :mod:`kvbalance.model.native` for the design.
"""

KERNEL_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <omp.h>

/* compiled per shape: -DGROUP=<query heads per KV head> -DNVEC=<head_dim / 16>, -DKV_BF16=<0 | 1> (cache
   dtype), -DIO_BF16=<0 | 1> (queries and output) */
#define D (16 * NVEC)
#define MAX_BS 256

typedef float vf __attribute__((vector_size(64), aligned(4))); /* 16 floats, any alignment */
typedef int32_t vi __attribute__((vector_size(64), aligned(4)));
typedef float h8 __attribute__((vector_size(32)));
typedef float h4 __attribute__((vector_size(16)));

static inline vf load(const float *p) { return *(const vf *)p; }
static inline void store(float *p, vf x) { *(vf *)p = x; }
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* a bf16 is the top half of a float32: widening is a zero-extend and a shift; narrowing rounds to
   nearest even (as torch's .to(torch.bfloat16)), NaN kept a quiet NaN */
typedef uint16_t vh __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(64)));
static inline vf load_bf16(const uint16_t *p) {
    vu w = __builtin_convertvector(*(const vh *)p, vu) << 16;
    vf x;
    memcpy(&x, &w, sizeof x);
    return x;
}
static inline void store_bf16(uint16_t *p, vf x) {
    vu b;
    memcpy(&b, &x, sizeof b);
    vu r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    vi nan = x != x;
    r = (vu)((nan & (vi)((b >> 16) | 0x40u)) | (~nan & (vi)r));
    vh h = __builtin_convertvector(r, vh);
    memcpy(p, &h, sizeof h);
}

#if KV_BF16
typedef uint16_t kv_t;
static inline vf load_kv(const kv_t *p) { return load_bf16(p); }
#else
typedef float kv_t;
static inline vf load_kv(const kv_t *p) { return load(p); }
#endif
#if IO_BF16
typedef uint16_t io_t;
static inline vf load_io(const io_t *p) { return load_bf16(p); }
static inline void store_io(io_t *p, vf x) { store_bf16(p, x); }
#else
typedef float io_t;
static inline vf load_io(const io_t *p) { return load(p); }
static inline void store_io(io_t *p, vf x) { store(p, x); }
#endif

static inline vf vmax(vf a, vf b) {
    vi a_bigger = a > b;
    return (vf)((a_bigger & (vi)a) | (~a_bigger & (vi)b));
}

static inline float hsum(vf x) {
    h8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    h4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float hmax(vf x) {
    float m = x[0];
    for (int i = 1; i < 16; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* out[i] = sum of the lanes of p[i], for 16 vectors at once (a transpose-and-add tree). */
static inline vf reduce16(const vf *p) {
    vf x[8], y[4], z[2];
    for (int i = 0; i < 8; i++)
        x[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* e^x for x <= 0 (scores minus their running max): 2^n * p(r) with |r| <= ln2 / 2 and p the degree-6
   Taylor polynomial (relative error ~2e-7); x is clamped at -87, so e^x stays a normal float. */
static inline vf vexp(vf x) {
    x = vmax(x, splat(-87.0f));
    vf t = x * splat(1.44269504088896341f);
    vi neg = t < splat(0.0f);
    vf half = (vf)((neg & (vi)splat(-0.5f)) | (~neg & (vi)splat(0.5f)));
    vi n = __builtin_convertvector(t + half, vi); /* round to nearest */
    vf nf = __builtin_convertvector(n, vf);
    vf r = x - nf * splat(0.693145751953125f) - nf * splat(1.428606765330187e-06f); /* ln2, split */
    vf p = splat(1.0f / 720);
    p = p * r + splat(1.0f / 120);
    p = p * r + splat(1.0f / 24);
    p = p * r + splat(1.0f / 6);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    vi bits = (n + 127) << 23;
    vf two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* A cache row's D values as NVEC vectors, in "row order". PAIRED (a bf16 cache, D a multiple of 32):
   vector 2c holds the even elements of the row's c-th 32-value chunk and 2c + 1 the odd ones, so
   widening is one 64-byte load, a shift and a mask (no shuffles); queries and accumulators are kept
   in the same order (to_row_order / from_row_order, once per sequence and head). */
#define PAIRED (KV_BF16 && NVEC % 2 == 0)
static inline void load_row(const kv_t *p, vf *r) {
#if PAIRED
    for (int c = 0; c < NVEC / 2; c++) {
        vu w, e, o;
        memcpy(&w, p + 32 * c, sizeof w);
        e = w << 16;
        o = w & 0xFFFF0000u;
        memcpy(&r[2 * c], &e, sizeof e);
        memcpy(&r[2 * c + 1], &o, sizeof o);
    }
#else
    for (int j = 0; j < NVEC; j++) r[j] = load_kv(p + 16 * j);
#endif
}
static inline void to_row_order(const float *x, vf *r) {
#if PAIRED
    for (int c = 0; c < NVEC / 2; c++)
        for (int i = 0; i < 16; i++) {
            r[2 * c][i] = x[32 * c + 2 * i];
            r[2 * c + 1][i] = x[32 * c + 2 * i + 1];
        }
#else
    for (int j = 0; j < NVEC; j++) r[j] = load(x + 16 * j);
#endif
}
static inline void from_row_order(const vf *r, float *x) {
#if PAIRED
    for (int c = 0; c < NVEC / 2; c++)
        for (int i = 0; i < 16; i++) {
            x[32 * c + 2 * i] = r[2 * c][i];
            x[32 * c + 2 * i + 1] = r[2 * c + 1][i];
        }
#else
    for (int j = 0; j < NVEC; j++) store(x + 16 * j, r[j]);
#endif
}

/* This OpenMP thread's contiguous run [u0, u1) of the B * KVH (sequence, KV head) units, split so that
   each thread gets about equal keys */
static inline void thread_units(const int64_t *ctx, int64_t B, int64_t KVH, int64_t *u0, int64_t *u1) {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t total = 0, seen = 0;
    *u0 = *u1 = 0;
    for (int64_t b = 0; b < B; b++) total += ctx[b];
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < KVH; h++, seen += ctx[b]) {
            if (seen * nt < total * KVH * id) *u0 = b * KVH + h + 1;
            if (seen * nt < total * KVH * (id + 1)) *u1 = b * KVH + h + 1;
        }
}

/* Online softmax over one block's scores sg[0, n) of one query head (sg has room up to n rounded up to
   16): the running max *m and sum *l move on, the scores become weights e^(s - max) (0 past n); returns
   the factor that rescales what was accumulated before this block. */
static inline float block_softmax(float *sg, int64_t n, float *m, float *l) {
    const int64_t n16 = (n + 15) & ~(int64_t)15;
    for (int64_t i = n; i < n16; i++) sg[i] = -3.0e38f;
    vf mv = splat(*m);
    for (int64_t i = 0; i < n16; i += 16) mv = vmax(load(sg + i), mv);
    const float bm = hmax(mv), c = vexp(splat(*m - bm))[0];
    const vf bmv = splat(bm);
    for (int64_t i = 0; i < n16; i += 16) store(sg + i, vexp(load(sg + i) - bmv));
    for (int64_t i = n; i < n16; i++) sg[i] = 0.0f;
    vf sum = splat(0.0f);
    for (int64_t i = 0; i < n16; i += 16) sum += load(sg + i);
    *m = bm;
    *l = *l * c + hsum(sum);
    return c;
}

/* One (sequence, KV head): the GROUP queries qh [GROUP, D] against the sequence's n_ctx keys, whose
   blocks tab[] lists; k, v point at this head's [NB, BS, D] cache. */
static void attend_head(const io_t *restrict qh, const kv_t *restrict k, const kv_t *restrict v,
                        const int64_t *restrict tab, int64_t n_ctx, int64_t BS, float scale, io_t *restrict oh) {
    vf q[GROUP][NVEC], acc[GROUP][NVEC];
    float m[GROUP], l[GROUP];
    float s[GROUP][MAX_BS + 16] __attribute__((aligned(64))); /* this block's scores, then weights */
    float row[D] __attribute__((aligned(64)));
    for (int g = 0; g < GROUP; g++) {
        for (int j = 0; j < NVEC; j++) store(row + 16 * j, load_io(qh + g * D + 16 * j) * splat(scale));
        to_row_order(row, q[g]);
        for (int j = 0; j < NVEC; j++) acc[g][j] = splat(0.0f);
        m[g] = -3.0e38f;
        l[g] = 0.0f;
    }
    const int64_t n_blocks = (n_ctx + BS - 1) / BS, row_bytes = D * (int64_t)sizeof(kv_t);
    for (int64_t blk = 0; blk < n_blocks; blk++) {
        const int64_t n = n_ctx - blk * BS < BS ? n_ctx - blk * BS : BS;
        const kv_t *kb = k + tab[blk] * BS * D, *vb = v + tab[blk] * BS * D;
        const int64_t next = tab[blk + 1 < n_blocks ? blk + 1 : blk] * BS * D;
        const char *nk = (const char *)(k + next), *nv = (const char *)(v + next);
        /* scores, 16 keys at a time; prefetch the next block's K row by row meanwhile */
        int64_t t = 0;
        for (; t + 16 <= n; t += 16) {
            vf part[GROUP][16];
            for (int u = 0; u < 16; u++) {
                const kv_t *kt = kb + (t + u) * D;
                for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(nk + (t + u) * row_bytes + off, 0, 1);
                vf kr[NVEC];
                load_row(kt, kr);
                for (int g = 0; g < GROUP; g++) {
                    vf a = q[g][0] * kr[0];
                    for (int j = 1; j < NVEC; j++) a += q[g][j] * kr[j];
                    part[g][u] = a;
                }
            }
            for (int g = 0; g < GROUP; g++) store(s[g] + t, reduce16(part[g]));
        }
        for (; t < n; t++) {
            vf kr[NVEC];
            load_row(kb + t * D, kr);
            for (int g = 0; g < GROUP; g++) {
                vf a = q[g][0] * kr[0];
                for (int j = 1; j < NVEC; j++) a += q[g][j] * kr[j];
                s[g][t] = hsum(a);
            }
        }
        /* online softmax: new running max, rescale what was accumulated, weights e^(s - max) */
        for (int g = 0; g < GROUP; g++) {
            const float c = block_softmax(s[g], n, &m[g], &l[g]);
            if (c != 1.0f)
                for (int j = 0; j < NVEC; j++) acc[g][j] *= splat(c);
        }
        /* weighted values; prefetch the next block's V row by row meanwhile */
        for (int64_t i = 0; i < n; i++) {
            const kv_t *vt = vb + i * D;
            for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(nv + i * row_bytes + off, 0, 1);
            vf vr[NVEC];
            load_row(vt, vr);
            for (int g = 0; g < GROUP; g++) {
                const vf p = splat(s[g][i]);
                for (int j = 0; j < NVEC; j++) acc[g][j] += p * vr[j];
            }
        }
    }
    for (int g = 0; g < GROUP; g++) {
        const vf inv = splat(1.0f / l[g]);
        for (int j = 0; j < NVEC; j++) acc[g][j] *= inv;
        from_row_order(acc[g], row);
        for (int j = 0; j < NVEC; j++) store_io(oh + g * D + 16 * j, load(row + 16 * j));
    }
}

"""

ENTRY_SOURCE = r"""
/* q, out: [B, KVH, GROUP, D]; k, v: [KVH, NB, BS, D]; table: [B, MAXB]; ctx: [B] (tokens with KV). */
void paged_decode_attention(const io_t *restrict q, const kv_t *restrict k, const kv_t *restrict v,
                            const int64_t *restrict table, const int64_t *restrict ctx, io_t *restrict out,
                            int64_t B, int64_t KVH, int64_t NB, int64_t BS, int64_t MAXB, float scale, int nthreads,
                            int use_amx) {
#if AMX_PATH
    if (use_amx && BS % 16 == 0) {
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
        return;
    }
#endif
    (void)use_amx;
#ifdef AVX2_PATH
    attend_units_avx2(q, k, v, table, ctx, out, B, KVH, NB, BS, MAXB, scale, nthreads);
    return;
#endif
    #pragma omp parallel for collapse(2) schedule(dynamic) num_threads(nthreads)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < KVH; h++)
            attend_head(q + (b * KVH + h) * GROUP * D, k + h * NB * BS * D, v + h * NB * BS * D, table + b * MAXB,
                        ctx[b], BS, scale, out + (b * KVH + h) * GROUP * D);
}

/* The step's new keys and values into their cache slots: kn, vn [T, KVH, D] with row strides (in
   elements; heads contiguous within a row); kc, vc [KVH, NSLOTS, D]; slots [T]. */
void write_kv(const kv_t *restrict kn, int64_t k_stride, const kv_t *restrict vn, int64_t v_stride,
              kv_t *restrict kc, kv_t *restrict vc, const int64_t *restrict slots, int64_t T, int64_t KVH,
              int64_t NSLOTS) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < KVH; h++) {
            memcpy(kc + (h * NSLOTS + slots[t]) * D, kn + t * k_stride + h * D, D * sizeof(kv_t));
            memcpy(vc + (h * NSLOTS + slots[t]) * D, vn + t * v_stride + h * D, D * sizeof(kv_t));
        }
}
"""
