/* The integer-dot path's token-lane kernel for AVX-512 VNNI builds (GG_TL): gguf_linear_q8 with
 * GG_Q8_LANES, calls of more than RL_MAX_TOKENS tokens, in whole tiles of TL = 16 tokens (smaller
 * calls and a remainder of at most RL_SPLIT tokens run on the row-lane kernel, gguf_q8_rowlane.c).
 *
 * Layout: one token per int32 lane of a zmm, as a GEMM micro-kernel holds them. Per group of 4
 * weights of a run, one vpdpbusd multiplies the 16 tokens' 4 activation bytes by the group's 4
 * weights broadcast from memory (the EVEX {1to16} operand), for TL_ROWS rows at once; a run's
 * exact integer dot per token is then converted, scaled and accumulated once for all 16 tokens:
 *   acc = fma(float(dot), scale * da, acc);  corr = corr + cw * sa;  result = acc + corr
 * over the row's runs in order (Q6_K: its two 16-element halves one after the other). That is the
 * lane kernels' fp32 order (the row-lane kernel and the AVX2 token-lane kernel share it): with
 * GG_Q8_LANES, the serving default where built, a token's result is bit-identical in every batch
 * composition, which greedy replay after a preemption or a scheduler restart relies on. The tile
 * kernels (gguf_q8_tiles.c) take the same integer dots but sum a token's 8 partial lanes at the
 * end: the same value up to fp32 summation order. (Keeping their order in this layout, with 8
 * partial accumulators per token, gave up most of the gain over them.)
 *
 * vpdpbusd multiplies unsigned by signed bytes: the weights (every format's values fit s8) are the
 * signed operand and the activations go unsigned as q + 128; the offset's share, 128 sum(w) per
 * part, is subtracted in int32 (exact). The weights of a chunk of rows are unpacked once per call
 * into a per-thread buffer (32 bytes a run, and the run's scales and sum), so the call's T / TL
 * tiles share one unpacking. Partly filled tiles run whole (a zmm of 16 lanes): a ymm variant for
 * tiles of at most 8 was no faster.
 * Compiled with fp-contract off, as every GGUF source.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_q8.h"

#if defined(GG_TL)
#define TL_ROWS 4   /* rows a tl_rows call, sharing each activation load */

typedef struct { float s0, s1, cw; int32_t c0, c1; } tl_meta;   /* a run's scales, sum offsets */

/* sums of a run's 32 values (u8 when SGN is 0, else s8): [elements 0-15, 16-31] (sad: 4 qword sums) */
static inline void tl_sums(__m256i v, int sgn, int *s0, int *s1) {
    const __m256i s = _mm256_sad_epu8(sgn ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v,
                                      _mm256_setzero_si256());
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm_unpackhi_epi64(_mm256_castsi256_si128(s),
                                                                                   _mm256_castsi256_si128(s)));
    const __m128i g = _mm_add_epi64(_mm256_extracti128_si256(s, 1),
                                    _mm_unpackhi_epi64(_mm256_extracti128_si256(s, 1), _mm256_extracti128_si256(s, 1)));
    *s0 = _mm_cvtsi128_si32(h) - (sgn ? 128 * 16 : 0);   /* s8 = (v ^ 0x80) - 128 */
    *s1 = _mm_cvtsi128_si32(g) - (sgn ? 128 * 16 : 0);
}

/* row p's runs -> wb (32 s8 values a run) and mt; parts: the offset's multiple (see tl_rows) */
static inline __attribute__((always_inline)) void tl_unpack(const int type, const uint8_t *p, int nb, int parts,
                                                           int8_t *wb, tl_meta *mt) {
    const int32_t mul = parts == 2 ? 128 * 128 + 128 : 128;
#define TL_UNPACK(v, SGN, s0, s1, Q6, cw, b)                                                       \
    {                                                                                              \
        _mm256_store_si256((__m256i *)(wb + 32 * (b)), v);                                         \
        int lo_, hi_;                                                                              \
        tl_sums(v, SGN, &lo_, &hi_);                                                               \
        mt[b] = Q6 ? (tl_meta){s0, s1, cw, mul * lo_, mul * hi_} : (tl_meta){s0, s1, cw, mul * (lo_ + hi_), 0}; \
    }
    FOR_EACH_RUN(type, p, nb, TL_UNPACK)
#undef TL_UNPACK
}

