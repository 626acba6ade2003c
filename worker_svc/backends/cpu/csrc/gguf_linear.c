/* Linear layers on GGUF's own quantized blocks, fp32-dot path: out = x @ W^T (+ bias), W never
 * re-quantized; and the exact dequantization of the blocks.
 *
 * w: the tensor's bytes as the GGUF file stores them, N rows of row_bytes (K / block_size blocks
 * each; gguf_blocks.h has the formats); x: fp32 [T, K] (row stride xs); bias fp32 [N] or NULL;
 * out fp32 [T, N] (row stride os). Formats (ggml type codes): Q4_0 (2), Q4_1 (3), Q8_0 (8),
 * Q4_K (12), Q5_K (13), Q6_K (14).
 *
 * Numerics: each row is dequantized with exactly the operations of the `gguf` package's
 * dequantize (fp16 scales widened exactly, then the same fp32 multiplies and adds in the same
 * order, never fused: this file is compiled with fp-contract off), so the dequantized values are
 * bit-identical to gguf.quants.dequantize; the dot products accumulate in fp32. The result is
 * F.linear on the exactly dequantized weight up to fp32 summation order.
 *
 * Per output row: the row's blocks are dequantized into a per-thread fp32 buffer (K floats: L1
 * or L2 resident), then dotted with each of the T tokens. The quantized bytes are read once per
 * call, which is what bounds a decode step; the buffer round trip stays in cache. Rows are split
 * over OpenMP threads (static: every row costs the same).
 *
 * Paths: AVX2+FMA (integer unpacking of 32 quants at a time, 8-wide converts) when built with it,
 * the scalar reference (gguf_scalar.c) otherwise or when force_scalar is set (tests run both on
 * one build).
 *
 * The integer-dot path (gguf_q8.c, gguf_linear_q8: llama.cpp's method, activations quantized per
 * token) is the serving default for small batches; this one is its exact reference.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_blocks.h"

#if defined(GG_AVX2)
/* y[0..32) = a_g * q + b (mode 1), a_g * q - b (mode 2) or a_g * q (mode 0), q the 32 bytes of
 * v (signed when sgn), a_g the scale of 8-element group g (a0 for groups 0-1, a1 for 2-3). */
static inline __attribute__((always_inline)) void
emit32(__m256i v, int sgn, float a0, float a1, float b, int mode, float *y) {
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    const __m256 bv = _mm256_set1_ps(b);
    for (int g = 0; g < 4; g++) {
        const __m256i w = sgn ? _mm256_cvtepi8_epi32(parts[g]) : _mm256_cvtepu8_epi32(parts[g]);
        __m256 f = _mm256_mul_ps(_mm256_set1_ps(g < 2 ? a0 : a1), _mm256_cvtepi32_ps(w));
        if (mode == 1) f = _mm256_add_ps(f, bv);
        else if (mode == 2) f = _mm256_sub_ps(f, bv);
        _mm256_storeu_ps(y + 8 * g, f);
    }
}

