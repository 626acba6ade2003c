/* The scalar reference of the GGUF block kernels: both methods, every format, in plain C.
 *
 * The fp32-dot path (gguf_linear.c): dequant_row_scalar dequantizes a row with exactly the
 * operations of gguf.quants.dequantize (gguf_blocks.h lists them per format), dot_scalar sums in
 * index order. The integer-dot path (gguf_q8.c): quant_act_scalar quantizes a token's activations
 * (every SIMD path's quantization is bit-identical to it), q8_row_scalar takes the same integer
 * dots and fp32 scale products as the SIMD kernels and sums them per run, in its own fp32 order.
 *
 * These run on builds without AVX2 (x86-64) and when a caller forces the scalar path (tests run
 * both paths on one build: force_scalar, GG_Q8_SCALAR). Compiled with fp-contract off: no a * b + c
 * is fused, as in every GGUF source.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <stdlib.h>

#include "gguf_q8.h"

/* ------------------------------------------------------------------------------------------ */
/* fp32-dot path                                                                              */
/* ------------------------------------------------------------------------------------------ */

/* one row (nb blocks) into y */
void dequant_row_scalar(int type, const uint8_t *b, int nb, float *y) {
    for (int i = 0; i < nb; i++) {
        switch (type) {
        case T_Q4_0: {
            const uint8_t *p = b + i * 18;
            const float d = h2f(p);
            for (int l = 0; l < 16; l++) {
                y[l] = d * (float)((int)(p[2 + l] & 15) - 8);
                y[l + 16] = d * (float)((int)(p[2 + l] >> 4) - 8);
            }
            y += 32;
            break;
        }
        case T_Q4_1: {
            const uint8_t *p = b + i * 20;
            const float d = h2f(p), m = h2f(p + 2);
            for (int l = 0; l < 16; l++) {
                y[l] = d * (float)(p[4 + l] & 15) + m;
                y[l + 16] = d * (float)(p[4 + l] >> 4) + m;
            }
            y += 32;
            break;
        }
        case T_Q8_0: {
            const uint8_t *p = b + i * 34;
            const float d = h2f(p);
            for (int l = 0; l < 32; l++) y[l] = (float)(int8_t)p[2 + l] * d;
            y += 32;
            break;
        }
        case T_Q4_K: case T_Q5_K: {
            const int bb = type == T_Q4_K ? 144 : 176;
            const uint8_t *p = b + i * bb;
            const float d = h2f(p), dmin = h2f(p + 2);
            const uint8_t *sc = p + 4, *qh = p + 16, *qs = type == T_Q4_K ? p + 16 : p + 48;
            for (int j = 0; j < 8; j++) {
                int s, mm;
                scale_min_k4(j, sc, &s, &mm);
                const float dl = d * (float)s, ml = dmin * (float)mm;
                for (int l = 0; l < 32; l++) y[32 * j + l] = dl * (float)qk_quant(type, qs, qh, j, l) - ml;
            }
            y += QK_K;
            break;
        }
        case T_Q6_K: {
            const uint8_t *p = b + i * 210;
            const uint8_t *ql = p, *qh = p + 128;
            const int8_t *sc = (const int8_t *)(p + 192);
            const float d = h2f(p + 208);
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 32; l++) {
                        const int e = 128 * h + 32 * j + l;
                        y[e] = (d * (float)sc[e / 16]) * (float)(q6k_quant(ql, qh, h, j, l) - 32);
                    }
            y += QK_K;
            break;
        }
        }
    }
}

float dot_scalar(const float *a, const float *x, int K) {
    float s = 0.0f;
    for (int k = 0; k < K; k++) s += a[k] * x[k];
    return s;
}

/* ------------------------------------------------------------------------------------------ */
/* integer-dot path                                                                           */
/* ------------------------------------------------------------------------------------------ */

/* one token: x [K] -> q [K] int8, d [K/32], s [K/32] (identical on every path: IEEE multiply,
 * round half to even, as numpy's float32 rint) */
void quant_act_scalar(const float *x, int nb, int parts, int8_t *q, int8_t *ql, float *d, float *s) {
    for (int b = 0; b < nb; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int l = 0; l < 32; l++) { const float a = xb[l] < 0 ? -xb[l] : xb[l]; amax = a > amax ? a : amax; }
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int l = 0; l < 32; l++) {
            const float v = xb[l] * id, r = __builtin_rintf(v);
            q[32 * b + l] = (int8_t)r;
            if (parts == 2) {
                const int lo = (int)__builtin_rintf((v - r) * 128.0f);
                ql[32 * b + l] = (int8_t)lo;
                sum += 128 * (int)r + lo;
            } else sum += (int)r;
        }
        d[b] = parts == 2 ? amax / 127.0f / 128.0f : amax / 127.0f;
        s[b] = d[b] * (float)sum;
    }
}

/* One row p (nb native blocks) against nt tokens: the same integer dots and fp32 scale products
 * as the SIMD kernels, summed per run (its own fp32 summation order). Not auto-vectorized: GCC 12
 * targeting AVX512-VNNI miscompiles a signed int8 x int8 dot reduction (it emits vpdpbusd, which
 * is unsigned x signed: wrong sums; reproduced here for Q8_0). */
