/* The integer-dot path's 8-token tile kernels (AVX2; AVX-512 VNNI's vpdpbusd / vpdpwssd on ymm
 * registers where built): gguf_linear_q8's SIMD path without GG_Q8_LANES.
 *
 * Tokens run in tiles of up to Q8_TILE = 8 over each row's blocks, the weights unpacked once per
 * tile and run (FOR_EACH_RUN). Per token and run, the integer dot's 8 dword lanes (dword i: the
 * run's elements 4i..4i+3) are converted and accumulated into the token's own 8 fp32 lanes,
 * acc = fma(float(dot), scale * da, acc), summed at the end (hsum_f32x8) and added to the sa
 * terms' sum: a token's result depends on its own activations only, in this fp32 order (not the
 * lane kernels'). Tiles of up to Q8_SMALL tokens take q8_small_avx2, larger ones q8_row_avx2;
 * the two give every token the same bits. Each thread's rows (an even split) run in chunks of
 * about Q8_CHUNK_BYTES of blocks: a tile's activations stay in L1 and the chunk's blocks in L2
 * while the chunk is swept T / Q8_TILE times. Compiled with fp-contract off, as every GGUF source.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_q8.h"

#if defined(GG_AVX2)
/* 8 dword sums of 4 adjacent u8 * s8 products */
static inline __attribute__((always_inline)) __m256i dot_us(__m256i u, __m256i a) {
#if defined(GG_VNNI)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
#endif
}

/* 8 dword sums of 4 adjacent u8 * (128 a + al) products (|a| <= 127, |al| <= 64) */
static inline __attribute__((always_inline)) __m256i dot_us2(__m256i u, __m256i a, __m256i al) {
#if defined(GG_VNNI)
    return _mm256_add_epi32(_mm256_slli_epi32(dot_us(u, a), 7), dot_us(u, al));
#else
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(128)),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(u, al), _mm256_set1_epi16(1)));
#endif
}

/* Tiles of up to Q8_SMALL tokens (T = 1, 2, and a call's last 1-2 tokens) take the small-tile
 * kernel below (per-token da / sa, scalar sa terms): the tile kernel's per-run scale store and
 * vector sa terms do not pay off for 1-2 tokens. Same integer lanes, same IEEE operations per
 * token: bit-identical to the tile kernel for every token. */
#define Q8_SMALL 2

/* one run of 32 weights (u unsigned, or |v| with sgn = v for signed types) against NT tokens'
 * activation block b: acc[t] += dot * (scale * da[t][b]); corr[t] += cw * sa[t][b] */
#define RUN32_I8(u, sgn, SIGNED, scale, cw, b)                                                        \
    for (int t = 0; t < NT; t++) {                                                                 \
        __m256i a = _mm256_load_si256((const __m256i *)(qa + t * qs + 32 * (b)));                  \
        if (SIGNED) a = _mm256_sign_epi8(a, sgn);                                                  \
        __m256i dt = dot_us(u, a);                                                                 \
        if (TWO) {                                                                                 \
            __m256i al = _mm256_load_si256((const __m256i *)(qa + t * qs + loff + 32 * (b)));        \
            if (SIGNED) al = _mm256_sign_epi8(al, sgn);                                            \
            dt = _mm256_add_epi32(_mm256_slli_epi32(dt, 7), dot_us(u, al));                        \
        }                                                                                          \
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dt),                                           \
                                 _mm256_mul_ps(scale, _mm256_set1_ps(da[t * fs + (b)])), acc[t]);  \
        if (cw != 0.0f) corr[t] += cw * sa[t * fs + (b)];                                          \
    }

/* NT tokens (activations qa + t * qs, da / sa + t * fs) against one row p of nb native blocks */
static inline __attribute__((always_inline)) void
q8_small_avx2(const int type, const int NT, const int TWO, const uint8_t *p, int nb, const int8_t *qa,
            int64_t qs, int64_t loff, const float *da, const float *sa, int64_t fs, float *res) {
    __m256 acc[Q8_SMALL];
    float corr[Q8_SMALL];
    for (int t = 0; t < NT; t++) { acc[t] = _mm256_setzero_ps(); corr[t] = 0.0f; }
    /* the run's magnitudes |v| with the sign trick for signed formats (maddubs is u8 x s8); the
     * scale vector: one scale, or Q6_K's two (dwords 0-3 hold elements 0-15, 4-7 elements 16-31) */
#define SMALL_RUN(v, SGN, s0, s1, Q6, cw, b)                                                       \
    {                                                                                              \
        const __m256i u = SGN ? _mm256_sign_epi8(v, v) : v;     /* |v|: -128 -> 128 as u8 */      \
        const __m256 sc = Q6 ? _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0)) : _mm256_set1_ps(s0); \
        RUN32_I8(u, v, SGN, sc, cw, b)                                                             \
    }
    FOR_EACH_RUN(type, p, nb, SMALL_RUN)