/* one row (nb blocks) into y; Q8_0's x * d equals d * x exactly (products commute) */
static void dequant_row_avx2(int type, const uint8_t *b, int nb, float *y) {
    for (int i = 0; i < nb; i++) {
        switch (type) {
        case T_Q4_0: case T_Q4_1: {
            const int bb = type == T_Q4_0 ? 18 : 20;
            const uint8_t *p = b + i * bb;
            const __m256i v = q4_quants(_mm_loadu_si128((const __m128i *)(p + bb - 16)));
            const float d = h16(p);
            if (type == T_Q4_0) emit32(_mm256_sub_epi8(v, _mm256_set1_epi8(8)), 1, d, d, 0.0f, 0, y);
            else emit32(v, 0, d, d, h16(p + 2), 1, y);
            y += 32;
            break;
        }
        case T_Q8_0: {
            const uint8_t *p = b + i * 34;
            const float d = h16(p);
            emit32(_mm256_loadu_si256((const __m256i *)(p + 2)), 1, d, d, 0.0f, 0, y);
            y += 32;
            break;
        }
        case T_Q4_K: case T_Q5_K: {
            const int bb = type == T_Q4_K ? 144 : 176;
            const uint8_t *p = b + i * bb;
            const float d = h16(p), dmin = h16(p + 2);
            const uint8_t *sc = p + 4, *qs = type == T_Q4_K ? p + 16 : p + 48;
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));
            for (int j2 = 0; j2 < 4; j2++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j2));
                for (int half = 0; half < 2; half++) {
                    const int j = 2 * j2 + half;
                    __m256i v = nibbles(q, half);
                    if (type == T_Q5_K) v = q5k_quants(v, qh, j);
                    int s, mm;
                    scale_min_k4(j, sc, &s, &mm);
                    const float dl = d * (float)s;
                    emit32(v, 0, dl, dl, dmin * (float)mm, 2, y + 32 * j);
                }
            }
            y += QK_K;
            break;
        }
        case T_Q6_K: {
            const uint8_t *p = b + i * 210;
            const int8_t *sc = (const int8_t *)(p + 192);
            const float d = h16(p + 208);
            const __m256i off = _mm256_set1_epi8(32);
            for (int h = 0; h < 2; h++) {
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
                for (int j = 0; j < 4; j++) {
                    const __m256i l = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32 * (j & 1)));
                    const __m256i v = _mm256_sub_epi8(q6k_quants(l, qh, j), off);
                    const int e = 128 * h + 32 * j;
                    emit32(v, 1, d * (float)sc[e / 16], d * (float)sc[e / 16 + 1], 0.0f, 0, y + e);
                }
            }
            y += QK_K;
            break;
        }
        }
    }
}

static float dot_avx2(const float *a, const float *x, int K) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(x + k), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(x + k + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16), _mm256_loadu_ps(x + k + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 24), _mm256_loadu_ps(x + k + 24), s3);
    }
    for (; k + 8 <= K; k += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(x + k), s0);
    float r = hsum_f32x8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; k < K; k++) r += a[k] * x[k];
    return r;
}
#endif

static inline void dequant_row(int type, const uint8_t *b, int nb, float *y, int scalar) {
#if defined(GG_AVX2)
    if (!scalar) { dequant_row_avx2(type, b, nb, y); return; }
#endif
    (void)scalar;
    dequant_row_scalar(type, b, nb, y);
}

static inline float dot(const float *a, const float *x, int K, int scalar) {
#if defined(GG_AVX2)
    if (!scalar) return dot_avx2(a, x, K);
#endif
    (void)scalar;
    return dot_scalar(a, x, K);
}

/* Returns 0; -1 for an unsupported type or inconsistent shape (nothing written); -2 out of memory. */
int gguf_linear(int type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t xs,
                const float *bias, float *out, int64_t os, int T, int N, int K, int num_threads,
                int force_scalar) {
    if (check_blocks(type, row_bytes, N, K) || T < 0) return -1;
    if (T == 0 || N == 0) return 0;
    const int nb = K / block_elems(type);
    num_threads = threads_for_weights(num_threads, (int64_t)N * K);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *wf = aligned_alloc(64, ((size_t)K * sizeof(float) + 63) & ~(size_t)63);
        if (!wf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            if (!wf) continue;
            dequant_row(type, w + (int64_t)n * row_bytes, nb, wf, force_scalar);
            const float b = bias ? bias[n] : 0.0f;
            for (int t = 0; t < T; t++)
                out[(int64_t)t * os + n] = dot(wf, x + (int64_t)t * xs, K, force_scalar) + b;
        }
        free(wf);
    }
    return failed ? -2 : 0;
}

/* out [N, K] fp32 = the exact dequantization of w (bit-identical to gguf.quants.dequantize). */
int gguf_dequantize(int type, const uint8_t *w, int64_t row_bytes, float *out, int N, int K,
                    int num_threads, int force_scalar) {
    if (check_blocks(type, row_bytes, N, K)) return -1;
    const int nb = K / block_elems(type);
    num_threads = threads_for_weights(num_threads, (int64_t)N * K);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int n = 0; n < N; n++) dequant_row(type, w + (int64_t)n * row_bytes, nb, out + (int64_t)n * K, force_scalar);
    return 0;
}

/* 1 when gguf_linear takes this ggml type */
int gguf_linear_supports(int type) { return block_elems(type) != 0; }

/* "avx2" or "scalar": the fastest path this build runs (force_scalar picks the scalar one). */
const char *gguf_linear_isa(void) {
#if defined(GG_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}
