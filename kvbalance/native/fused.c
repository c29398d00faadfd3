/* Fused element-wise CPU kernels (kvbalance/model/fused.py documents their numerics and loads them):
   RMSNorm, add + RMSNorm, SiLU-and-mul, RoPE and the row argmax over rows of elem: bf16 bits, or float32
   where compiled with -DELEM_F32=1; each with an AVX-512 build and a portable (GCC vector extension)
   build, chosen by the target. Compiled with -ffp-contract=off: no fused multiply-adds but the explicit
   ones, so each kernel rounds where torch's float32 composition does. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if ELEM_F32
typedef float elem; /* the float32 build (-DELEM_F32=1): rows of float32, no rounding */
#else
typedef uint16_t elem; /* bf16 bits */
#endif
typedef float vf __attribute__((vector_size(64), aligned(4))); /* 16 floats, any alignment */
typedef int32_t vi __attribute__((vector_size(64), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(64), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(32), aligned(2)));
#define W 16

static inline vf splat(float x) { return (vf){0} + x; }
static inline vf as_vf(vu u) { vf x; memcpy(&x, &u, sizeof x); return x; }
static inline vu as_vu(vf x) { vu u; memcpy(&u, &x, sizeof u); return u; }

/* the float32 bits of x rounded to nearest even at bf16 precision (low half zero); NaN -> 0x7FC0 */
static inline vu round_bits(vf x) {
    vu b = as_vu(x), nan = (vu)(x != x);
    vu r = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    return (nan & 0x7FC00000u) | (~nan & r);
}
#if ELEM_F32
static inline vf ld(const elem *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline void st(elem *p, vf x) { memcpy(p, &x, sizeof x); }
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf madd(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#else
static inline vf madd(vf a, vf b, vf c) { return a * b + c; }
#endif
#elif defined(__AVX512F__)
#include <immintrin.h>
/* GCC lowers the generic 16 x u16 <-> 16 x u32 conversions to five shuffles each: one instruction here */
static inline vf ld(const elem *p) { /* widen: a bf16 is the top half of a float32 */
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
static inline void st(elem *p, vf x) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16((__m512i)(round_bits(x) >> 16)));
}
static inline vf madd(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#else
static inline vf ld(const elem *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return as_vf(__builtin_convertvector(h, vu) << 16);
}
static inline void st(elem *p, vf x) {
    vh h = __builtin_convertvector(round_bits(x) >> 16, vh);
    memcpy(p, &h, sizeof h);
}
static inline vf madd(vf a, vf b, vf c) { return a * b + c; }
#endif
static inline vf pick(vi m, vf a, vf b) { return as_vf(((vu)m & as_vu(a)) | (~(vu)m & as_vu(b))); }
static inline vf vmax(vf a, vf b) { return pick(a > b, a, b); } /* NaN a: b */
static inline vf vmin(vf a, vf b) { return pick(a < b, a, b); }
static inline float hsum(vf x) {
    for (int w = W / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) x[i] += x[i + w];
    return x[0];
}

/* a row's tail of n < W elements, through a zero-padded buffer (so the tail runs the vector code) */
static inline vf ld_tail(const elem *p, int64_t n) { elem b[W] = {0}; memcpy(b, p, n * sizeof(elem)); return ld(b); }
static inline void st_tail(elem *p, vf x, int64_t n) { elem b[W]; st(b, x); memcpy(p, b, n * sizeof(elem)); }
#define LD(p, n) ((n) >= W ? ld(p) : ld_tail(p, n))
#define ST(p, x, n) ((n) >= W ? st(p, x) : st_tail(p, x, n))

/* Each kernel's body works on one chunk of n <= W elements; the loops call it with n = W (the checks
   fold away) and once more for a row's tail. */
#define FOR_CHUNKS(i, n, body)                                                                                \
    do {                                                                                                     \
        int64_t i = 0;                                                                                       \
        for (; i + W <= (n); i += W) { const int64_t c_ = W; body; }                                       \
        if (i < (n)) { const int64_t c_ = (n) - i; body; }                                                 \
    } while (0)

/* -- RMSNorm: out = x * rsqrt(mean(x^2) + eps) * w, float32 inside, one rounding -- */
static inline void norm_row(const elem *x, const elem *w, elem *out, int64_t n, float eps) {
    vf a0 = splat(0.0f), a1 = splat(0.0f);
    int64_t i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {
        vf u = ld(x + i), v = ld(x + i + W);
        a0 += u * u;
        a1 += v * v;
    }
    for (; i < n; i += W) {
        vf u = LD(x + i, n - i);
        a0 += u * u;
    }
    const float r = 1.0f / sqrtf(hsum(a0 + a1) / (float)n + eps);
    FOR_CHUNKS(j, n, ST(out + j, LD(x + j, c_) * r * LD(w + j, c_), c_));
}

void rms_norm(const elem *x, int64_t xs, const elem *w, elem *out, int64_t os, int64_t T, int64_t N,
              float eps, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++) norm_row(x + t * xs, w, out + t * os, N, eps);
}

/* h = h + d (bf16: rounded, as torch's bf16 add), then out = RMSNorm(h) from the rounded h */
void add_rms_norm(elem *h, int64_t hs, const elem *d, int64_t ds, const elem *w, elem *out, int64_t os,
                  int64_t T, int64_t N, float eps, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++) {
        elem *hr = h + t * hs;
        const elem *dr = d + t * ds;
        FOR_CHUNKS(i, N, ST(hr + i, LD(hr + i, c_) + LD(dr + i, c_), c_));
        norm_row(hr, w, out + t * os, N, eps);
    }
}

