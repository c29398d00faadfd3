/* A bfloat16 GEMM for CPUs with AVX512-BF16 but no AMX, y = x @ W^T (+ bias), over a weight packed into
   pair-interleaved panels of 32 columns (kvbalance/model/avx512_gemm.py explains the layout and blocking
   and loads it). Built with the compiler's AVX512-BF16 flags; cpu_ok() says whether the CPU runs it,
   cpu_amx() whether the AMX kernel and oneDNN's tile path serve it better. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MR 12   /* rows of the micro-kernel */
#ifndef MC
#define MC 192  /* rows per block: their activations stay in L2 */
#endif

int cpu_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

int cpu_amx(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("amx-bf16");
}

/* w [N, K] row-major bf16 -> ceil(N / 32) panels of [K2][32][2] (K2 = ceil(K / 2)), padding zero */
void pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *wp) {
    const int64_t panels = (n + 31) / 32, k2 = (k + 1) / 2;
    #pragma omp parallel for
    for (int64_t p = 0; p < panels; p++)
        for (int64_t j = 0; j < 32; j++) {
            const int64_t col = p * 32 + j;
            uint16_t *dst = wp + p * k2 * 64 + 2 * j;
            for (int64_t i = 0; i < 2 * k2; i++)
                dst[(i / 2) * 64 + (i & 1)] = col < n && i < k ? w[col * k + i] : 0;
        }
}

/* rows [0, mr) x the panel's 32 columns over all of K; xp: the rows' activations packed [k2][MR] as
   pairs (one pointer, constant offsets: each broadcast is a memory operand); ``pf``: ``npf`` lines of the
   next panel to prefetch */
static inline __attribute__((always_inline)) void kernel(
    int mr, const int32_t *xp, const uint16_t *wp, int64_t k2, uint16_t *y, int64_t ldy, int nc,
    const float *bias, const char *pf, int npf) {
    __m512 c[MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
    int64_t every = npf ? k2 / npf : k2 + 1, countdown = 1;
    if (every < 1) every = 1;
    int issued = 0;
    for (int64_t kk = 0; kk < k2; kk++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + 64 * kk);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 64 * kk + 32);
        if (--countdown == 0) { /* one line every `every` K pairs, spread over the loop */
            if (issued < npf) _mm_prefetch(pf + 64 * issued++, _MM_HINT_T1);
            countdown = every;
        }
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32(xp[kk * MR + r]);
                c[r][0] = _mm512_dpbf16_ps(c[r][0], a, w0);
                c[r][1] = _mm512_dpbf16_ps(c[r][1], a, w1);
            }
        }
    }
    const __mmask32 keep = nc >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << nc) - 1);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = _mm512_maskz_loadu_ps((__mmask16)keep, bias);
        b1 = _mm512_maskz_loadu_ps((__mmask16)(keep >> 16), bias + 16);
    }
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++)
        if (r < mr) {
            const __m512bh out = _mm512_cvtne2ps_pbh(_mm512_add_ps(c[r][1], b1), _mm512_add_ps(c[r][0], b0));
            _mm512_mask_storeu_epi16(y + r * ldy, keep, (__m512i)out);
        }
}

static void kernel_rows(int mr, const int32_t *xp, const uint16_t *wp, int64_t k2, uint16_t *y, int64_t ldy,
                        int nc, const float *bias, const char *pf, int npf) {
    switch (mr) {
    case 12: kernel(12, xp, wp, k2, y, ldy, nc, bias, pf, npf); break;
    case 11: kernel(11, xp, wp, k2, y, ldy, nc, bias, pf, npf); break;
    case 10: kernel(10, xp, wp, k2, y, ldy, nc, bias, pf, npf); break;
    case 9: kernel(9, xp, wp, k2, y, ldy, nc, bias, pf, npf); break;
    case 8: kernel(8, xp, wp, k2, y, ldy, nc, bias, pf, npf); break;
    case 7: kernel(7, xp, wp, k2, y, ldy, nc, bias, pf, npf); break;
    case 6: kernel(6, xp, wp, k2, y, ldy, nc, bias, pf, npf); break;
    case 5: kernel(5, xp, wp, k2, y, ldy, nc, bias, pf, npf); break;
    case 4: kernel(4, xp, wp, k2, y, ldy, nc, bias, pf, npf); break;
    case 3: kernel(3, xp, wp, k2, y, ldy, nc, bias, pf, npf); break;
    case 2: kernel(2, xp, wp, k2, y, ldy, nc, bias, pf, npf); break;
    default: kernel(1, xp, wp, k2, y, ldy, nc, bias, pf, npf); break;
    }
}

