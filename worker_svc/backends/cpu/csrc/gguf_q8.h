/* The integer-dot path's kernel families and what they share (internal header; gguf_q8.c has
 * the method and the entry point, gguf_linear_q8).
 *
 * gguf_linear_q8 quantizes each token's activations once per call, then hands the quantized
 * activations to one of these families, each in its own source:
 *   q8_scalar_linear  the scalar reference (gguf_scalar.c): any build, or GG_Q8_SCALAR
 *   q8_tile_linear    the 8-token tile kernels (gguf_q8_tiles.c): AVX2 builds without GG_Q8_LANES
 *   rl_linear         the row-lane kernel (gguf_q8_rowlane.c): 8 rows in a vector's lanes, lane
 *                     calls of up to LANE_RL_MAX tokens and short remainders
 *   tl_linear         the token-lane kernel with 16 tokens in a zmm (gguf_q8_toklane_avx512.c):
 *                     larger lane calls on AVX-512 VNNI builds (GG_TL)
 *   t8_linear         the token-lane kernel with 8 tokens in a ymm (gguf_q8_toklane_avx2.c):
 *                     larger lane calls on AVX2 builds without it (GG_T8)
 * The three lane kernels give a token the same bits whichever of them runs it (one fp32 summation
 * order); the tile kernels and the scalar reference each have their own order. Every family keeps a
 * token's result independent of the other tokens of its call.
 *
 * The quantized activations, as every family takes them (T tokens, K = 32 fs):
 *   qa + t * qs       token t's 8-bit values q (int8 [K]), 64-byte aligned
 *   qa + t * qs + lo  its low parts q_lo when parts == 2 (lo = 0 when parts == 1)
 *   da[t * fs + b], sa[t * fs + b]  the scale d and the sum term s = d * sum of its block b of 32
 * and each writes out[t * os + n] = the token's dot with weight row n (+ bias[n]) for rows n < N
 * of w (nb native blocks of row_bytes each). Returns 0, or -2 out of memory.
 */
#ifndef SARATHI_GGUF_Q8_H
#define SARATHI_GGUF_Q8_H

#include "gguf_blocks.h"

#if defined(GG_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GG_VNNI 1      /* the ymm integer dots use vpdpbusd / vpdpwssd */
#endif
#if defined(GG_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define GG_TL 1        /* the token-lane kernel in zmm registers */
#elif defined(GG_AVX2)
#define GG_T8 1        /* the token-lane kernel in ymm registers */
#endif

#define Q8_TILE 8                     /* tokens per tile of the tile kernels; per pass of rl_rows */
#define Q8_CHUNK_BYTES (64 << 10)     /* weight bytes of a chunk of rows, unpacked or swept together */

/* The lane kernels' routing (gguf_linear_q8): calls of up to LANE_RL_MAX tokens run on the
 * row-lane kernel; larger ones in whole token-lane tiles of LANE_TILE tokens, and a remainder of
 * at most LANE_SPLIT tokens past them on the row-lane kernel (a mostly empty tile costs more). */
#define TL 16                         /* tokens per tile of tl_rows (a zmm of int32 lanes) */
#define RL_MAX_TOKENS 16              /* AVX-512 VNNI builds: LANE_RL_MAX */
#define RL_SPLIT 4                    /* and LANE_SPLIT */
#define T8 8                          /* tokens per tile of t8_rows (a ymm of int32 lanes) */
#define T8_SPLIT 4                    /* AVX2 builds: LANE_SPLIT */
#ifndef T8_RL_MAX
#define T8_RL_MAX 8                   /* and LANE_RL_MAX */
#endif

/* The AVX2 dots' s16 pair sums of this many groups of 4 weights can be added before widening:
 * 2 * max|w| * 127 * groups <= 32767 (4-bit formats 8 groups, 5- and 6-bit 4, Q8_0 1) */
#define T8_GROUPS(type) ((type) == T_Q8_0 ? 1 : (type) == T_Q5_K || (type) == T_Q6_K ? 4 : 8)

#if defined(GG_AVX2)
/* Q8_KEEP(v): the AVX2 dots' running sums stay in their order, in a register: without it GCC
 * reassociates a run's adds into a tree over all its products, which holds every product at once
 * and spills them to the stack (integer sums: the same result, only the speed changes) */
#define Q8_KEEP(v) __asm__("" : "+x"(v))

/* T tokens' activation scales da and sums sa ([t * fs + b], fs runs a token) -> by tile of `tile`
 * tokens, then run, then token: dT / sT[(k * fs + b) * tile + t] for tile k; 0 past T */
static inline void scales_by_tile(const float *da, const float *sa, int T, int64_t fs, int tile, float *dT,
                                  float *sT) {
    const int ntiles = (T + tile - 1) / tile;
    for (int k = 0; k < ntiles; k++)
        for (int64_t b = 0; b < fs; b++)
            for (int t = 0; t < tile; t++) {
                const int tt = k * tile + t;
                dT[((int64_t)k * fs + b) * tile + t] = tt < T ? da[(int64_t)tt * fs + b] : 0.0f;
                sT[((int64_t)k * fs + b) * tile + t] = tt < T ? sa[(int64_t)tt * fs + b] : 0.0f;
            }
}
#endif

/* one token's activation quantization, the reference (gguf_scalar.c): x [32 nb] -> q, ql (parts
 * 2), d, s [nb] */
KERNEL_INTERNAL void quant_act_scalar(const float *x, int nb, int parts, int8_t *q, int8_t *ql, float *d, float *s);

KERNEL_INTERNAL int q8_scalar_linear(int type, const uint8_t *w, int64_t row_bytes, const int8_t *qa, int64_t qs,
                                     int64_t lo, const float *da, const float *sa, int64_t fs, const float *bias,
                                     float *out, int64_t os, int T, int N, int nb, int num_threads);
#if defined(GG_AVX2)
KERNEL_INTERNAL int q8_tile_linear(int type, const uint8_t *w, int64_t row_bytes, const int8_t *qa, int64_t qs,
                                   int64_t lo, const float *da, const float *sa, int64_t fs, const float *bias,
                                   float *out, int64_t os, int T, int N, int nb, int parts, int num_threads);
KERNEL_INTERNAL int rl_linear(int type, const uint8_t *w, int64_t row_bytes, const int8_t *qa, int64_t qs, int64_t lo,
                              const float *da, const float *sa, int64_t fs, const float *bias, float *out, int64_t os,
                              int T, int N, int nb, int parts, int num_threads);
#endif
#if defined(GG_TL)
KERNEL_INTERNAL int tl_linear(int type, const uint8_t *w, int64_t row_bytes, const int8_t *qa, int64_t qs, int64_t lo,
                              const float *da, const float *sa, int64_t fs, const float *bias, float *out, int64_t os,
                              int T, int N, int nb, int parts, int num_threads);
#endif
#if defined(GG_T8)
KERNEL_INTERNAL int t8_linear(int type, const uint8_t *w, int64_t row_bytes, const int8_t *qa, int64_t qs, int64_t lo,
                              const float *da, const float *sa, int64_t fs, const float *bias, float *out, int64_t os,
                              int T, int N, int nb, int parts, int num_threads);
#endif

#endif