#undef SMALL_RUN
    for (int t = 0; t < NT; t++) res[t] = hsum_f32x8(acc[t]) + corr[t];
}
#undef RUN32_I8

#define Q8_NT_SMALL(TY, TW)                                                                              \
    if (nt == 1) q8_small_avx2(TY, 1, TW, p, nb, qa, qs, lo, da, sa, fs, res);                      \
    else q8_small_avx2(TY, 2, TW, p, nb, qa, qs, lo, da, sa, fs, res);
#define Q8_CASE_SMALL(TY)                                                                                \
        if (lo) { Q8_NT_SMALL(TY, 1) } else { Q8_NT_SMALL(TY, 0) }

/* lo: offset of the low parts from the high ones (0: one part) */
static void q8_small_avx2_any(int type, int nt, const uint8_t *p, int nb, const int8_t *qa, int64_t qs,
                            int64_t lo, const float *da, const float *sa, int64_t fs, float *res) {
    SWITCH_FORMATS(type, Q8_CASE_SMALL)
}
#undef Q8_NT_SMALL
#undef Q8_CASE_SMALL

/* The tile kernel (tiles of Q8_SMALL + 1 .. Q8_TILE tokens; the small-tile kernel above is its
 * per-token reference): a tile's activations by block then token (one pointer, constant offsets),
 * per run the tile's 8 products scale * da computed once and broadcast per token, the sa terms 8
 * tokens a vector, one named accumulator per token. The dots, by gguf_linear_q8's mode:
 *   1 (parts 1): maddubs + madd on the int8 values, as the small-tile kernel;
 *   2 (parts 2, unsigned formats): two maddubs (high and low parts) and madd by 128 / by 1;
 *   0 (parts 2, Q8_0 / Q6_K): 16-bit activations a = 128 q + q_lo (|a| <= 16320), each run of 32
 *     stored as [elements 4i, 4i+1 (i < 8) | elements 4i+2, 4i+3] (act16) so that madd_epi16 of
 *     the run's two halves with the weights unpacked in that order (w16) gives dword i = the sum
 *     over elements 4i..4i+3: two multiplies a token and run and no sign trick, instead of four
 *     and two (a gain for the signed formats only, so the unsigned ones keep mode 2).
 * Every mode yields the small-tile kernel's integer lanes (dword i: elements 4i..4i+3, the exact
 * integer 128 dot_hi + dot_lo for parts 2) and the same IEEE operations per token on them, so the
 * results are bit-identical to it. */
static void act16(const int8_t *q, int64_t lo, int K, int16_t *a, int64_t stride) {
    for (int b = 0; b < K / 32; b++)
        for (int p = 0; p < 32; p++) {
            const int e = 32 * b + 4 * ((p & 15) >> 1) + (p & 1) + (p >> 4 ? 2 : 0);
            a[stride * b + p] = (int16_t)(lo ? 128 * q[e] + q[e + lo] : q[e]);
        }
}

/* 32 weight bytes in element order (u8, or s8 when sgn) -> the two 16-bit halves of act16's order */
static inline __attribute__((always_inline)) void w16(__m256i v, int sgn, __m256i *w0, __m256i *w1) {
    const __m256i sh = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    /* lanes [e0-15 evens-pairs, odd-pairs | e16-31 ...] -> qwords (0, 2, 1, 3) */
    const __m256i p = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, sh), 0xd8);
    const __m128i h0 = _mm256_castsi256_si128(p), h1 = _mm256_extracti128_si256(p, 1);
    *w0 = sgn ? _mm256_cvtepi8_epi16(h0) : _mm256_cvtepu8_epi16(h0);
    *w1 = sgn ? _mm256_cvtepi8_epi16(h1) : _mm256_cvtepu8_epi16(h1);
}

/* 8 dwords: dword i = sum of the run's elements 4i..4i+3, weight * activation */
static inline __attribute__((always_inline)) __m256i dot16(__m256i w0, __m256i w1, const int16_t *a) {
    const __m256i p0 = _mm256_madd_epi16(w0, _mm256_load_si256((const __m256i *)a));
#if defined(GG_VNNI)
    return _mm256_dpwssd_epi32(p0, w1, _mm256_load_si256((const __m256i *)(a + 16)));
#else
    return _mm256_add_epi32(p0, _mm256_madd_epi16(w1, _mm256_load_si256((const __m256i *)(a + 16))));
#endif
}

