/* The integer-dot path's token-lane kernel for AVX2 builds without AVX-512 VNNI (GG_T8):
 * gguf_linear_q8 with GG_Q8_LANES, calls of more than T8_RL_MAX tokens, in whole tiles of T8 = 8
 * tokens (smaller calls and a remainder of at most T8_SPLIT tokens run on the row-lane kernel,
 * gguf_q8_rowlane.c, with its AVX2 dots).
 *
 * Layout: one token per int32 lane of a ymm, on the AVX-512 token-lane kernel's numbers. Per run,
 * each token's exact integer dot is summed in the lanes, then per (row, token) the same fp32 steps
 * in the same order as tl_rows and rl_rows:
 *   acc = fma(float(dot), scale * da, acc) run after run (Q6_K: its two 16-element halves one
 *   after the other), corr = corr + cw * sa, result acc + corr,
 * so a token's result does not depend on its call's other tokens, and it is the one the AVX-512
 * VNNI lane kernels give on the same blocks and activations.
 *
 * The dots without VNNI: per group of 4 weights, maddubs multiplies the group's 4 weight bytes,
 * broadcast to every lane (unsigned: the unsigned formats' values as they are; the signed ones,
 * Q8_0 and Q6_K, as |v| with v's sign moved onto the activations, llama.cpp's sign trick), by the 8
 * tokens' 4 activation bytes (s8, as quantized), and adds adjacent pairs into 16 s16 lanes. Those
 * s16 lanes are summed over T8_GROUPS(type) groups (the most for which no sum can leave s16)
 * before one madd widens them to int32 (times 128 for the high part of parts 2): about one
 * multiply per group, token and part, where the 8-token tile kernels spend two multiplies and a
 * convert + fma per token and run. Each row's runs are unpacked once per call (FOR_EACH_RUN into
 * an L2-resident buffer, a chunk of rows at a time), then swept by every tile, two rows at a time
 * with two parts (t8_rows: the pair shares the activation loads and the core gets two independent
 * chains of fmas; a row's steps are those it runs alone).
 * Compiled with fp-contract off, as every GGUF source.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_q8.h"

#if defined(GG_T8)
typedef struct { float s0, s1, cw; } t8_meta;

/* The signed formats (Q8_0, Q6_K) with two parts: 16-bit operands instead (activations 128 q +
 * q_lo, weights widened to s16 as they are; one madd a pair of weights and 8 tokens, then one add):
 * the same exact integer dot without the sign trick and with fewer widenings than their few-group
 * 8-bit sums need. The unsigned 4- and 5-bit formats keep the 8-bit sums, where 16-bit operands
 * measured slower (bench/results/kernels/README.md, "AVX2 token lanes: 16-bit operands") */
#define T8_W16(type, parts) (((type) == T_Q8_0 || (type) == T_Q6_K) && (parts) == 2)
#define T8_WB(type, parts) (T8_W16(type, parts) ? 64 : 32)   /* unpacked bytes a run */

/* row p's runs -> wb (32 bytes a run: the values, u8 or s8 as FOR_EACH_RUN gives them) and mt */
static inline __attribute__((always_inline)) void t8_unpack(const int type, const uint8_t *p, int nb, int parts,
                                                           int8_t *wb, t8_meta *mt) {
#define T8_UNPACK(v, SGN, s0, s1, Q6, cw, b)                                                       \
    {                                                                                              \
        if (T8_W16(type, parts)) {                                                                 \
            _mm256_store_si256((__m256i *)(wb + 64 * (b)), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v))); \
            _mm256_store_si256((__m256i *)(wb + 64 * (b) + 32), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1))); \
        } else _mm256_store_si256((__m256i *)(wb + 32 * (b)), v);                                  \
        mt[b] = (t8_meta){s0, s1, cw};                                                             \
    }
    FOR_EACH_RUN(type, p, nb, T8_UNPACK)
#undef T8_UNPACK
}

static void t8_unpack_any(int type, const uint8_t *p, int nb, int parts, int8_t *wb, t8_meta *mt) {
#define T8_U(TY) t8_unpack(TY, p, nb, parts, wb, mt);
    SWITCH_FORMATS(type, T8_U)
#undef T8_U
}

/* R rows (1 or 2; unpacked: wb, T8_WB bytes a run and nr runs a row, row r at wb + r * ws * nr,
 * mt + r * nr) against a tile of T8 tokens: activations A by run, then (8-bit) part, group of 4,
 * token: A + ((b * P + part) * 8 + g) * 32, or (T8_W16) pair of elements, token:
 * A + (b * 16 + k) * 32 (s16 pairs); dT, sT: the tile's da, sa by run then token (T8 a run).
 * res[r * T8 + t]: row r, token t. Two rows share each activation load and give the core two
 * independent chains of run-after-run fmas; each row's steps and their order are those of one row
 * alone, so a row's result is the same bits whichever row it is paired with. */
