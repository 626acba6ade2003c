/* GGUF's quantized block formats, as every GGUF kernel source reads them (internal header).
 *
 * A weight matrix [N, K] is N rows of K / block_elems(type) blocks, each block_bytes(type) bytes,
 * stored as the GGUF file stores them (little-endian; fp16 scales). Per block (gguf/quants.py
 * gives the same dequantization, value = ...):
 *   Q4_0  (32 weights, 18 B): d fp16, 16 B quants: byte l holds element l (low nibble) and l + 16
 *         (high nibble); value = d * (q - 8)
 *   Q4_1  (32, 20 B): d, m fp16, 16 B quants as Q4_0; value = d * q + m
 *   Q8_0  (32, 34 B): d fp16, 32 int8 q; value = q * d
 *   Q4_K  (256, 144 B): d, dmin fp16, 12 B packed 6-bit scale and min of the 8 sub-blocks of 32
 *         (scale_min_k4), 128 B quants: 32-byte piece c holds sub-block 2c (low nibbles) and
 *         2c + 1 (high); value = (d * sc_j) * q - dmin * m_j
 *   Q5_K  (256, 176 B): as Q4_K with 32 B qh after the scales (bit j of byte l: the fifth bit of
 *         element l of sub-block j), then the 128 B of low nibbles
 *   Q6_K  (256, 210 B): 128 B ql (low 4 bits), 64 B qh (high 2 bits), 16 int8 scales (one per 16
 *         weights), d fp16 at byte 208; element 128 h + 32 j + l (h < 2, j < 4, l < 32) is
 *         lo = (ql[64 h + 32 (j & 1) + l] >> (4 (j >> 1))) & 15, hi = (qh[32 h + l] >> (2 j)) & 3,
 *         value = (d * sc[e / 16]) * ((lo | hi << 4) - 32), e the element's index
 * The kernels reproduce these operations exactly (fp16 widened exactly, fp32 multiplies and adds
 * in this order, never fused: every gguf_*.c source is compiled with fp-contract off).
 *
 * Besides the formats: GG_AVX2, the SIMD level every GGUF source tests (AVX2 + FMA + F16C), and
 * FOR_EACH_RUN, the formats' unpacking into runs of 32 weights for the SIMD integer-dot kernels.
 */
#ifndef SARATHI_GGUF_BLOCKS_H
#define SARATHI_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "common.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GG_AVX2 1
#endif

#define QK_K 256

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

/* The kernels' dispatch: BODY(TY) for the runtime type, TY a compile-time constant in each case
 * (so each format's code is inlined and specialized); other types do nothing. */
#define SWITCH_FORMATS(type, BODY)                                                                 \
    switch (type) {                                                                                \
    case T_Q4_0: BODY(T_Q4_0) break;                                                               \
    case T_Q4_1: BODY(T_Q4_1) break;                                                               \
    case T_Q8_0: BODY(T_Q8_0) break;                                                               \
    case T_Q4_K: BODY(T_Q4_K) break;                                                               \
    case T_Q5_K: BODY(T_Q5_K) break;                                                               \
    case T_Q6_K: BODY(T_Q6_K) break;                                                               \
    }

/* (block size in elements, bytes per block) of a supported type; 0 for others */
static inline int block_elems(int type) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q8_0: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return QK_K;
    default: return 0;
    }
}

static inline int block_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

/* 0 when w (N rows of row_bytes) holds [N, K] weights of this type; -1 for an unsupported type or
 * an inconsistent shape */
static inline int check_blocks(int type, int64_t row_bytes, int N, int K) {
    const int be = block_elems(type);
    if (!be || N < 0 || K < 1 || K % be || row_bytes != (int64_t)(K / be) * block_bytes(type)) return -1;
    return 0;
}

/* the fp16 at p, exactly (in integer operations: the scalar reference) */
static inline float h2f(const uint8_t *p) { return f16_to_f32_soft((uint16_t)(p[0] | (p[1] << 8))); }

/* Q4_K / Q5_K 6-bit scale and min of sub-block j (gguf Q4_K.get_scale_min) */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* The quants, one element at a time (the scalar reference's unpacking; the SIMD helpers below do
 * the same on 32 elements). Q4_K / Q5_K: element l of sub-block j, from the 128 nibble bytes qs and
 * (Q5_K) the 32 qh bytes: 0..15, or 0..31 with the fifth bit. */