/* one run of 32 weights against NT tokens' activation block b (dT, sT: the tile's da / sa of
 * block b, one float per token, 8 a block; sd: 32-byte aligned scratch for the 8 products
 * scale * da, one multiply a run; Q6_K: the two scales' vector times da per token as before):
 * acc[t] += dot * (scale * da[t][b]) (scale one float, or 2 for Q6_K: dwords 0-3, 4-7);
 * corr[t] += cw * sa[t][b] (8 tokens a vector, when cw is not 0). The weights: w0, w1 in act16's
 * order (mode 0), or (I8 = mode 1 or 2: 8-bit activations in element order, high then low part)
 * w0 = the unsigned values or magnitudes, w1 = the signed values (SGN) for the sign trick. */
#define TOK16(t, A, w0, w1, SGN, Q6, b)                                                            \
    if (NT > t) {                                                                                  \
        __m256i dt;                                                                                \
        if (I8) {                                                                                  \
            const int8_t *ap = (const int8_t *)qa + ((int64_t)(b) * Q8_TILE + t) * 32 * I8;           \
            __m256i a = _mm256_load_si256((const __m256i *)ap);                                    \
            if (SGN) a = _mm256_sign_epi8(a, w1);                                                  \
            if (I8 == 2) {                                                                         \
                __m256i al = _mm256_load_si256((const __m256i *)(ap + 32));                        \
                if (SGN) al = _mm256_sign_epi8(al, w1);                                            \
                dt = dot_us2(w0, a, al);                                                           \
            } else dt = dot_us(w0, a);                                                             \
        } else dt = dot16(w0, w1, (const int16_t *)qa + ((int64_t)(b) * Q8_TILE + t) * 32);        \
        const __m256 st = Q6 ? _mm256_mul_ps(sv, _mm256_broadcast_ss(dT + 8 * (b) + t))            \
                             : _mm256_broadcast_ss(sd + t);                                        \
        A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dt), st, A);                                        \
    }
#define RUN32(w0, w1, SGN, scale, scale_hi, Q6, cw, b)                                             \
    {                                                                                              \
        __m256 sv = _mm256_set1_ps(scale);                                                         \
        if (Q6) sv = _mm256_set_m128(_mm_set1_ps(scale_hi), _mm_set1_ps(scale));                   \
        else _mm256_store_ps(sd, _mm256_mul_ps(sv, _mm256_load_ps(dT + 8 * (b))));                 \
        TOK16(0, a0, w0, w1, SGN, Q6, b) TOK16(1, a1, w0, w1, SGN, Q6, b)                          \
        TOK16(2, a2, w0, w1, SGN, Q6, b) TOK16(3, a3, w0, w1, SGN, Q6, b)                          \
        TOK16(4, a4, w0, w1, SGN, Q6, b) TOK16(5, a5, w0, w1, SGN, Q6, b)                          \
        TOK16(6, a6, w0, w1, SGN, Q6, b) TOK16(7, a7, w0, w1, SGN, Q6, b)                          \
        if (cw != 0.0f)                                                                            \
            corr = _mm256_add_ps(corr, _mm256_mul_ps(_mm256_set1_ps(cw), _mm256_load_ps(sT + 8 * (b)))); \
    }
/* 32 weight bytes in element order (signed when SGN) -> w0, w1 as TOK16 takes them */
#define UNPACK(v, SGN)                                                                             \
    if (I8) { w0 = SGN ? _mm256_sign_epi8(v, v) : v; w1 = v; }                                     \
    else w16(v, SGN, &w0, &w1);

/* NT tokens of a tile (activations by block then token at qa: act16's int16, or I8: int8 parts,
 * dT / sT by block then token) against one row p of nb native blocks */
static inline __attribute__((always_inline)) void
q8_row_avx2(const int type, const int NT, const int I8, const uint8_t *p, int nb, const void *qa, const float *dT,
            const float *sT, float *res) {
    /* one accumulator per token, named (GCC kept an array's elements in memory) */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, corr = a0;
    float sd[8] __attribute__((aligned(32))), cs[8] __attribute__((aligned(32)));
    __m256i w0, w1;
#define TILE_RUN(v, SGN, s0, s1, Q6, cw, b) { UNPACK(v, SGN) RUN32(w0, w1, SGN, s0, s1, Q6, cw, b) }
    FOR_EACH_RUN(type, p, nb, TILE_RUN)
#undef TILE_RUN
    _mm256_store_ps(cs, corr);
    const __m256 acc[Q8_TILE] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int t = 0; t < NT; t++) res[t] = hsum_f32x8(acc[t]) + cs[t];
}
#undef RUN32
#undef TOK16
#undef UNPACK

