/* Linear layers on GGUF's own quantized blocks, integer-dot path (llama.cpp's method):
 * gguf_linear_q8, the serving default for small batches (gguf_linear.c has the exact fp32 path).
 *
 * Each token's activations are quantized once per call to 8-bit blocks of 32 (the layout of
 * every format's 32-element runs): q = round_half_even(x * 127 / amax), one fp32 scale
 * d = amax / 127 per block, and s = d * sum(q) for the formats' offset / min terms. Per token, so
 * a token's result never depends on the other tokens of the call (batch independence). Then per
 * weight run of 32 the integer dot sum(u8 weight * s8 activation) (AVX-512 VNNI vpdpbusd when
 * built with it, AVX2 maddubs + madd otherwise, or scalar), scaled in fp32 by the run's weight
 * scale times the activation block's d:
 *   Q4_0: d (q - 8)           -> d da dot(q, a) - 8 d sa
 *   Q4_1: d q + m             -> d da dot(q, a) + m sa
 *   Q8_0: d q (signed)        -> d da dot(|q|, sign(a, q))
 *   Q4_K, Q5_K: d sc_j q - dmin m_j   -> d sc_j da dot(q, a) - dmin m_j sa
 *   Q6_K: d sc_{e/16} (q - 32) (signed) -> per 16: d sc da dot(|v|, sign(a, v))
 * With parts = 2 a second 8-bit part holds the rounding remainder in 1/128 steps (x ~ d (128 q +
 * q_lo), d = amax / 127 / 128: ~15-bit activations) and each run takes two integer dots.
 * This differs from F.linear on the exact dequantization by the activation rounding only (at
 * most da/2 per element); the weights are the file's, unchanged.
 *
 * This file holds the activation quantization (identical on every path) and the dispatch to the
 * kernel families (gguf_q8.h lists them): the lane kernels (GG_Q8_LANES, where built), the
 * 8-token tile kernels (other SIMD calls), the scalar reference. Compiled with fp-contract off, as
 * every GGUF source.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_q8.h"

#if defined(GG_AVX2)
/* quant_act_scalar (gguf_scalar.c) on 8 lanes: the same IEEE operations, the same bits */
static inline __m256i pack32(__m256i i0, __m256i i1, __m256i i2, __m256i i3) {
    i0 = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    return _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void quant_act_avx2(const float *x, int nb, int parts, int8_t *q, int8_t *ql, float *d, float *s) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const int rm = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int b = 0; b < nb; b++) {
        const float *xb = x + 32 * b;
        __m256 v[4];
        for (int g = 0; g < 4; g++) v[g] = _mm256_loadu_ps(xb + 8 * g);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
        const float amax = hmax_f32x8(m);
        const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        __m256i hi[4], lo[4];
        __m256i sum = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            const __m256 sv = _mm256_mul_ps(v[g], id), r = _mm256_round_ps(sv, rm);
            hi[g] = _mm256_cvtps_epi32(r);
            if (parts == 2) {
                lo[g] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(sv, r), _mm256_set1_ps(128.0f)), rm));
                sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_slli_epi32(hi[g], 7), lo[g]));
            } else sum = _mm256_add_epi32(sum, hi[g]);
        }
        _mm256_storeu_si256((__m256i *)(q + 32 * b), pack32(hi[0], hi[1], hi[2], hi[3]));
        if (parts == 2) _mm256_storeu_si256((__m256i *)(ql + 32 * b), pack32(lo[0], lo[1], lo[2], lo[3]));
        d[b] = parts == 2 ? amax / 127.0f / 128.0f : amax / 127.0f;
        s[b] = d[b] * (float)hsum_i32x8(sum);
    }
}
#endif

/* gguf_quantize_act over num_threads threads: tokens are independent, so the same bytes for any
 * split; one thread below QUANT_MIN_TOKENS tokens (a fork costs more than it saves there) */
#define QUANT_MIN_TOKENS 32
static int quantize_act_threads(const float *x, int64_t xs, int T, int K, int8_t *q, int64_t qs, int64_t lo,
                                float *d, float *s, int parts, int force_scalar, int num_threads) {
    if (K % 32 || T < 0 || parts < 1 || parts > 2) return -1;
    const int nb = K / 32;
    (void)force_scalar;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T >= QUANT_MIN_TOKENS)
    for (int t = 0; t < T; t++) {
        const float *xt = x + (int64_t)t * xs;
        int8_t *qt = q + (int64_t)t * qs;
#if defined(GG_AVX2)
        if (!force_scalar) { quant_act_avx2(xt, nb, parts, qt, qt + lo, d + (int64_t)t * nb, s + (int64_t)t * nb); continue; }
#endif
        quant_act_scalar(xt, nb, parts, qt, qt + lo, d + (int64_t)t * nb, s + (int64_t)t * nb);
    }
    return 0;
}

/* The activation quantization (also for tests): x [T, K] (row stride xs) -> token t's high parts
 * at q + t * qs, low parts (parts == 2) at q + t * qs + lo, d and s [T, K/32]. */
