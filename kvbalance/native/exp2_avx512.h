/* 2^x on 16 floats (AVX-512F), shared by the AMX and the AVX-512 prefill kernels' base-2 softmax. */
#ifndef KVBALANCE_EXP2_AVX512_H
#define KVBALANCE_EXP2_AVX512_H
#include <immintrin.h>

/* 2^x for finite x (very negative x -> 0) */
static inline __m512 exp2v(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558146428443e-3f); /* Taylor, degree 5: 2.4e-6 relative error */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif /* KVBALANCE_EXP2_AVX512_H */