__attribute__((optimize("no-tree-vectorize")))
static void q8_row_scalar(int type, int nt, const uint8_t *p, int nb, const int8_t *qa, int64_t qs,
                          int64_t loff, const float *da, const float *sa, int64_t fs, float *res) {
    for (int t = 0; t < nt; t++) {
        const int8_t *a_ = qa + t * qs;
#define a(i) (loff ? 128 * a_[i] + a_[(i) + loff] : a_[i])
        const float *dt = da + t * fs, *st = sa + t * fs;
        float acc = 0.0f, corr = 0.0f;
        for (int i = 0; i < nb; i++) {
            switch (type) {
            case T_Q4_0: case T_Q4_1: {
                const int bb = type == T_Q4_0 ? 18 : 20;
                const uint8_t *b = p + (int64_t)i * bb, *q = b + bb - 16;
                int dot = 0;
                for (int l = 0; l < 16; l++) dot += (q[l] & 15) * a(32 * i + l) + (q[l] >> 4) * a(32 * i + l + 16);
                const float d = h2f(b);
                acc += (float)dot * (d * dt[i]);
                corr += (type == T_Q4_0 ? -8.0f * d : h2f(b + 2)) * st[i];
                break;
            }
            case T_Q8_0: {
                const uint8_t *b = p + (int64_t)i * 34;
                int dot = 0;
                for (int l = 0; l < 32; l++) dot += (int8_t)b[2 + l] * a(32 * i + l);
                acc += (float)dot * (h2f(b) * dt[i]);
                break;
            }
            case T_Q4_K: case T_Q5_K: {
                const int bb = type == T_Q4_K ? 144 : 176;
                const uint8_t *b = p + (int64_t)i * bb;
                const float d = h2f(b), dmin = h2f(b + 2);
                const uint8_t *scp = b + 4, *qh = b + 16, *q4 = type == T_Q4_K ? b + 16 : b + 48;
                for (int j = 0; j < 8; j++) {
                    int s, mm;
                    scale_min_k4(j, scp, &s, &mm);
                    int dot = 0;
                    for (int l = 0; l < 32; l++) dot += qk_quant(type, q4, qh, j, l) * a(256 * i + 32 * j + l);
                    acc += (float)dot * ((d * (float)s) * dt[8 * i + j]);
                    corr += -(dmin * (float)mm) * st[8 * i + j];
                }
                break;
            }
            case T_Q6_K: {
                const uint8_t *b = p + (int64_t)i * 210, *ql = b, *qh = b + 128;
                const int8_t *scp = (const int8_t *)(b + 192);
                const float d = h2f(b + 208);
                for (int h = 0; h < 2; h++)
                    for (int j = 0; j < 4; j++) {
                        const int e0 = 128 * h + 32 * j;
                        int dots[2] = {0, 0};
                        for (int l = 0; l < 32; l++) dots[l >> 4] += (q6k_quant(ql, qh, h, j, l) - 32) * a(256 * i + e0 + l);
                        const float dab = dt[8 * i + 4 * h + j];
                        acc += (float)dots[0] * ((d * (float)scp[e0 / 16]) * dab)
                             + (float)dots[1] * ((d * (float)scp[e0 / 16 + 1]) * dab);
                    }
                break;
            }
            }
        }
        res[t] = acc + corr;
#undef a
    }
}

/* q8_row_scalar over every row and token (gguf_q8.h): the threads' rows in chunks, tokens in
 * tiles of Q8_TILE, as the tile kernels run them (each token's result is computed alone) */
int q8_scalar_linear(int type, const uint8_t *w, int64_t row_bytes, const int8_t *qa, int64_t qs, int64_t lo,
                     const float *da, const float *sa, int64_t fs, const float *bias, float *out, int64_t os,
                     int T, int N, int nb, int num_threads) {
    int64_t rc = Q8_CHUNK_BYTES / row_bytes;
    if (rc < 1) rc = 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int r0, r1;
        thread_rows(N, &r0, &r1);
        float res[Q8_TILE];
        for (int n0 = r0; n0 < r1; n0 += (int)rc) {
            const int n1 = n0 + rc < r1 ? n0 + (int)rc : r1;
            for (int t0 = 0; t0 < T; t0 += Q8_TILE) {
                const int nt = T - t0 < Q8_TILE ? T - t0 : Q8_TILE;
                const float *dt = da + t0 * fs, *st = sa + t0 * fs;
                for (int n = n0; n < n1; n++) {
                    q8_row_scalar(type, nt, w + (int64_t)n * row_bytes, nb, qa + t0 * qs, qs, lo, dt, st, fs, res);
                    const float b = bias ? bias[n] : 0.0f;
                    for (int t = 0; t < nt; t++) out[(int64_t)(t0 + t) * os + n] = res[t] + b;
                }
            }
        }
    }
    return 0;
}