/* -- SiLU-and-mul: silu(g) = g / (1 + e^-g), as torch computes it: e^-g overflows to inf below
   g = -88.72 (silu -0, as torch's), underflows to 0 far above -- */
#define EXP_MAX 88.72283935546875f /* ln(FLT_MAX) */
#if defined(__AVX512F__)
/* e^-g by Cody-Waite: n = round(-g / ln2), r = -g - n ln2 (ln2 split in two), e^r by its degree-6 Taylor
   polynomial (|r| <= ln2 / 2: ~1.2e-7 relative), scaled by 2^n with scalef; 1 / (1 + e^-g) by rcp14 and
   one Newton step (~2^-23 relative) */
static inline vf vsilu(vf gv) {
    const __m512 g = (__m512)gv, y = _mm512_sub_ps(_mm512_setzero_ps(), g);
    const __m512 x = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-150.0f)), _mm512_set1_ps(EXP_MAX));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512 d = _mm512_add_ps(_mm512_scalef_ps(p, n), _mm512_set1_ps(1.0f));
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
    const __mmask16 overflow = _mm512_cmp_ps_mask(y, _mm512_set1_ps(EXP_MAX), _CMP_GT_OQ);
    return (vf)_mm512_mask_mul_ps(_mm512_mul_ps(g, inv), overflow, g, _mm512_setzero_ps());
}
#else
/* e^a for a in [-150, EXP_MAX]: 2^n p(r) as above, 2^n applied in two halves (the subnormals, 0 and
   numbers up to FLT_MAX come out right) */
