"""A float32 GEMM for CPUs with AVX2 and FMA but no AVX-512: ``y = x @ W^T (+ bias)`` over a packed weight.

On such CPUs (AMD Zen 2/3, older Intel) torch's float32 linears go through MKL, whose kernels there reach
well under the core's FMA peak at the shapes of an LLM's decode step. Measured on the AMD EPYC (Zen 3)
development machine, one thread, SmolLM2-135M's shapes at 64 rows (``benchmarks/bench_gemm.py avx2``):
MKL's packed GEMM 44-77 GFLOP/s (the tied LM head 29-47), this kernel 71-83 (the LM head 53-70), against
a peak of ~82 measured with everything in L1.

- **Layout**: the weight ``[N, K]`` is packed once into panels of 16 output columns, each ``[K][16]``
  contiguous (the last panel zero-padded), so a panel streams in order and every K step of the micro-kernel
  reads one 64-byte line of it.
- **Micro-kernel**: 6 rows x 16 columns of float32 accumulators (12 of the 16 ymm registers); each K step
  loads the panel's two vectors, broadcasts one activation per row and issues 12 FMAs.
- **Blocking**: K in even slices of at most 384 (a panel slice of <= 24 KiB stays in L1 while every row
  block of the call passes over it); rows in blocks of 96 (their activation slice stays in L2). While the
  row blocks run over one panel slice, the next slice is prefetched into L1, spread across them and
  evenly over each one's K loop (bursts of prefetches measured up to 1.15x slower at 16-48 rows).
- **Threads**: the panels are split evenly among torch's intra-op threads (the same OpenMP runtime); each
  thread owns its output columns, so no two threads write the same line.

Numerics: each output sums its K products in order within each K slice (FMA, float32), then the slices in
order, then the bias: the same bits whatever the row count, the row's place in the batch and the thread
count (batch-invariant), within float32 rounding of MKL (which orders sums differently).

Runs where the CPU has AVX2 and FMA (cpuid) and the C compiler builds it; :func:`preferred` says whether
:mod:`kvbalance.model.packed` takes it over MKL: on CPUs without AVX-512F (where MKL has its AVX-512
kernels) unless ``KVBALANCE_NATIVE_GEMM`` says ``0`` (never) or ``1`` (wherever it runs).
"""

from __future__ import annotations

import torch

from kvbalance.model import cbuild, panel_gemm

PANEL = 16  # output columns per packed panel

_SOURCE = r"""
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
"""
# without -funroll-loops: unrolling the K loop on top of the 12 FMAs per step measured 30-40% slower
_FLAGS = (*(f for f in cbuild.DEFAULT_FLAGS if f != "-funroll-loops"), "-mavx2", "-mfma")


def packed_size(n: int, k: int) -> int:
    return (n + PANEL - 1) // PANEL * k * PANEL


_KERNEL = panel_gemm.PanelGemm(
    "avx2_gemm", _SOURCE, _FLAGS, torch.float32, packed_size, "avx2_panels", "cpu_avx512"
)


def available() -> bool:
    """Whether the kernel runs here: the CPU has AVX2 and FMA, native kernels are on and it builds."""
    return _KERNEL.available()


def preferred() -> bool:
    """Whether float32 linears take this kernel over MKL here (see the module docstring)."""
    return _KERNEL.preferred()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] float32 -> the packed panels (1-D, :func:`packed_size` values)."""
    return _KERNEL.pack(weight)


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] @ W^T (+ ``bias`` [N]) -> [..., N] float32, ``packed`` from :func:`pack` of W [N, K]."""
    return _KERNEL.linear(x, packed, n, bias)