static inline __attribute__((always_inline)) void
t8_rows(const int R, const int P, const int TY, const int8_t *wb, const t8_meta *mt, int nr, const int8_t *A,
        const float *dT, const float *sT, float *res) {
    const int Q6 = TY == T_Q6_K, SGN = TY == T_Q8_0 || TY == T_Q6_K, NG = T8_GROUPS(TY);
    const int64_t ws = (int64_t)nr * T8_WB(TY, P);
    const __m256i one = _mm256_set1_epi16(1);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, corr[2] = {acc[0], acc[0]};
    for (int b = 0; b < nr; b++) {
        const int8_t *Ab = A + (int64_t)b * P * 8 * 32;
        const __m256 da = _mm256_load_ps(dT + (int64_t)b * T8);
        __m256i d[2], h[2], l[2];
        for (int r = 0; r < R; r++) d[r] = h[r] = l[r] = _mm256_setzero_si256();
        if (T8_W16(TY, P)) {
#pragma GCC unroll 16
            for (int k = 0; k < 16; k++) {
                const __m256i a = _mm256_load_si256((const __m256i *)(Ab + k * 32));
                for (int r = 0; r < R; r++) {
                    int32_t wk;
                    memcpy(&wk, wb + r * ws + (int64_t)b * 64 + 4 * k, 4);
                    d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(a, _mm256_set1_epi32(wk)));
                    Q8_KEEP(d[r]);
                }
                if (Q6 && k == 7)   /* Q6_K: the first half, at its own scale */
                    for (int r = 0; r < R; r++) {
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r]),
                                                 _mm256_mul_ps(_mm256_set1_ps(mt[r * nr + b].s0), da), acc[r]);
                        d[r] = _mm256_setzero_si256();
                    }
            }
        } else {
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                const __m256i ah = _mm256_load_si256((const __m256i *)(Ab + g * 32));
                const __m256i al = P == 2 ? _mm256_load_si256((const __m256i *)(Ab + (8 + g) * 32)) : ah;
                for (int r = 0; r < R; r++) {
                    int32_t w4;
                    memcpy(&w4, wb + r * ws + (int64_t)b * 32 + 4 * g, 4);
                    const __m256i wv = _mm256_set1_epi32(w4), u = SGN ? _mm256_abs_epi8(wv) : wv;
                    h[r] = _mm256_add_epi16(h[r], _mm256_maddubs_epi16(u, SGN ? _mm256_sign_epi8(ah, wv) : ah));
                    if (P == 2) {   /* sums kept in order (Q8_KEEP; one part: faster as GCC orders it) */
                        l[r] = _mm256_add_epi16(l[r], _mm256_maddubs_epi16(u, SGN ? _mm256_sign_epi8(al, wv) : al));
                        Q8_KEEP(h[r]);
                        Q8_KEEP(l[r]);
                    }
                }
                if ((g + 1) % NG == 0)   /* widen: d += 128 h + l (parts 2), or h */
                    for (int r = 0; r < R; r++) {
                        if (P == 2)
                            d[r] = _mm256_add_epi32(d[r], _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(h[r], one), 7),
                                                                           _mm256_madd_epi16(l[r], one)));
                        else d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(h[r], one));
                        h[r] = l[r] = _mm256_setzero_si256();
                    }
                if (Q6 && g == 3)   /* Q6_K: the first half, at its own scale */
                    for (int r = 0; r < R; r++) {
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r]),
                                                 _mm256_mul_ps(_mm256_set1_ps(mt[r * nr + b].s0), da), acc[r]);
                        d[r] = _mm256_setzero_si256();
                    }
            }
        }
        for (int r = 0; r < R; r++) {
            const t8_meta m = mt[r * nr + b];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r]), _mm256_mul_ps(_mm256_set1_ps(Q6 ? m.s1 : m.s0), da), acc[r]);
            if (!SGN) corr[r] = _mm256_add_ps(corr[r], _mm256_mul_ps(_mm256_set1_ps(m.cw), _mm256_load_ps(sT + (int64_t)b * T8)));
        }
    }
    for (int r = 0; r < R; r++) _mm256_store_ps(res + r * T8, _mm256_add_ps(acc[r], corr[r]));
}

/* rows 0..rows-1 of a chunk (unpacked: wb, mt) against one tile: out[t * os + i] = row i's result
 * for token t < nt, + bias[i]. Rows in pairs where there are two parts (measured faster there;
 * one part runs faster a row at a time) */
static inline __attribute__((always_inline)) void
t8_tile(const int P, const int TY, const int8_t *wb, const t8_meta *mt, int nr, int rows, const int8_t *A,
        const float *dT, const float *sT, const float *bias, float *out, int64_t os, int nt) {
    const int64_t ws = (int64_t)nr * T8_WB(TY, P);
    float res[2 * T8] __attribute__((aligned(32)));
    for (int i = 0, R; i < rows; i += R) {
        R = P == 2 && i + 1 < rows ? 2 : 1;
        if (R == 2) t8_rows(2, P, TY, wb + i * ws, mt + (int64_t)i * nr, nr, A, dT, sT, res);
        else t8_rows(1, P, TY, wb + i * ws, mt + (int64_t)i * nr, nr, A, dT, sT, res);
        for (int r = 0; r < R; r++) {
            const float bb = bias ? bias[i + r] : 0.0f;
            for (int t = 0; t < nt; t++) out[(int64_t)t * os + i + r] = res[r * T8 + t] + bb;
        }
    }
}