int gguf_quantize_act(const float *x, int64_t xs, int T, int K, int8_t *q, int64_t qs, int64_t lo,
                      float *d, float *s, int parts, int force_scalar) {
    return quantize_act_threads(x, xs, T, K, q, qs, lo, d, s, parts, force_scalar, 1);
}


/* the lane kernels' routing for this build (gguf_q8.h) */
#if defined(GG_TL)
#define LANE_TILE TL
#define LANE_RL_MAX RL_MAX_TOKENS
#define LANE_SPLIT RL_SPLIT
#define lane_linear tl_linear
#elif defined(GG_T8)
#define LANE_TILE T8
#define LANE_RL_MAX T8_RL_MAX
#define LANE_SPLIT T8_SPLIT
#define lane_linear t8_linear
#endif

/* out [T, N] (row stride os) = x W^T (+ bias) on the integer-dot path (see the top of this file);
 * parts 1: 8-bit activations (llama.cpp's), 2: 8 + 7 bits (x ~ d (q + q_lo / 128): two integer
 * dots per run). flags: GG_Q8_SCALAR runs the scalar reference; GG_Q8_LANES the lane kernels
 * where the build has them (AVX-512 VNNI: rl_rows for 1 .. RL_MAX_TOKENS tokens, tl_rows above;
 * AVX2: rl_rows for 1 .. T8_RL_MAX, t8_rows above; one fp32 summation order for all, another than
 * the tile kernels'), else the tile kernels. Returns 0; -1 for an unsupported type or
 * inconsistent shape; -2 out of memory. */
#define GG_Q8_SCALAR 1
#define GG_Q8_LANES 2
int gguf_linear_q8(int type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t xs,
                   const float *bias, float *out, int64_t os, int T, int N, int K, int num_threads,
                   int parts, int flags) {
    const int force_scalar = flags & GG_Q8_SCALAR;
    if (check_blocks(type, row_bytes, N, K) || T < 0 || parts < 1 || parts > 2) return -1;
    if (T == 0 || N == 0) return 0;
    const int nb = K / block_elems(type);
    const int64_t kp = ((int64_t)K + 63) & ~(int64_t)63, qs = parts * kp, fs = K / 32, lo = parts == 2 ? kp : 0;
    int8_t *qa = aligned_alloc(64, (size_t)(qs * T));
    float *da = malloc(sizeof(float) * (size_t)(2 * fs * T));
    if (!qa || !da) { free(qa); free(da); return -2; }
    float *sa = da + fs * T;
    num_threads = threads_for_weights(num_threads, (int64_t)N * K);
    quantize_act_threads(x, xs, T, K, qa, qs, lo, da, sa, parts, force_scalar, num_threads);
#if defined(GG_TL) || defined(GG_T8)
    if (!force_scalar && (flags & GG_Q8_LANES)) {   /* the lane kernels: rl_rows, then tl_rows or t8_rows */
        /* above LANE_RL_MAX: whole token-lane tiles, and a remainder of at most LANE_SPLIT tokens on the
         * row-lane kernel instead of a mostly empty tile (both give every token the same bits) */
        const int r = T % LANE_TILE, ntl = T <= LANE_RL_MAX ? 0 : r && r <= LANE_SPLIT ? T - r : T;
        int rc = ntl ? lane_linear(type, w, row_bytes, qa, qs, lo, da, sa, fs, bias, out, os, ntl, N, nb, parts,
                                   num_threads) : 0;
        if (rc == 0 && ntl < T)
            rc = rl_linear(type, w, row_bytes, qa + ntl * qs, qs, lo, da + ntl * fs, sa + ntl * fs, fs, bias,
                           out + ntl * os, os, T - ntl, N, nb, parts, num_threads);
        free(qa);
        free(da);
        return rc;
    }
#endif
    int rc;
#if defined(GG_AVX2)
    if (!force_scalar)
        rc = q8_tile_linear(type, w, row_bytes, qa, qs, lo, da, sa, fs, bias, out, os, T, N, nb, parts, num_threads);
    else
#endif
        rc = q8_scalar_linear(type, w, row_bytes, qa, qs, lo, da, sa, fs, bias, out, os, T, N, nb, num_threads);
    free(qa);
    free(da);
    return rc;
}

/* 1: this build has the lane kernels (GG_Q8_LANES: rl_rows, and tl_rows or t8_rows); 0 (the scalar
 * build): GG_Q8_LANES changes nothing. */
int gguf_q8_lanes(void) {
#if defined(GG_TL) || defined(GG_T8)
    return 1;
#else
    return 0;
#endif
}

/* The integer-dot path's instructions: "avx512vnni" (vpdpbusd, vpdpwssd), "avx2" (maddubs, madd)
 * or "scalar". */
const char *gguf_q8_isa(void) {
#if defined(GG_VNNI)
    return "avx512vnni";
#elif defined(GG_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}
