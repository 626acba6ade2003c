/* Prefill-chunk attention on the CPU: a chunk's n query tokens against their sequence's paged
 * K/V, causally (query i sits at position start_pos + i and sees keys 0 .. start_pos + i).
 *
 * Layout: as paged_decode.c (worker_svc/kv_cache.py): k_cache, v_cache [num_blocks, block_size,
 * Hkv, D] contiguous; the sequence's token p lives at block table[p / block_size], row
 * p % block_size. q and out are the chunk's n rows of [*, Hq, D] (heads and dims contiguous, row
 * stride given). Query head h uses kv head h / G, G = Hq / Hkv (GQA).
 *
 * Why a kernel of its own: a chunk is compute-bound (every K/V row serves many queries), the
 * opposite of a decode, which reads each K/V byte once for one query. So the work is two small
 * matrix products per tile with register blocking, as a GEMM micro-kernel does:
 *   1. pack: each kv head's keys 0 .. ctx - 1 widened to fp32 once per call, K transposed in
 *      tiles of CA_KT keys (KT[tile][d][key]) and V by key (V[key][d]), zero past ctx;
 *   2. work units of CA_R rows (a row = one query token and one query head; the G heads of a
 *      kv head and as many queries as fit), each walking the key tiles up to its last query's
 *      position with an online softmax (running max m, sum l, output rescaled when m grows):
 *      scores S = q . KT as CA_R x 2 vectors of accumulators (one K load serves CA_R rows),
 *      masked on the diagonal tiles, exponentiated, then O += P . V with the same register block.
 * All arithmetic is fp32 (q scaled by `scale` first, as the decode kernel does); exp is the
 * decode kernel's polynomial. A query's result does not depend on the other queries of its
 * chunk (units share no sums), but differs from the decode kernel's in last bits (another
 * summation order), as SDPA's did.
 *
 * Units are handed out largest first (the last queries see the most keys), dynamically.
 *
 * Returns 0; -1 where the layout is not one this kernel takes (no SIMD path in this build, D not
 * a multiple of 2 SIMD_W or above CA_MAX_D, Hq % Hkv != 0): the caller runs its own path then;
 * -2 when the packed K/V cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "attention_simd.h"

#define CA_MAX_D 256

#if defined(SIMD_W)
#define CA_KT (2 * SIMD_W)   /* keys a tile: two vectors of scores a row */
#if defined(__AVX512F__)
#define CA_R 12              /* rows a unit: 24 score accumulators + 2 K vectors + 1 broadcast of 32 zmm */
#else
#define CA_R 6               /* 12 accumulators + 2 + 1 of 16 ymm */
#endif

/* kv head h's key tile t into KT (CA_KT keys: [d][key]) and V ([key][d]), fp32, zero past ctx */
static void ca_pack(const void *k_cache, const void *v_cache, int kv_dt, const int32_t *table, int ctx, int bs,
                    int Hkv, int D, int h, int t, float *KT, float *V) {
    const int64_t tok_stride = (int64_t)Hkv * D;
    float *kt = KT + (int64_t)t * D * CA_KT;
    for (int j = 0; j < CA_KT; j++) {
        const int p = t * CA_KT + j;
        float *vr = V + (int64_t)p * D;
        if (p >= ctx) {
            for (int d = 0; d < D; d++) kt[d * CA_KT + j] = 0.0f;
            memset(vr, 0, sizeof(float) * (size_t)D);
            continue;
        }
        const int64_t e = ((int64_t)table[p / bs] * bs + p % bs) * tok_stride + (int64_t)h * D;
        for (int d = 0; d < D; d += SIMD_W) {
            float tmp[SIMD_W] __attribute__((aligned(64)));
            vstore(tmp, vload1(k_cache, kv_dt, e + d));
            for (int w = 0; w < SIMD_W; w++) kt[(d + w) * CA_KT + j] = tmp[w];
            vstore(vr + d, vload1(v_cache, kv_dt, e + d));
        }
    }
}

/* One unit: rows qs [CA_R][D] (scaled queries), pos [CA_R] (each row's last visible key; the
 * rows' least is pos_min, their greatest pos_max), against kv head's packed KT and V. O [CA_R][D]
 * receives the unnormalized output, l the softmax sums. */