static inline __attribute__((always_inline)) int qk_quant(int type, const uint8_t *qs, const uint8_t *qh, int j, int l) {
    int v = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 15;
    if (type == T_Q5_K) v |= ((qh[l] >> j) & 1) << 4;
    return v;
}

/* Q6_K: element 128 h + 32 j + l (0..63) from the 128 ql and 64 qh bytes */
static inline __attribute__((always_inline)) int q6k_quant(const uint8_t *ql, const uint8_t *qh, int h, int j, int l) {
    const int lo = (ql[64 * h + 32 * (j & 1) + l] >> (4 * (j >> 1))) & 15;
    const int hi = (qh[32 * h + l] >> (2 * j)) & 3;
    return lo | (hi << 4);
}

#if defined(GG_AVX2)
/* the fp16 at p, exactly (F16C) */
static inline float h16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

/* The quants, 32 bytes at a time (each byte a lane, in element order; qk_quant and q6k_quant do the
 * same one element at a time). Q4_0 / Q4_1: the 16 quant bytes q (byte l: element l in the low
 * nibble, l + 16 in the high) -> the 32 values 0..15. */
static inline __attribute__((always_inline)) __m256i q4_quants(__m128i q) {
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
}

/* the low (high = 0) or high nibbles of 32 bytes (Q4_K / Q5_K: sub-blocks 2c and 2c + 1 of the
 * 32-byte piece c) */
static inline __attribute__((always_inline)) __m256i nibbles(__m256i q, int high) {
    return _mm256_and_si256(high ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(15));
}

/* Q5_K: sub-block j's nibbles u with each element's fifth bit (bit j of its byte of the 32 qh
 * bytes) as bit 4: 0..31 */
static inline __attribute__((always_inline)) __m256i q5k_quants(__m256i u, __m256i qh, int j) {
    return _mm256_or_si256(u, _mm256_and_si256(j >= 4 ? _mm256_srli_epi16(qh, j - 4) : _mm256_slli_epi16(qh, 4 - j),
                                               _mm256_set1_epi8(16)));
}

/* Q6_K: elements 128 h + 32 j .. + 31 (0..63) from l, the 32 ql bytes at 64 h + 32 (j & 1), and
 * qh, the half's 32 qh bytes at 128 + 32 h */
static inline __attribute__((always_inline)) __m256i q6k_quants(__m256i l, __m256i qh, int j) {
    const __m256i lo = nibbles(l, j >> 1);
    const __m256i hi = _mm256_and_si256(2 * j >= 4 ? _mm256_srli_epi16(qh, 2 * j - 4) : _mm256_slli_epi16(qh, 4 - 2 * j),
                                        _mm256_set1_epi8(3 << 4));
    return _mm256_or_si256(lo, hi);
}

/* Every run of 32 weights of row p (nb native blocks of `type`), in order: BODY(v, SGN, s0, s1, Q6,
 * cw, b) with v the run's 32 weight values in element order (u8 when SGN is 0: Q4_0 / Q4_1 / Q4_K /
 * Q5_K quants; s8 when 1: Q8_0, Q6_K's q - 32), s0 the run's scale (Q6 = 1, Q6_K: s0 for elements
 * 0-15, s1 for 16-31), cw the weight of the activation block's sum (Q4_0: -8 d, Q4_1: m, K-quants:
 * -dmin m; 0: none) and b the run's activation block (32 values) in the row. The one place that
 * knows the formats' layouts for the integer-dot kernels that unpack row by row (the tile kernels
 * and the token-lane kernels; the row-lane kernel unpacks 8 rows at once with the same
 * operations). BODY's arguments are plain names and constants (never expressions): the kernels'
 * macros paste them unparenthesized. */