/* rows [r0, r0 + mr) of x as [k2][MR] pairs (an odd K's last value paired with a zero; rows past mr zero) */
static void pack_rows(const uint16_t *x, int64_t ldx, int64_t r0, int mr, int64_t k, int32_t *xp) {
    const int64_t k2 = (k + 1) / 2;
    for (int r = 0; r < MR; r++) {
        const uint16_t *row = x + (r0 + r) * ldx;
        for (int64_t kk = 0; kk < k2; kk++) {
            uint32_t lo = 0, hi = 0;
            if (r < mr) {
                lo = row[2 * kk];
                hi = 2 * kk + 1 < k ? row[2 * kk + 1] : 0;
            }
            xp[kk * MR + r] = (int32_t)(lo | hi << 16);
        }
    }
}

/* y [m, n] bf16 (row stride ldy) = x [m, k] bf16 (row stride ldx) @ W^T (+ bias [n] float32); wp from pack().
   Returns -1 where the activation buffer cannot be allocated. */
int gemm(const uint16_t *x, int64_t ldx, const uint16_t *wp, const float *bias, uint16_t *y, int64_t ldy,
         int64_t m, int64_t n, int64_t k, int nthreads) {
    const int64_t panels = (n + 31) / 32, k2 = (k + 1) / 2, panel_elems = k2 * 64;
    const int64_t max_blocks = ((m < MC ? m : MC) + MR - 1) / MR;
    int32_t *xp = aligned_alloc(64, (size_t)((max_blocks * k2 * MR * 4 + 63) / 64 * 64));
    if (xp == NULL) return -1;
    if (nthreads > panels) nthreads = (int)panels;
    if (nthreads < 1) nthreads = 1;
    #pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        const int npf = (int)(panel_elems * 2 / 64); /* lines of a panel */
        for (int64_t m0 = 0; m0 < m; m0 += MC) {
            const int64_t mc = m - m0 < MC ? m - m0 : MC;
            const int blocks = (int)((mc + MR - 1) / MR);
            #pragma omp for schedule(static)
            for (int b = 0; b < blocks; b++) {
                const int64_t r = m0 + (int64_t)b * MR;
                pack_rows(x, ldx, r, m0 + mc - r < MR ? (int)(m0 + mc - r) : MR, k, xp + (int64_t)b * k2 * MR);
            } /* (the loop's barrier: every block is packed before any thread reads it) */
            for (int64_t p = p0; p < p1; p++) {
                const uint16_t *w = wp + p * panel_elems;
                /* the panel read next: the next one of this thread, else (next row block) its first */
                const uint16_t *next = p + 1 < p1 ? w + panel_elems : wp + p0 * panel_elems;
                const int nc = n - p * 32 < 32 ? (int)(n - p * 32) : 32;
                for (int b = 0; b < blocks; b++) {
                    const int64_t r = m0 + (int64_t)b * MR;
                    const int mr = m0 + mc - r < MR ? (int)(m0 + mc - r) : MR;
                    const int l0 = npf * b / blocks, l1 = npf * (b + 1) / blocks;
                    kernel_rows(mr, xp + (int64_t)b * k2 * MR, w, k2, y + r * ldy + p * 32, ldy, nc,
                                bias ? bias + p * 32 : 0, (const char *)next + 64 * (int64_t)l0, l1 - l0);
                }
            }
            #pragma omp barrier /* the buffer is packed again for the next rows only once all are done */
        }
    }
    free(xp);
    return 0;
}