static void tl_unpack_any(int type, const uint8_t *p, int nb, int parts, int8_t *wb, tl_meta *mt) {
#define TL_U(TY) tl_unpack(TY, p, nb, parts, wb, mt);
    SWITCH_FORMATS(type, TL_U)
#undef TL_U
}

/* R rows (unpacked: wb + r * nr * 32, mt + r * nr; nr runs each) against a tile of TL tokens:
 * activations A (u8 q + 128) by run, part, group of 4, token: A + ((b * P + part) * 8 + g) * 64;
 * dT, sT: the tile's da, sa by run then token (TL a run). res[r * TL + t]: row r, token t. */
static inline __attribute__((always_inline)) void
tl_rows(const int R, const int P, const int Q6, const int CW, const int8_t *wb, const tl_meta *mt, int nr,
        const uint8_t *A, const float *dT, const float *sT, float *res) {
    __m512 acc[TL_ROWS], corr[TL_ROWS];
    for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); corr[r] = _mm512_setzero_ps(); }
    for (int b = 0; b < nr; b++) {
        __m512i h[TL_ROWS], l[TL_ROWS], h2[TL_ROWS], l2[TL_ROWS];
        for (int r = 0; r < R; r++) h[r] = l[r] = h2[r] = l2[r] = _mm512_setzero_si512();
        const uint8_t *Ab = A + (int64_t)b * P * 8 * 64;
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const __m512i ah = _mm512_load_si512((const void *)(Ab + g * 64));
            const __m512i al = P == 2 ? _mm512_load_si512((const void *)(Ab + (8 + g) * 64)) : ah;
            for (int r = 0; r < R; r++) {
                int32_t w4;
                memcpy(&w4, wb + ((int64_t)r * nr + b) * 32 + 4 * g, 4);
                const __m512i wv = _mm512_set1_epi32(w4);
                if (Q6 && g >= 4) {
                    h2[r] = _mm512_dpbusd_epi32(h2[r], ah, wv);
                    if (P == 2) l2[r] = _mm512_dpbusd_epi32(l2[r], al, wv);
                } else {
                    h[r] = _mm512_dpbusd_epi32(h[r], ah, wv);
                    if (P == 2) l[r] = _mm512_dpbusd_epi32(l[r], al, wv);
                }
            }
        }
        const __m512 da = _mm512_load_ps(dT + (int64_t)b * TL), sav = _mm512_load_ps(sT + (int64_t)b * TL);
        for (int r = 0; r < R; r++) {
            const tl_meta m = mt[(int64_t)r * nr + b];
            __m512i d = P == 2 ? _mm512_add_epi32(_mm512_slli_epi32(h[r], 7), l[r]) : h[r];
            d = _mm512_sub_epi32(d, _mm512_set1_epi32(m.c0));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(_mm512_set1_ps(m.s0), da), acc[r]);
            if (Q6) {
                __m512i d2 = P == 2 ? _mm512_add_epi32(_mm512_slli_epi32(h2[r], 7), l2[r]) : h2[r];
                d2 = _mm512_sub_epi32(d2, _mm512_set1_epi32(m.c1));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d2), _mm512_mul_ps(_mm512_set1_ps(m.s1), da), acc[r]);
            }
            if (CW)
                corr[r] = _mm512_add_ps(corr[r], _mm512_mul_ps(_mm512_set1_ps(m.cw), sav));
        }
    }
    for (int r = 0; r < R; r++) _mm512_store_ps(res + r * TL, _mm512_add_ps(acc[r], corr[r]));
}


#define TL_RW(RR, TY, PP) tl_rows(RR, PP, TY == T_Q6_K, TY != T_Q8_0 && TY != T_Q6_K, wb, mt, nr, A, dT, sT, res)
#define TL_R(TY, PP)                                                                               \
    switch (R) {                                                                                   \
    case 1: TL_RW(1, TY, PP); break;                                                               \
    case 2: TL_RW(2, TY, PP); break;                                                               \
    case 3: TL_RW(3, TY, PP); break;                                                               \
    default: TL_RW(TL_ROWS, TY, PP); break;                                                        \
    }
#define TL_CASE(TY)                                                                                \
        if (P == 2) { TL_R(TY, 2) } else { TL_R(TY, 1) }