#define Q8_NT(TY, I8)                                                                              \
    switch (nt) {                                                                                  \
    case 3: q8_row_avx2(TY, 3, I8, p, nb, qa, dT, sT, res); break;                                 \
    case 4: q8_row_avx2(TY, 4, I8, p, nb, qa, dT, sT, res); break;                                 \
    case 5: q8_row_avx2(TY, 5, I8, p, nb, qa, dT, sT, res); break;                                 \
    case 6: q8_row_avx2(TY, 6, I8, p, nb, qa, dT, sT, res); break;                                 \
    case 7: q8_row_avx2(TY, 7, I8, p, nb, qa, dT, sT, res); break;                                 \
    default: q8_row_avx2(TY, Q8_TILE, I8, p, nb, qa, dT, sT, res); break;                          \
    }
#define Q8_CASE(TY)                                                                                \
        if (i8 == 1) { Q8_NT(TY, 1) } else if (i8 == 2) { Q8_NT(TY, 2) } else { Q8_NT(TY, 0) }

/* nt: Q8_SMALL + 1 .. Q8_TILE; i8: the dots (gguf_linear_q8's mode) */
static void q8_row_avx2_any(int type, int nt, int i8, const uint8_t *p, int nb, const void *qa, const float *dT,
                            const float *sT, float *res) {
    SWITCH_FORMATS(type, Q8_CASE)
}
#undef Q8_NT
#undef Q8_CASE

/* q8_small_avx2 / q8_row_avx2 over every row and token (gguf_q8.h) */
int q8_tile_linear(int type, const uint8_t *w, int64_t row_bytes, const int8_t *qa, int64_t qs, int64_t lo,
                   const float *da, const float *sa, int64_t fs, const float *bias, float *out, int64_t os,
                   int T, int N, int nb, int parts, int num_threads) {
    const int K = (int)(32 * fs), nb32 = (int)fs;
    /* the 8-token tiles' dots: 8-bit maddubs on the int8 parts (1: parts 1; 2: parts 2 of the
     * unsigned formats, two maddubs and two madd a token and run), or (0) 16-bit madd on act16's
     * values for parts 2 of the signed ones (Q8_0, Q6_K: no sign trick on two parts) */
    const int mode = parts == 1 ? 1 : type == T_Q8_0 || type == T_Q6_K ? 0 : 2;
    /* tiles of more than Q8_SMALL tokens: act16 activations, a tile's runs by block then token
     * (token t0 + t's block b at a16 + (t0 * K + (b * Q8_TILE + t) * 32)), and its da and sa by
     * block then token (0 past T) */
    int16_t *a16 = NULL;
    float *dT = NULL, *sT = NULL;
    if (T > Q8_SMALL) {
        const int ntiles = (T + Q8_TILE - 1) / Q8_TILE;
        a16 = aligned_alloc(64, sizeof(int16_t) * (size_t)K * (size_t)(ntiles * Q8_TILE));
        dT = aligned_alloc(64, sizeof(float) * (size_t)(2 * ntiles * fs * Q8_TILE));
        if (!a16 || !dT) { free(a16); free(dT); return -2; }
        sT = dT + (int64_t)ntiles * fs * Q8_TILE;
        for (int t = 0; t < T; t++) {
            const int64_t at = (int64_t)(t - t % Q8_TILE) * K + (t % Q8_TILE) * 32;
            if (mode == 0) act16(qa + t * qs, lo, K, a16 + at, Q8_TILE * 32);
            else    /* the int8 values in element order (the 8-bit dots' layout), high then low part */
                for (int b = 0; b < nb32; b++) {
                    int8_t *dst = (int8_t *)a16 + (at + (int64_t)b * Q8_TILE * 32) * parts;
                    memcpy(dst, qa + t * qs + 32 * b, 32);
                    if (parts == 2) memcpy(dst + 32, qa + t * qs + lo + 32 * b, 32);
                }
        }
        scales_by_tile(da, sa, T, fs, Q8_TILE, dT, sT);
    }
    /* each thread's rows (an even split, as schedule(static) over rows) in chunks of about
     * Q8_CHUNK_BYTES; per chunk, tiles of Q8_TILE tokens over the chunk's rows: the tile's
     * activations stay in L1 and the chunk's blocks in L2 while the chunk is swept T / Q8_TILE times */
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
                    const uint8_t *p = w + (int64_t)n * row_bytes;
                    if (nt <= Q8_SMALL)
                        q8_small_avx2_any(type, nt, p, nb, qa + t0 * qs, qs, lo, dt, st, fs, res);
                    else
                        q8_row_avx2_any(type, nt, mode, p, nb,
                                        parts == 1 ? (const void *)((int8_t *)a16 + (int64_t)t0 * K)
                                                   : (const void *)(a16 + (int64_t)t0 * K),
                                        dT + t0 * fs, sT + t0 * fs, res);
                    const float b = bias ? bias[n] : 0.0f;
                    for (int t = 0; t < nt; t++) out[(int64_t)(t0 + t) * os + n] = res[t] + b;
                }
            }
        }
    }
    free(a16);
    free(dT);
    return 0;
}
#endif
