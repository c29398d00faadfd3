/* Shared by the AMX kernels (decode attention in decode_attention_amx.c, prefill attention in
   prefill_attention_amx.c, the small-M GEMM in amx_gemm.c): tile loads and stores as asm the compiler
   keeps in order, the barrier that orders C memory accesses around them, the tile-configuration layout
   and its loading, and the CPU + OS check.

   The asm claims no memory: a "memory" clobber on every tile load would make the compiler spill the
   vector accumulators the kernels keep live around it. Instead a kernel puts BARRIER(buffer) where a
   tile reads what C code wrote or C code reads or overwrites what a tile stored. (GCC 12's tile
   intrinsics hide their memory effects from the compiler, which is why the kernels do not use them.) */
#ifndef KVBALANCE_AMX_H
#define KVBALANCE_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
/* tile numbers are literals (the asm names the register) */
#define TILE_LOAD_(t, base, stride) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t : : "r"(base), "r"((long)(stride)))
#define TILE_STORE_(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" : : "r"(base), "r"((long)(stride)))
#define TILE_LOAD(t, base, stride) TILE_LOAD_(t, base, stride)
#define TILE_STORE(t, base, stride) TILE_STORE_(t, base, stride)
#define BARRIER(p) __asm__ volatile("" : : "r"(p) : "memory")

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* palette 1, all eight tiles 16 rows; tile t colsb[t] bytes a row. Not _tile_loadconfig: GCC 12's macro
   tells the compiler it reads 8 bytes, so it drops the rest of the configuration */
static inline void amx_load_config(const uint16_t colsb[8]) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = colsb[t];
    }
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

/* AMX-BF16 and AVX-512F on this CPU (and AVX512-BF16 where need_avx512bf16), and the kernel's
   permission for this process to use tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA) */
static inline int amx_cpu_and_permission(int need_avx512bf16) {
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512f")) return 0;
    if (need_avx512bf16 && !__builtin_cpu_supports("avx512bf16")) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

#endif /* KVBALANCE_AMX_H */
