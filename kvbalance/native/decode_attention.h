/* Shared by the paged decode-attention kernels, compiled together into one library per shape
   (kvbalance/model/native.py explains the design and loads it): decode_attention.c (the portable kernel,
   GCC/Clang vector extensions, any x86-64, and the entry points), decode_attention_amx.c (AMX tiles, bf16
   queries and cache) and decode_attention_avx2.c (16 ymm registers, CPUs with AVX2 but no AVX-512).

   Here: the types, the bf16 widening and rounding, the 16-key reduction tree, the vectorised exponential,
   the row order of a bf16 cache, the split of (sequence, KV head) units among threads and the online
   softmax of a block, as static inline functions each file compiles for its own target. */
#ifndef KVBALANCE_DECODE_ATTENTION_H
#define KVBALANCE_DECODE_ATTENTION_H
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

/* The AMX path (decode_attention_amx.c), for bf16 queries and cache where the library was built with
   -DHAVE_AMX=1: 0 where it ran, -1 where it is not compiled in for this shape (callers run another path). */
int decode_attention_amx(const io_t *restrict q, const kv_t *restrict k, const kv_t *restrict v,
                         const int64_t *restrict table, const int64_t *restrict ctx, io_t *restrict out,
                         int64_t B, int64_t KVH, int64_t NB, int64_t BS, int64_t MAXB, float scale,
                         int nthreads);
/* 1 where the AMX path is compiled in for this shape and runs here: cpuid says AMX-BF16 and AVX-512F,
   and the OS granted this process tile data */
int amx_available(void);

/* The AVX2 path (decode_attention_avx2.c): 0 where it ran, -1 where the target is not AVX2 + FMA without
   AVX-512F (callers run the portable kernel). */
int decode_attention_avx2(const io_t *restrict q, const kv_t *restrict k, const kv_t *restrict v,
                          const int64_t *restrict table, const int64_t *restrict ctx, io_t *restrict out,
                          int64_t B, int64_t KVH, int64_t NB, int64_t BS, int64_t MAXB, float scale,
                          int nthreads);
/* 1 where the library was built for AVX2 + FMA without AVX-512F (so decode_attention_avx2 runs) */
int attention_avx2(void);

#endif /* KVBALANCE_DECODE_ATTENTION_H */