#define T8_CASE(TY)                                                                                \
        if (P == 2) t8_tile(2, TY, wb, mt, nr, rows, A, dT, sT, bias, out, os, nt);                \
        else t8_tile(1, TY, wb, mt, nr, rows, A, dT, sT, bias, out, os, nt);
static void t8_tile_any(int type, int P, const int8_t *wb, const t8_meta *mt, int nr, int rows, const int8_t *A,
                        const float *dT, const float *sT, const float *bias, float *out, int64_t os, int nt) {
    SWITCH_FORMATS(type, T8_CASE)
}
#undef T8_CASE


/* gguf_linear_q8 on the AVX2 token-lane kernel (see t8_rows), from the quantized activations */
int t8_linear(int type, const uint8_t *w, int64_t row_bytes, const int8_t *qa, int64_t qs, int64_t lo,
                     const float *da, const float *sa, int64_t fs, const float *bias, float *out, int64_t os,
                     int T, int N, int nb, int parts, int num_threads) {
    const int nr = (int)fs;   /* runs of 32 per row */
    const int ntiles = (T + T8 - 1) / T8;
    const int64_t tile_a = (int64_t)nr * parts * 8 * 32;   /* activation bytes of a tile */
    /* the tiles' activations (s8) by run, part, group of 4, token, and da, sa by run then token
     * (0 past T) */
    int8_t *A = aligned_alloc(64, (size_t)(ntiles * tile_a));
    float *dT = aligned_alloc(64, sizeof(float) * (size_t)(2 * ntiles * nr * T8));
    if (!A || !dT) { free(A); free(dT); return -2; }
    float *sT = dT + (int64_t)ntiles * nr * T8;
    /* every token writes all of its lanes' bytes; tokens past T (last tile): q = 0, lanes dropped */
    if (T % T8) memset(A + (int64_t)(ntiles - 1) * tile_a, 0, (size_t)tile_a);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T >= 4 * T8)
    for (int t = 0; t < T; t++) {
        int8_t *at = A + (int64_t)(t / T8) * tile_a + (t % T8) * 4;
        for (int b = 0; b < nr; b++) {
            const int8_t *src = qa + t * qs + 32 * b;
            if (T8_W16(type, parts))   /* the same bytes: 16 pairs of s16 a run */
                for (int e = 0; e < 32; e += 2) {
                    const int16_t v[2] = {(int16_t)(128 * src[e] + src[e + lo]), (int16_t)(128 * src[e + 1] + src[e + 1 + lo])};
                    memcpy(at + ((int64_t)b * 16 + e / 2) * 32, v, 4);
                }
            else
                for (int pt = 0; pt < parts; pt++)
                    for (int g = 0; g < 8; g++)
                        memcpy(at + (((int64_t)b * parts + pt) * 8 + g) * 32, src + pt * lo + 4 * g, 4);
        }
    }
    scales_by_tile(da, sa, T, fs, T8, dT, sT);
    /* each thread's rows (an even split) in chunks of about Q8_CHUNK_BYTES of blocks: a chunk is
     * unpacked once (L2 resident), then swept by every tile */
    int64_t rc = Q8_CHUNK_BYTES / row_bytes;
    if (rc < 1) rc = 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int r0, r1;
        thread_rows(N, &r0, &r1);
        const int ws = T8_WB(type, parts);
        int8_t *wb = aligned_alloc(64, (size_t)(rc * nr * ws));
        t8_meta *mt = malloc(sizeof(t8_meta) * (size_t)(rc * nr));
        if (!wb || !mt) {
#pragma omp atomic write
            failed = 1;
        } else
            for (int n0 = r0; n0 < r1; n0 += (int)rc) {
                const int n1 = n0 + rc < r1 ? n0 + (int)rc : r1;
                for (int n = n0; n < n1; n++)
                    t8_unpack_any(type, w + (int64_t)n * row_bytes, nb, parts, wb + (int64_t)(n - n0) * nr * ws,
                                  mt + (int64_t)(n - n0) * nr);
                for (int k = 0; k < ntiles; k++) {
                    const int nt = T - k * T8 < T8 ? T - k * T8 : T8;
                    t8_tile_any(type, parts, wb, mt, nr, n1 - n0, A + k * tile_a, dT + (int64_t)k * nr * T8,
                                sT + (int64_t)k * nr * T8, bias ? bias + n0 : NULL, out + (int64_t)k * T8 * os + n0, os, nt);
                }
            }
        free(wb);
        free(mt);
    }
    free(A);
    free(dT);
    return failed ? -2 : 0;
}
#endif
