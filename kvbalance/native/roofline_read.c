/* The DRAM read-rate probe of benchmarks/roofline.py: a tight loop of aligned 64-byte loads, four
   vector accumulators per thread (torch's float32 sum is bound by its reduction, not the memory). */
#include <stdint.h>
typedef float vf __attribute__((vector_size(64)));
/* sums n floats (n a multiple of 64) with four independent vector accumulators per thread */
float read_sum(const float *x, int64_t n, int nthreads) {
    float total = 0.0f;
    #pragma omp parallel for schedule(static) num_threads(nthreads) reduction(+ : total)
    for (int64_t i = 0; i < n; i += 1 << 16) {
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        const int64_t end = i + (1 << 16) < n ? i + (1 << 16) : n;
        for (int64_t j = i; j < end; j += 64) {
            a0 += *(const vf *)(x + j);
            a1 += *(const vf *)(x + j + 16);
            a2 += *(const vf *)(x + j + 32);
            a3 += *(const vf *)(x + j + 48);
        }
        const vf a = a0 + a1 + a2 + a3;
        for (int k = 0; k < 16; k++) total += a[k];
    }
    return total;
}