/* R: 1 .. TL_ROWS rows */
static void tl_rows_any(int type, int R, int P, const int8_t *wb, const tl_meta *mt, int nr, const uint8_t *A,
                        const float *dT, const float *sT, float *res) {
    SWITCH_FORMATS(type, TL_CASE)
}
#undef TL_RW
#undef TL_R
#undef TL_CASE

/* gguf_linear_q8 on the token-lane kernel (see tl_rows), from the quantized activations */
int tl_linear(int type, const uint8_t *w, int64_t row_bytes, const int8_t *qa, int64_t qs, int64_t lo,
                     const float *da, const float *sa, int64_t fs, const float *bias, float *out, int64_t os,
                     int T, int N, int nb, int parts, int num_threads) {
    const int nr = (int)fs;   /* runs of 32 per row */
    const int ntiles = (T + TL - 1) / TL;
    const int64_t tile_a = (int64_t)nr * parts * 8 * 64;   /* activation bytes of a tile */
    /* the tiles' activations (u8 q + 128) by run, part, group of 4, token, and da, sa by run then
     * token (0 past T) */
    uint8_t *A = aligned_alloc(64, (size_t)(ntiles * tile_a));
    float *dT = aligned_alloc(64, sizeof(float) * (size_t)(2 * ntiles * nr * TL));
    if (!A || !dT) { free(A); free(dT); return -2; }
    float *sT = dT + (int64_t)ntiles * nr * TL;
    /* every token writes all of its lanes' bytes; tokens past T (last tile): q = 0, lanes dropped */
    if (T % TL) memset(A + (int64_t)(ntiles - 1) * tile_a, 0x80, (size_t)tile_a);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T >= 2 * TL)
    for (int t = 0; t < T; t++) {
        uint8_t *at = A + (int64_t)(t / TL) * tile_a + (t % TL) * 4;
        for (int b = 0; b < nr; b++)
            for (int pt = 0; pt < parts; pt++) {
                const int8_t *src = qa + t * qs + pt * lo + 32 * b;
                for (int g = 0; g < 8; g++) {
                    uint32_t v;
                    memcpy(&v, src + 4 * g, 4);
                    v ^= 0x80808080u;   /* s8 q -> u8 q + 128 */
                    memcpy(at + (((int64_t)b * parts + pt) * 8 + g) * 64, &v, 4);
                }
            }
    }
    scales_by_tile(da, sa, T, fs, TL, dT, sT);
    /* each thread's rows (an even split) in chunks of about Q8_CHUNK_BYTES of blocks: a chunk is
     * unpacked once (L2 resident), then swept by every tile */
    int64_t rc = Q8_CHUNK_BYTES / row_bytes;
    if (rc < 1) rc = 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int r0, r1;
        thread_rows(N, &r0, &r1);
        int8_t *wb = aligned_alloc(64, (size_t)(rc * nr * 32));
        tl_meta *mt = malloc(sizeof(tl_meta) * (size_t)(rc * nr));
        float res[TL_ROWS * TL] __attribute__((aligned(64)));
        if (!wb || !mt) {
#pragma omp atomic write
            failed = 1;
        } else
            for (int n0 = r0; n0 < r1; n0 += (int)rc) {
                const int n1 = n0 + rc < r1 ? n0 + (int)rc : r1;
                for (int n = n0; n < n1; n++)
                    tl_unpack_any(type, w + (int64_t)n * row_bytes, nb, parts, wb + (int64_t)(n - n0) * nr * 32,
                                  mt + (int64_t)(n - n0) * nr);
                for (int k = 0; k < ntiles; k++) {
                    const int nt = T - k * TL < TL ? T - k * TL : TL;
                    for (int n = n0; n < n1; n += TL_ROWS) {
                        const int R = n1 - n < TL_ROWS ? n1 - n : TL_ROWS;
                        tl_rows_any(type, R, parts, wb + (int64_t)(n - n0) * nr * 32, mt + (int64_t)(n - n0) * nr, nr,
                                    A + k * tile_a, dT + (int64_t)k * nr * TL, sT + (int64_t)k * nr * TL, res);
                        for (int r = 0; r < R; r++) {
                            const float bb = bias ? bias[n + r] : 0.0f;
                            for (int t = 0; t < nt; t++) out[(int64_t)(k * TL + t) * os + n + r] = res[r * TL + t] + bb;
                        }
                    }
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
