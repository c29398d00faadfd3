/* A float32 GEMM for CPUs with AVX2 and FMA but no AVX-512, y = x @ W^T (+ bias), over a weight packed
   into panels of 16 columns (kvbalance/model/avx2_gemm.py explains the layout and blocking and loads it).
   Built with -mavx2 -mfma; cpu_ok() says whether the CPU runs it, cpu_avx512() whether MKL's AVX-512
   kernels serve it better. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define MR 6    /* rows of the micro-kernel */
#define KC 384  /* most K per slice: a 16-column panel slice of 24 KiB */
#define MC 96   /* rows per block: their activation slice stays in L2 */

int cpu_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

int cpu_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* w [N, K] row-major -> ceil(N / 16) panels of [K][16], columns past N zero */
void pack(const float *w, int64_t n, int64_t k, float *wp) {
    int64_t panels = (n + 15) / 16;
    #pragma omp parallel for
    for (int64_t p = 0; p < panels; p++)
        for (int64_t j = 0; j < 16; j++) {
            int64_t col = p * 16 + j;
            float *dst = wp + p * k * 16 + j;
            if (col < n)
                for (int64_t i = 0; i < k; i++) dst[16 * i] = w[col * k + i];
            else
                for (int64_t i = 0; i < k; i++) dst[16 * i] = 0.f;
        }
}

/* rows [0, mr) x 16 columns over one K slice; the first slice stores (+ bias), later ones accumulate.
   ``pf``: ``npf`` lines of the next panel slice to prefetch into L1 */
static inline __attribute__((always_inline)) void kernel(
    int mr, const float *x, int64_t ldx, const float *wp, int kc, float *y, int64_t ldy, int nc, int first,
    const float *bias, const float *pf, int npf) {
    __m256 c[MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
    int every = npf ? kc / npf : kc + 1, countdown = 1, issued = 0;
    if (every < 1) every = 1;
    for (int k = 0; k < kc; k++) {
        __m256 w0 = _mm256_loadu_ps(wp + 16 * k), w1 = _mm256_loadu_ps(wp + 16 * k + 8);
        if (--countdown == 0) { /* one line every `every` K steps, spread over the loop */
            if (issued < npf) _mm_prefetch((const char *)(pf + 16 * issued++), _MM_HINT_T0);
            countdown = every;
        }
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
                c[r][0] = _mm256_fmadd_ps(a, w0, c[r][0]);
                c[r][1] = _mm256_fmadd_ps(a, w1, c[r][1]);
            }
        }
    }
    /* through a buffer with constant indices: the accumulators stay in registers in the loop above */
    float acc[MR * 16];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(acc + 16 * r, c[r][0]);
        _mm256_storeu_ps(acc + 16 * r + 8, c[r][1]);
    }
    for (int r = 0; r < mr; r++) {
        float *o = y + r * ldy;
        if (nc == 16) {
            __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
            if (!first) {
                b0 = _mm256_loadu_ps(o);
                b1 = _mm256_loadu_ps(o + 8);
            } else if (bias) {
                b0 = _mm256_loadu_ps(bias);
                b1 = _mm256_loadu_ps(bias + 8);
            }
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(acc + 16 * r), b0));
            _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_loadu_ps(acc + 16 * r + 8), b1));
        } else {
            for (int j = 0; j < nc; j++) o[j] = acc[16 * r + j] + (!first ? o[j] : bias ? bias[j] : 0.f);
        }
    }
}

static void kernel_rows(int mr, const float *x, int64_t ldx, const float *wp, int kc, float *y, int64_t ldy,
                        int nc, int first, const float *bias, const float *pf, int npf) {
    switch (mr) {
    case 6: kernel(6, x, ldx, wp, kc, y, ldy, nc, first, bias, pf, npf); break;
    case 5: kernel(5, x, ldx, wp, kc, y, ldy, nc, first, bias, pf, npf); break;
    case 4: kernel(4, x, ldx, wp, kc, y, ldy, nc, first, bias, pf, npf); break;
    case 3: kernel(3, x, ldx, wp, kc, y, ldy, nc, first, bias, pf, npf); break;
    case 2: kernel(2, x, ldx, wp, kc, y, ldy, nc, first, bias, pf, npf); break;
    default: kernel(1, x, ldx, wp, kc, y, ldy, nc, first, bias, pf, npf); break;
    }
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ W^T (+ bias [n]); wp from pack(); returns 0 */
int gemm(const float *x, int64_t ldx, const float *wp, const float *bias, float *y, int64_t ldy, int64_t m,
          int64_t n, int64_t k, int nthreads) {
    int64_t panels = (n + 15) / 16;
    int64_t slices = (k + KC - 1) / KC;
    if (nthreads > panels) nthreads = (int)panels;
    if (nthreads < 1) nthreads = 1;
    #pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        for (int64_t m0 = 0; m0 < m; m0 += MC) {
            int64_t mc = m - m0 < MC ? m - m0 : MC;
            int blocks = (int)((mc + MR - 1) / MR);
            for (int64_t s = 0; s < slices; s++) {
                int64_t k0 = k * s / slices;
                int kc = (int)(k * (s + 1) / slices - k0);
                for (int64_t p = p0; p < p1; p++) {
                    const float *w = wp + (p * k + k0) * 16;
                    /* the slice the next panel pass reads: this slice of the next panel, else the next slice */
                    const float *next = p + 1 < p1 ? w + k * 16 : s + 1 < slices ? wp + (p0 * k + k * (s + 1) / slices) * 16 : w;
                    int nc = n - p * 16 < 16 ? (int)(n - p * 16) : 16;
                    for (int b = 0; b < blocks; b++) {
                        int64_t r = m0 + (int64_t)b * MR;
                        int mr = m0 + mc - r < MR ? (int)(m0 + mc - r) : MR;
                        int l0 = kc * b / blocks, l1 = kc * (b + 1) / blocks;
                        kernel_rows(mr, x + r * ldx + k0, ldx, w, kc, y + r * ldy + p * 16, ldy, nc, s == 0,
                                    bias ? bias + p * 16 : 0, next + 16 * l0, l1 - l0);
                    }
                }
            }
        }
    }
    return 0;
}