static inline __attribute__((always_inline)) void
ca_unit(const int D, const float *qs, const int *pos, int pos_min, int pos_max, const float *KT, const float *V,
        float *O, float *l) {
    float m[CA_R], c[CA_R];
    float P[CA_R * CA_KT] __attribute__((aligned(64)));
    for (int r = 0; r < CA_R; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    memset(O, 0, sizeof(float) * (size_t)(CA_R * D));
    const vf ninf = vset1(-INFINITY);
    for (int t = 0; t <= pos_max / CA_KT; t++) {
        const float *kt = KT + (int64_t)t * D * CA_KT;
        vf s0[CA_R], s1[CA_R];
#pragma GCC unroll 16
        for (int r = 0; r < CA_R; r++) s0[r] = s1[r] = vzero();
        for (int d = 0; d < D; d++) {
            const vf k0 = vload(kt + d * CA_KT), k1 = vload(kt + d * CA_KT + SIMD_W);
#pragma GCC unroll 16
            for (int r = 0; r < CA_R; r++) {
                const vf qv = vset1(qs[r * D + d]);
                s0[r] = vfmadd(qv, k0, s0[r]);
                s1[r] = vfmadd(qv, k1, s1[r]);
            }
        }
        const int k0 = t * CA_KT, diag = k0 + CA_KT - 1 > pos_min;
#pragma GCC unroll 16
        for (int r = 0; r < CA_R; r++) {
            vmask m0 = vlanes_lt(CA_KT), m1 = m0;
            if (diag) {   /* keys past the row's position count for nothing */
                m0 = vlanes_lt(pos[r] - k0 + 1);
                m1 = vlanes_lt(pos[r] - k0 + 1 - SIMD_W);
                s0[r] = vsel(m0, s0[r], ninf);
                s1[r] = vsel(m1, s1[r], ninf);
            }
            const float mx = vreduce_max(vmax(s0[r], s1[r]));   /* -inf: no key of this tile */
            const float mn = mx > m[r] ? mx : m[r];              /* finite: tile 0 holds key 0 */
            c[r] = m[r] == -INFINITY ? 0.0f : expf(m[r] - mn);
            vf p0 = vexp(vsub(s0[r], vset1(mn))), p1 = vexp(vsub(s1[r], vset1(mn)));
            if (diag) {
                p0 = vsel(m0, p0, vzero());
                p1 = vsel(m1, p1, vzero());
            }
            l[r] = l[r] * c[r] + vreduce_add(vadd(p0, p1));
            m[r] = mn;
            vstore(P + r * CA_KT, p0);
            vstore(P + r * CA_KT + SIMD_W, p1);
        }
        const float *vt = V + (int64_t)k0 * D;
        for (int d0 = 0; d0 < D; d0 += 2 * SIMD_W) {
            vf a0[CA_R], a1[CA_R];
#pragma GCC unroll 16
            for (int r = 0; r < CA_R; r++) {
                const vf cr = vset1(c[r]);
                a0[r] = vmul(vload(O + r * D + d0), cr);
                a1[r] = vmul(vload(O + r * D + d0 + SIMD_W), cr);
            }
            for (int j = 0; j < CA_KT; j++) {
                const vf v0 = vload(vt + (int64_t)j * D + d0), v1 = vload(vt + (int64_t)j * D + d0 + SIMD_W);
#pragma GCC unroll 16
                for (int r = 0; r < CA_R; r++) {
                    const vf pv = vset1(P[r * CA_KT + j]);
                    a0[r] = vfmadd(pv, v0, a0[r]);
                    a1[r] = vfmadd(pv, v1, a1[r]);
                }
            }
#pragma GCC unroll 16
            for (int r = 0; r < CA_R; r++) {
                vstore(O + r * D + d0, a0[r]);
                vstore(O + r * D + d0 + SIMD_W, a1[r]);
            }
        }
    }
}
#endif

int paged_chunk_attention(const void *q, int q_dt, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                          int kv_dt, const int32_t *table, int start_pos, int n, int Hq, int Hkv, int D, int bs,
                          float scale, void *out, int out_dt, int64_t out_row_stride, int num_threads) {
#if !defined(SIMD_W)
    (void)q; (void)q_dt; (void)q_row_stride; (void)k_cache; (void)v_cache; (void)kv_dt; (void)table;
    (void)start_pos; (void)n; (void)Hq; (void)Hkv; (void)D; (void)bs; (void)scale; (void)out; (void)out_dt;
    (void)out_row_stride; (void)num_threads;
    return -1;
#else
    if (n < 1 || Hkv < 1 || Hq % Hkv != 0 || D < 1 || D > CA_MAX_D || D % (2 * SIMD_W) != 0 || start_pos < 0)
        return -1;
    const int ctx = start_pos + n, G = Hq / Hkv;
    const int nt = (ctx + CA_KT - 1) / CA_KT;   /* key tiles */
    const int64_t per_head = (int64_t)nt * CA_KT * D;   /* floats of a kv head's K (and of its V) */
    float *KT = aligned_alloc(64, sizeof(float) * (size_t)(2 * Hkv * per_head));
    if (!KT) return -2;
    float *V = KT + Hkv * per_head;
    /* a unit: NG heads of one kv head x NQ queries (NG * NQ <= CA_R rows) */
    const int NG = G < CA_R ? G : CA_R, groups = (G + NG - 1) / NG, NQ = CA_R / NG;
    const int qblocks = (n + NQ - 1) / NQ;
    const int64_t nunits = (int64_t)qblocks * Hkv * groups;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < (int64_t)Hkv * nt; i++) {
            const int h = (int)(i / nt), t = (int)(i % nt);
            ca_pack(k_cache, v_cache, kv_dt, table, ctx, bs, Hkv, D, h, t, KT + h * per_head, V + h * per_head);
        }
        /* (implicit barrier: every tile packed) */
        float qs[CA_R * CA_MAX_D] __attribute__((aligned(64)));
        float O[CA_R * CA_MAX_D] __attribute__((aligned(64)));
        float l[CA_R];
        int pos[CA_R];
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < nunits; u++) {
            const int qb = qblocks - 1 - (int)(u / ((int64_t)Hkv * groups));   /* the last queries first */
            const int rem = (int)(u % ((int64_t)Hkv * groups)), h = rem / groups, g0 = (rem % groups) * NG;
            int pos_min = INT32_MAX, pos_max = 0;
            for (int r = 0; r < CA_R; r++) {
                const int qi = qb * NQ + r / NG, g = g0 + r % NG;
                const int real = r < NQ * NG && qi < n && g < G;
                /* a padding row repeats the unit's first row (its output is dropped) */
                const int qq = real ? qi : qb * NQ, gg = real ? g : g0;
                const int64_t q0 = (int64_t)qq * q_row_stride + ((int64_t)h * G + gg) * D;
                for (int d = 0; d < D; d++) qs[r * D + d] = load_elem(q, q_dt, q0 + d) * scale;
                pos[r] = start_pos + qq;
                pos_min = pos[r] < pos_min ? pos[r] : pos_min;
                pos_max = pos[r] > pos_max ? pos[r] : pos_max;
            }
            if (D == 64) ca_unit(64, qs, pos, pos_min, pos_max, KT + h * per_head, V + h * per_head, O, l);
            else if (D == 128) ca_unit(128, qs, pos, pos_min, pos_max, KT + h * per_head, V + h * per_head, O, l);
            else ca_unit(D, qs, pos, pos_min, pos_max, KT + h * per_head, V + h * per_head, O, l);
            for (int r = 0; r < NQ * NG; r++) {
                const int qi = qb * NQ + r / NG, g = g0 + r % NG;
                if (qi >= n || g >= G) continue;
                const int64_t o0 = (int64_t)qi * out_row_stride + ((int64_t)h * G + g) * D;
                const float inv = 1.0f / l[r];
                for (int d = 0; d < D; d++) {
                    const float y = O[r * D + d] * inv;
                    if (out_dt == DT_BF16) ((uint16_t *)out)[o0 + d] = f32_to_bf16(y);
                    else ((float *)out)[o0 + d] = y;
                }
            }
        }
    }
    free(KT);
    return 0;
#endif
}
