/* Paged decode attention on the CPU, the portable kernel and the entry points (kvbalance/model/native.py
   explains the design and loads the library). Compiled per shape: -DGROUP=<query heads per KV head>
   -DNVEC=<head_dim / 16> -DKV_BF16=<0 | 1> (cache dtype) -DIO_BF16=<0 | 1> (queries and output)
   -DHAVE_AMX=<0 | 1>, together with decode_attention_amx.c and decode_attention_avx2.c; the entry point
   runs the AMX path where it is compiled in and asked for, else the AVX2 path where the target is AVX2
   without AVX-512, else the portable kernel below (GCC/Clang vector extensions, any x86-64). */
#include "decode_attention.h"

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

/* q, out: [B, KVH, GROUP, D]; k, v: [KVH, NB, BS, D]; table: [B, MAXB]; ctx: [B] (tokens with KV). */
void paged_decode_attention(const io_t *restrict q, const kv_t *restrict k, const kv_t *restrict v,
                            const int64_t *restrict table, const int64_t *restrict ctx, io_t *restrict out,
                            int64_t B, int64_t KVH, int64_t NB, int64_t BS, int64_t MAXB, float scale, int nthreads,
                            int use_amx) {
    if (use_amx && BS % 16 == 0 && decode_attention_amx(q, k, v, table, ctx, out, B, KVH, NB, BS, MAXB, scale, nthreads) == 0)
        return;
    if (decode_attention_avx2(q, k, v, table, ctx, out, B, KVH, NB, BS, MAXB, scale, nthreads) == 0) return;
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