static inline vf vexp(vf a) {
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    vf nf = (a * splat(1.44269504088896341f) + magic) - magic;
    vf r = a - nf * splat(0.693145751953125f) - nf * splat(1.428606765330187e-06f); /* ln2, split */
    vf p = splat(1.0f / 720);
    p = madd(p, r, splat(1.0f / 120));
    p = madd(p, r, splat(1.0f / 24));
    p = madd(p, r, splat(1.0f / 6));
    p = madd(p, r, splat(0.5f));
    p = madd(p, r, splat(1.0f));
    p = madd(p, r, splat(1.0f));
    vi n = __builtin_convertvector(nf, vi), n1 = n >> 1, n2 = n - n1;
    return p * as_vf((vu)((n1 + 127) << 23)) * as_vf((vu)((n2 + 127) << 23));
}
static inline vf vsilu(vf g) {
    const vf y = splat(0.0f) - g, hi = splat(EXP_MAX);
    const vf s = g / (splat(1.0f) + vexp(vmin(vmax(y, splat(-150.0f)), hi)));
    const vu overflow = (vu)(y > hi);
    return as_vf((overflow & as_vu(g * splat(0.0f))) | (~overflow & as_vu(s))); /* overflow: g * 0 */
}
#endif

void silu_and_mul(const elem *gu, int64_t gs, elem *out, int64_t os, int64_t T, int64_t I, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++) {
        const elem *g = gu + t * gs, *u = g + I;
        elem *o = out + t * os;
        FOR_CHUNKS(i, I, ST(o + i, vsilu(LD(g + i, c_)) * LD(u + i, c_), c_));
    }
}

/* -- argmax of each row: the first index of its maximum, as torch.argmax (a NaN counts as the maximum).
   Lane l keeps the first maximum among elements l, l + W, ... (a strict >), so the smallest index among
   the lanes holding the row maximum is the row's first; -0 and +0 compare equal, as in torch -- */
#if ELEM_F32
static inline float widen1(elem h) { return h; }
#else
static inline float widen1(elem h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
#endif

static int64_t argmax_scalar(const elem *r, int64_t n) {
    int64_t bi = 0;
    float bv = widen1(r[0]);
    for (int64_t j = 0; j < n; j++) {
        const float v = widen1(r[j]);
        if (v != v) return j;
        if (v > bv) bv = v, bi = j;
    }
    return bi;
}

static int64_t argmax_row(const elem *r, int64_t n) {
    if (n < W) return argmax_scalar(r, n);
    vi idx = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, bidx = idx;
    vf best = ld(r);
    vi nan = (vi)(best != best);
    int64_t i = W;
    for (; i + W <= n; i += W) {
        const vf v = ld(r + i);
        const vi m = (vi)(v > best);
        idx += W;
        best = pick(m, v, best);
        bidx = (m & idx) | (~m & bidx);
        nan |= (vi)(v != v);
    }
    for (int l = 0; l < W; l++)
        if (nan[l]) return argmax_scalar(r, n);
    float bv = best[0];
    int64_t bi = bidx[0];
    for (int l = 1; l < W; l++)
        if (best[l] > bv || (best[l] == bv && bidx[l] < bi)) bv = best[l], bi = bidx[l];
    for (; i < n; i++) {
        const float v = widen1(r[i]);
        if (v != v) return i;
        if (v > bv) bv = v, bi = i;
    }
    return bi;
}

void argmax_rows(const elem *x, int64_t xs, int64_t T, int64_t N, int64_t *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++) out[t] = argmax_row(x + t * xs, N);
}

/* -- RoPE, rotate-half, in place over the first H heads of D of each row; cos/sin [T, D/2] elem -- */
static inline void rope_chunk(elem *x, int64_t H, int64_t D, vf c, vf s, int64_t n) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < H; h++) {
        elem *p = x + h * D;
        vf x1 = LD(p, n), x2 = LD(p + half, n);
        ST(p, x1 * c - x2 * s, n);
        ST(p + half, x2 * c + x1 * s, n);
    }
}

void rope(elem *x, int64_t xs, int64_t T, int64_t H, int64_t D, const elem *cos_t, const elem *sin_t,
          int64_t cs, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++) {
        const elem *c = cos_t + t * cs, *s = sin_t + t * cs;
        FOR_CHUNKS(i, D / 2, rope_chunk(x + t * xs + i, H, D, LD(c + i, c_), LD(s + i, c_), c_));
    }
}