#define FOR_EACH_RUN(type, p, nb, BODY)                                                            \
    {                                                                                              \
        for (int i_ = 0; i_ < (nb); i_++) {                                                        \
            if (type == T_Q4_0 || type == T_Q4_1) {                                                \
                const int bb_ = type == T_Q4_0 ? 18 : 20;                                          \
                const uint8_t *b_ = (p) + (int64_t)i_ * bb_;                                       \
                const __m256i u_ = q4_quants(_mm_loadu_si128((const __m128i *)(b_ + bb_ - 16)));   \
                const float d_ = h16(b_), cw_ = type == T_Q4_0 ? -8.0f * d_ : h16(b_ + 2);         \
                BODY(u_, 0, d_, 0.0f, 0, cw_, i_)                                                  \
            } else if (type == T_Q8_0) {                                                           \
                const uint8_t *b_ = (p) + (int64_t)i_ * 34;                                        \
                const __m256i v_ = _mm256_loadu_si256((const __m256i *)(b_ + 2));                  \
                const float d_ = h16(b_);                                                          \
                BODY(v_, 1, d_, 0.0f, 0, 0.0f, i_)                                                 \
            } else if (type == T_Q4_K || type == T_Q5_K) {                                         \
                const int bb_ = type == T_Q4_K ? 144 : 176;                                        \
                const uint8_t *b_ = (p) + (int64_t)i_ * bb_;                                       \
                const float d_ = h16(b_), dmin_ = h16(b_ + 2);                                     \
                const uint8_t *scp_ = b_ + 4, *q4_ = type == T_Q4_K ? b_ + 16 : b_ + 48;           \
                __m256i qh_ = _mm256_setzero_si256();                                              \
                if (type == T_Q5_K) qh_ = _mm256_loadu_si256((const __m256i *)(b_ + 16));          \
                for (int j2_ = 0; j2_ < 4; j2_++) {                                                \
                    const __m256i q_ = _mm256_loadu_si256((const __m256i *)(q4_ + 32 * j2_));      \
                    for (int half_ = 0; half_ < 2; half_++) {                                      \
                        const int j_ = 2 * j2_ + half_;                                            \
                        __m256i u_ = nibbles(q_, half_);                                           \
                        if (type == T_Q5_K) u_ = q5k_quants(u_, qh_, j_);                          \
                        int s_, mm_;                                                               \
                        scale_min_k4(j_, scp_, &s_, &mm_);                                         \
                        const float sc_ = d_ * (float)s_, cw_ = -(dmin_ * (float)mm_);             \
                        const int blk_ = 8 * i_ + j_;                                              \
                        BODY(u_, 0, sc_, 0.0f, 0, cw_, blk_)                                       \
                    }                                                                              \
                }                                                                                  \
            } else if (type == T_Q6_K) {                                                           \
                const uint8_t *b_ = (p) + (int64_t)i_ * 210;                                       \
                const int8_t *scp_ = (const int8_t *)(b_ + 192);                                   \
                const float d_ = h16(b_ + 208);                                                    \
                const __m256i off_ = _mm256_set1_epi8(32);                                         \
                for (int h_ = 0; h_ < 2; h_++) {                                                   \
                    const __m256i qh_ = _mm256_loadu_si256((const __m256i *)(b_ + 128 + 32 * h_)); \
                    for (int j_ = 0; j_ < 4; j_++) {                                               \
                        const __m256i l_ = _mm256_loadu_si256((const __m256i *)(b_ + 64 * h_ + 32 * (j_ & 1))); \
                        const __m256i v_ = _mm256_sub_epi8(q6k_quants(l_, qh_, j_), off_);         \
                        const int e_ = 128 * h_ + 32 * j_;                                         \
                        const float s0_ = d_ * (float)scp_[e_ / 16], s1_ = d_ * (float)scp_[e_ / 16 + 1]; \
                        const int blk_ = 8 * i_ + h_ * 4 + j_;                                     \
                        BODY(v_, 1, s0_, s1_, 1, 0.0f, blk_)                                       \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }
#endif

/* The scalar reference of the fp32-dot path (gguf_scalar.c): one row's nb blocks dequantized
 * into y (bit-identical to gguf.quants.dequantize), and an fp32 dot product in index order. */
KERNEL_INTERNAL void dequant_row_scalar(int type, const uint8_t *b, int nb, float *y);
KERNEL_INTERNAL float dot_scalar(const float *a, const float *x, int K);

#endif
