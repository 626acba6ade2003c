/* Linear layers on GGUF's own quantized blocks: out = x @ W^T (+ bias), W never re-quantized.
 *
 * w: the tensor's bytes as the GGUF file stores them, N rows of row_bytes (K / block_size blocks
 * each); x: fp32 [T, K] (row stride xs); bias fp32 [N] or NULL; out fp32 [T, N] (row stride os).
 * Formats (ggml type codes): Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14).
 *
 * Numerics: each row is dequantized with exactly the operations of the `gguf` package's
 * dequantize (gguf/quants.py: fp16 scales widened exactly, then the same fp32 multiplies and
 * adds in the same order, never fused: this file is compiled with fp-contract off), so the
 * dequantized values are bit-identical to gguf.quants.dequantize; the dot products accumulate in
 * fp32. The result is F.linear on the exactly dequantized weight up to fp32 summation order.
 *
 * Per output row: the row's blocks are dequantized into a per-thread fp32 buffer (K floats: L1
 * or L2 resident), then dotted with each of the T tokens. The quantized bytes are read once per
 * call, which is what bounds a decode step; the buffer round trip stays in cache. Rows are split
 * over OpenMP threads (static: every row costs the same).
 *
 * Paths: AVX2+FMA (integer unpacking of 32 quants at a time, 8-wide converts) when built with it,
 * scalar otherwise or when force_scalar is set (tests run both on one build).
 *
 * Second method, gguf_linear_q8 (the serving default for small batches, see the section at the
 * end): llama.cpp's integer dots on the same blocks, activations quantized per token.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GG_AVX2 1
#endif

#define QK_K 256
#define MIN_WEIGHTS_PER_THREAD (1 << 16)

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
static int block_elems(int type) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q8_0: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return QK_K;
    default: return 0;
    }
}

static int block_bytes(int type) {
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

/* IEEE half -> float, exact (subnormals, inf, nan), as numpy's astype(float32) */
static inline float h2f(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
    else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0) bits = sign;
    else {   /* subnormal: normalise */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K / Q5_K 6-bit scale and min of sub-block j (gguf Q4_K.get_scale_min) */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* scalar dequantization of one row (nb blocks) into y                                        */
/* ------------------------------------------------------------------------------------------ */
static void dequant_row_scalar(int type, const uint8_t *b, int nb, float *y) {
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
                const uint8_t *q = qs + 32 * (j / 2);
                const int shift = 4 * (j & 1);
                for (int l = 0; l < 32; l++) {
                    int v = (q[l] >> shift) & 15;
                    if (type == T_Q5_K) v |= ((qh[l] >> j) & 1) << 4;
                    y[32 * j + l] = dl * (float)v - ml;
                }
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
                        const int lo = (ql[64 * h + 32 * (j & 1) + l] >> (4 * (j >> 1))) & 15;
                        const int hi = (qh[32 * h + l] >> (2 * j)) & 3;
                        y[e] = (d * (float)sc[e / 16]) * (float)((lo | (hi << 4)) - 32);
                    }
            y += QK_K;
            break;
        }
        }
    }
}

static float dot_scalar(const float *a, const float *x, int K) {
    float s = 0.0f;
    for (int k = 0; k < K; k++) s += a[k] * x[k];
    return s;
}

#if defined(GG_AVX2)
static inline float h16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

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
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int i = 0; i < nb; i++) {
        switch (type) {
        case T_Q4_0: case T_Q4_1: {
            const int bb = type == T_Q4_0 ? 18 : 20;
            const uint8_t *p = b + i * bb, *qs = p + bb - 16;
            const __m128i q = _mm_loadu_si128((const __m128i *)qs);
            __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
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
                    __m256i v = _mm256_and_si256(half ? _mm256_srli_epi16(q, 4) : q, m4);
                    if (type == T_Q5_K)   /* bit j of qh[l] -> bit 4 */
                        v = _mm256_or_si256(v, _mm256_and_si256(
                            j >= 4 ? _mm256_srli_epi16(qh, j - 4) : _mm256_slli_epi16(qh, 4 - j),
                            _mm256_set1_epi8(16)));
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
            const __m256i m2 = _mm256_set1_epi8(3 << 4), off = _mm256_set1_epi8(32);
            for (int h = 0; h < 2; h++) {
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
                for (int j = 0; j < 4; j++) {
                    const __m256i l = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32 * (j & 1)));
                    const __m256i lo = _mm256_and_si256(j >> 1 ? _mm256_srli_epi16(l, 4) : l, m4);
                    /* bits (2j, 2j+1) of qh -> bits (4, 5) */
                    const __m256i hi = _mm256_and_si256(
                        2 * j >= 4 ? _mm256_srli_epi16(qh, 2 * j - 4) : _mm256_slli_epi16(qh, 4 - 2 * j), m2);
                    const __m256i v = _mm256_sub_epi8(_mm256_or_si256(lo, hi), off);
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
    const __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float r = _mm_cvtss_f32(h);
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

static int check(int type, int64_t row_bytes, int N, int K) {
    const int be = block_elems(type);
    if (!be || N < 0 || K < 1 || K % be || row_bytes != (int64_t)(K / be) * block_bytes(type)) return -1;
    return 0;
}

static int threads_for(int num_threads, int N, int K) {
    const int64_t weights = (int64_t)N * K;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > 1 + weights / MIN_WEIGHTS_PER_THREAD) num_threads = (int)(1 + weights / MIN_WEIGHTS_PER_THREAD);
    return num_threads;
}

/* Returns 0; -1 for an unsupported type or inconsistent shape (nothing written); -2 out of memory. */
int gguf_linear(int type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t xs,
                const float *bias, float *out, int64_t os, int T, int N, int K, int num_threads,
                int force_scalar) {
    if (check(type, row_bytes, N, K) || T < 0) return -1;
    if (T == 0 || N == 0) return 0;
    const int nb = K / block_elems(type);
    num_threads = threads_for(num_threads, N, K);
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
    if (check(type, row_bytes, N, K)) return -1;
    const int nb = K / block_elems(type);
    num_threads = threads_for(num_threads, N, K);
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

/* this OpenMP thread's rows [r0, r1) of N: an even split, as schedule(static) over rows */
static inline void thread_rows(int N, int *r0, int *r1) {
#ifdef _OPENMP
    const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
#else
    const int nth = 1, tid = 0;
#endif
    *r0 = (int)((int64_t)N * tid / nth);
    *r1 = (int)((int64_t)N * (tid + 1) / nth);
}

#if defined(GG_AVX2)
/* T tokens' activation scales da and sums sa ([t * fs + b], fs runs a token) -> by tile of `tile`
 * tokens, then run, then token: dT / sT[(k * fs + b) * tile + t] for tile k; 0 past T */
static void scales_by_tile(const float *da, const float *sa, int T, int64_t fs, int tile, float *dT, float *sT) {
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

/* ========================================================================================== */
/* Integer-dot path (llama.cpp's method): gguf_linear_q8                                      */
/* ========================================================================================== */
/* Each token's activations are quantized once per call to 8-bit blocks of 32 (the layout of
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
 * This differs from F.linear on the exact dequantization by the activation rounding only (at
 * most da/2 per element); the weights are the file's, unchanged. Tokens run in tiles of up to 8
 * over each row's blocks (weights unpacked once per tile; see Q8_SMALL and act16 below). */
#define Q8_TILE 8
#define Q8_CHUNK_BYTES (64 << 10)   /* the weight bytes of a chunk of rows (see gguf_linear_q8) */

/* one token: x [K] -> q [K] int8, d [K/32], s [K/32] (identical on every path: IEEE multiply,
 * round half to even, as numpy's float32 rint) */
static void quant_act_scalar(const float *x, int nb, int parts, int8_t *q, int8_t *ql, float *d, float *s) {
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

#if defined(GG_AVX2)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GG_VNNI 1
#endif

static inline __m256i pack32(__m256i i0, __m256i i1, __m256i i2, __m256i i3) {
    i0 = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    return _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline int hsum_epi32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
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
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
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
        s[b] = d[b] * (float)hsum_epi32(sum);
    }
}

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

static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* Tiles of up to Q8_SMALL tokens (T = 1, 2, and a call's last 1-2 tokens) take the older kernel
 * below (per-token da / sa, scalar sa terms): the tile kernel's per-run scale store and vector sa
 * terms do not pay off for 1-2 tokens (bench/gguf_kernels.py). Same integer lanes, same IEEE
 * operations per token: bit-identical to the tile kernel for every token. */
#define Q8_SMALL 2

/* Every run of 32 weights of row p (nb native blocks of `type`), in order: BODY(v, SGN, s0, s1, Q6,
 * cw, b) with v the run's 32 weight values in element order (u8 when SGN is 0: Q4_0 / Q4_1 / Q4_K /
 * Q5_K quants; s8 when 1: Q8_0, Q6_K's q - 32), s0 the run's scale (Q6 = 1, Q6_K: s0 for elements
 * 0-15, s1 for 16-31), cw the weight of the activation block's sum (Q4_0: -8 d, Q4_1: m, K-quants:
 * -dmin m; 0: none) and b the run's activation block (32 values) in the row. The one place that
 * knows the formats' layouts for both integer-dot kernels below. BODY's arguments are plain names
 * and constants (never expressions): the kernels' macros paste them unparenthesized. */
#define FOR_EACH_RUN(type, p, nb, BODY)                                                            \
    {                                                                                              \
        const __m256i m4_ = _mm256_set1_epi8(15);                                                  \
        for (int i_ = 0; i_ < (nb); i_++) {                                                        \
            if (type == T_Q4_0 || type == T_Q4_1) {                                                \
                const int bb_ = type == T_Q4_0 ? 18 : 20;                                          \
                const uint8_t *b_ = (p) + (int64_t)i_ * bb_;                                       \
                const __m128i q_ = _mm_loadu_si128((const __m128i *)(b_ + bb_ - 16));              \
                const __m256i u_ = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q_, 4), q_), m4_); \
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
                        __m256i u_ = _mm256_and_si256(half_ ? _mm256_srli_epi16(q_, 4) : q_, m4_); \
                        if (type == T_Q5_K)                                                        \
                            u_ = _mm256_or_si256(u_, _mm256_and_si256(                             \
                                j_ >= 4 ? _mm256_srli_epi16(qh_, j_ - 4) : _mm256_slli_epi16(qh_, 4 - j_), \
                                _mm256_set1_epi8(16)));                                            \
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
                const __m256i m2_ = _mm256_set1_epi8(3 << 4), off_ = _mm256_set1_epi8(32);         \
                for (int h_ = 0; h_ < 2; h_++) {                                                   \
                    const __m256i qh_ = _mm256_loadu_si256((const __m256i *)(b_ + 128 + 32 * h_)); \
                    for (int j_ = 0; j_ < 4; j_++) {                                               \
                        const __m256i l_ = _mm256_loadu_si256((const __m256i *)(b_ + 64 * h_ + 32 * (j_ & 1))); \
                        const __m256i lo_ = _mm256_and_si256(j_ >> 1 ? _mm256_srli_epi16(l_, 4) : l_, m4_); \
                        const __m256i hi_ = _mm256_and_si256(                                      \
                            2 * j_ >= 4 ? _mm256_srli_epi16(qh_, 2 * j_ - 4) : _mm256_slli_epi16(qh_, 4 - 2 * j_), m2_); \
                        const __m256i v_ = _mm256_sub_epi8(_mm256_or_si256(lo_, hi_), off_);       \
                        const int e_ = 128 * h_ + 32 * j_;                                         \
                        const float s0_ = d_ * (float)scp_[e_ / 16], s1_ = d_ * (float)scp_[e_ / 16 + 1]; \
                        const int blk_ = 8 * i_ + h_ * 4 + j_;                                     \
                        BODY(v_, 1, s0_, s1_, 1, 0.0f, blk_)                                       \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

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
    for (int t = 0; t < NT; t++) res[t] = hsum8(acc[t]) + corr[t];
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
 *     and two (faster for the signed formats, slower for the unsigned ones: bench/gguf_kernels.py).
 * Every mode yields the small-tile kernel's integer lanes (dword i: elements 4i..4i+3, the exact
 * integer 128 dot_hi + dot_lo for parts 2) and the same IEEE operations per token on them, so the
 * results are bit-identical to it and to the kernel before this one (bench/gguf_kernels.py
 * --baseline reports the difference: 0). */
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
    for (int t = 0; t < NT; t++) res[t] = hsum8(acc[t]) + cs[t];
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

#if defined(GG_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
/* Token-lane kernel (AVX-512 VNNI builds: Zen 4, Sapphire Rapids), for calls of more than
 * RL_MAX_TOKENS (16) tokens: tiles of TL = 16 tokens, one token per int32 lane of a zmm, as a GEMM
 * micro-kernel holds them. Per group of 4 weights of a run, one vpdpbusd multiplies the 16 tokens'
 * 4 activation bytes by the group's 4 weights broadcast from memory (the EVEX {1to16} operand),
 * for TL_ROWS rows at once; a run's exact integer dot per token is then converted, scaled and
 * accumulated once for all 16 tokens:
 *   acc = fma(float(dot), scale * da, acc);  corr = corr + cw * sa;  result = acc + corr
 * over the row's runs in order (Q6_K: its two 16-element halves one after the other). The 8-token
 * tile kernel above spends ~9 instructions on ONE token and run (its dots, then a convert and an
 * fma on that token's 8 partial lanes). Same integer dots, so the same value up to fp32 summation
 * order: the kernel above sums a token's 8 partial lanes at the end (hsum8), this one sums the
 * run's lanes in int32 first. Smaller calls run the row-lane kernel below, which has this
 * kernel's fp32 order: with GG_Q8_LANES (the serving default where built), a token's
 * result is bit-identical in every batch composition, which greedy replay after a preemption or a
 * scheduler restart relies on; without it, the tile kernels above serve every call (their own
 * order, also batch-independent). This layout with the tile kernels' summation order (8 partial
 * accumulators per token) was tried and measured 1.0-1.2x the tile kernel (one-off runs, not
 * committed), so it is not here.
 *
 * vpdpbusd multiplies unsigned by signed bytes: the weights (every format's values fit s8) are the
 * signed operand and the activations go unsigned as q + 128; the offset's share, 128 sum(w) per
 * part, is subtracted in int32 (exact). The weights of a chunk of rows are unpacked once per call
 * into a per-thread buffer (32 bytes a run, and the run's scales and sum), so the call's T / TL
 * tiles share one unpacking. Partly filled tiles run whole (a zmm of 16 lanes; a remainder of at
 * most RL_SPLIT tokens goes to the row-lane kernel instead): a ymm variant for tiles of at most 8
 * measured no faster in one-off runs on Zen 4 (T = 24 as 16 + 8 took longer
 * than T = 32 as two zmm tiles; not committed). */
#define GG_TL 1
#define TL 16
#define TL_ROWS 4

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
#endif   /* the token-lane kernel (AVX-512 VNNI) */

/* Row-lane kernel (AVX-512 VNNI builds: calls of 1 .. RL_MAX_TOKENS tokens; AVX2 builds: 1 .. T8_RL_MAX,
 * with the AVX2 dots of the second RL_TOKENS below, and Q8_0 on 16-bit pairs), on the token-lane
 * kernel's numbers: the same exact integer dot per run, and per (row, token) the same fp32 steps
 * in the same order, acc = fma(float(dot), scale * da, acc) run after run, corr = corr + cw * sa,
 * result acc + corr. So a token's result is bit-identical whichever of the two kernels its call
 * runs on. Here the lanes are rows: RL = 8 rows, one per int32 lane of a ymm. Each run's 8 x 8
 * dwords (row, group of 4 weights) are transposed in registers, so that one vpdpbusd multiplies
 * group g of all 8 rows by a token's 4 activation bytes of that group, broadcast from memory; the
 * transposed run serves all the call's tokens, and a run's dots take one convert, scale and fma
 * for 8 rows. Everything stays in registers: a block's 32-byte pieces of the 8 rows (nibbles,
 * high bits, bytes) are transposed as they are (Q4_0 / Q4_1 / Q6_K's scales 4 x 4 dwords), then
 * unpacked with FOR_EACH_RUN's operations, and the scales are decoded 8 rows a vector (fp16
 * converted 8 at a time; the K-quants' 6-bit scales and mins and Q6_K's int8 scales in the
 * lanes), with FOR_EACH_RUN's IEEE operations. An earlier version unpacked each row through
 * FOR_EACH_RUN into an L1 buffer and read the scales back lane by lane: 0.9-1.1x the tile kernels
 * at T = 1 for the K-quants (one-off runs, not committed).
 * vpdpbusd is unsigned x signed: the weights go unsigned (the unsigned formats' values as they
 * are; signed ones, Q8_0 and Q6_K, as v + 128, and 128 times the token's activation sum over the
 * run is subtracted in int32: exact), the activations as their signed bytes. An octet's rows are
 * short streams (K / 32 runs) that the hardware prefetchers barely start on: the next octet's
 * bytes are prefetched in software while this one runs (without it: ~2x slower at T = 1, one-off
 * runs on Zen 4). bench/gguf_kernels.py times it against the tile kernels. */
/* groups of 4 weights whose maddubs pair sums fit s16 when added: 2 * max|w| * 127 * groups <= 32767 */
#define T8_GROUPS(type) ((type) == T_Q8_0 ? 1 : (type) == T_Q5_K || (type) == T_Q6_K ? 4 : 8)
#define RL 8
/* calls of up to RL_MAX_TOKENS tokens run here, larger ones on the token-lane kernel, but for a
 * remainder of up to RL_SPLIT tokens past whole 16-token tiles (gguf_linear_q8): 9-16 tokens in two
 * passes took less time than one partly filled 16-token tile, and 17-20 tokens as 16 + 1-4 1.3x
 * less than two tiles (one-off runs on Zen 4) */
#define RL_MAX_TOKENS 16
#define RL_SPLIT 4

/* r[i] = row i's run (dword g: elements 4g .. 4g+3) -> o[g]: dword i = row i's group g */
static inline __attribute__((always_inline)) void rl_transpose(const __m256i *r, __m256i *o) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) {   /* rows 0-3, 4-7 */
        u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int g = 0; g < 4; g++) {
        o[g] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x20);
        o[g + 4] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x31);
    }
}

/* 32 bytes at p[r] + off of each of the 8 rows, transposed: o[g] dword r = row r's bytes 4g .. 4g+3 */
static inline __attribute__((always_inline)) void rl_load8(const uint8_t *const *p, int off, __m256i *o) {
    __m256i r[RL];
    for (int i = 0; i < RL; i++) r[i] = _mm256_loadu_si256((const __m256i *)(p[i] + off));
    rl_transpose(r, o);
}

/* 16 bytes at p[r] + off of each of the 8 rows, transposed: o[g] dword r = row r's bytes 4g .. 4g+3
 * (g < 4; rows r and r + 4 share a ymm, one per 128-bit lane, so 4 x 4 transposes in the lanes do) */
static inline __attribute__((always_inline)) void rl_load4(const uint8_t *const *p, int off, __m256i *o) {
    __m256i y[4], t[4];
    for (int r = 0; r < 4; r++)
        y[r] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p[r] + off))),
                                       _mm_loadu_si128((const __m128i *)(p[r + 4] + off)), 1);
    t[0] = _mm256_unpacklo_epi32(y[0], y[1]);
    t[1] = _mm256_unpackhi_epi32(y[0], y[1]);
    t[2] = _mm256_unpacklo_epi32(y[2], y[3]);
    t[3] = _mm256_unpackhi_epi32(y[2], y[3]);
    o[0] = _mm256_unpacklo_epi64(t[0], t[2]);
    o[1] = _mm256_unpackhi_epi64(t[0], t[2]);
    o[2] = _mm256_unpacklo_epi64(t[1], t[3]);
    o[3] = _mm256_unpackhi_epi64(t[1], t[3]);
}

/* the octet's run b (w[8]: its groups of 4, and s0v, s1v, cwv) against the call's NT tokens */
#if defined(GG_VNNI)
#define RL_Q6_OFF 96   /* Q6_K's weights unsigned: (v - 32) ^ 0x80 */
#define RL_TOKENS(b)                                                                                       \
    for (int t = 0; t < NT; t++) {                                                                     \
        const int8_t *a = qa + t * qs + 32 * b;                                                        \
        __m256i h = _mm256_setzero_si256(), l = h, h2 = h, l2 = h;                                     \
_Pragma("GCC unroll 8")                                                                                   \
        for (int g = 0; g < 8; g++) {                                                                  \
            int32_t a4;                                                                                \
            memcpy(&a4, a + 4 * g, 4);                                                                 \
            if (Q6 && g >= 4) h2 = _mm256_dpbusd_epi32(h2, w[g], _mm256_set1_epi32(a4));               \
            else h = _mm256_dpbusd_epi32(h, w[g], _mm256_set1_epi32(a4));                              \
            if (P == 2) {                                                                              \
                memcpy(&a4, a + lo + 4 * g, 4);                                                        \
                if (Q6 && g >= 4) l2 = _mm256_dpbusd_epi32(l2, w[g], _mm256_set1_epi32(a4));           \
                else l = _mm256_dpbusd_epi32(l, w[g], _mm256_set1_epi32(a4));                          \
            }                                                                                          \
        }                                                                                              \
        const int64_t tb = (int64_t)t * fs + b;                                                        \
        __m256i d = P == 2 ? _mm256_add_epi32(_mm256_slli_epi32(h, 7), l) : h;                         \
        const __m256 dav = _mm256_set1_ps(da[tb]);                                                     \
        if (SG) d = _mm256_sub_epi32(d, _mm256_set1_epi32(128 * (Q6 ? ST[2 * tb] : ST[2 * tb] + ST[2 * tb + 1])));\
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s0v, dav), acc[t]);              \
        if (Q6) {                                                                                      \
            __m256i d2 = P == 2 ? _mm256_add_epi32(_mm256_slli_epi32(h2, 7), l2) : h2;                 \
            d2 = _mm256_sub_epi32(d2, _mm256_set1_epi32(128 * ST[2 * tb + 1]));                        \
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d2), _mm256_mul_ps(s1v, dav), acc[t]);         \
        }                                                                                              \
        if (!SG) corr[t] = _mm256_add_ps(corr[t], _mm256_mul_ps(cwv, _mm256_set1_ps(sa[tb])));         \
    }


#else
/* Without VNNI: per group, maddubs of the 8 rows' 4 weight bytes (unsigned formats: the values;
 * signed ones, Q8_0 and Q6_K: |v|, v's sign moved onto the activation bytes) by the token's 4
 * activation bytes, broadcast; the s16 pair sums are added over T8_GROUPS(type) groups (no sum
 * can leave s16, see there), then widened by madd (times 128 for the high part of parts 2): the
 * same exact integer dot per run as vpdpbusd's above, so the same fp32 steps give the same bits. */
#define RL_Q6_OFF (-32)   /* Q6_K's weights signed: v - 32 */
#define RL_TOKENS(b)                                                                                       \
    {                                                                                                  \
_Pragma("GCC unroll 1")   /* one token at a time: w[8] and the sums fill AVX2's 16 registers */      \
        for (int t = 0; t < NT; t++) {                                                                 \
            const int8_t *a = qa + t * qs + 32 * b;                                                    \
            __m256i d = _mm256_setzero_si256(), d2 = d, h = d, l = d;                                  \
_Pragma("GCC unroll 8")                                                                                   \
            for (int g = 0; g < 8; g++) {                                                              \
                int32_t a4;                                                                            \
                memcpy(&a4, a + 4 * g, 4);                                                             \
                __m256i av = _mm256_set1_epi32(a4);                                                    \
                const __m256i wu = SG ? _mm256_abs_epi8(w[g]) : w[g];                                \
                h = _mm256_add_epi16(h, _mm256_maddubs_epi16(wu, SG ? _mm256_sign_epi8(av, w[g]) : av)); \
                if (P == 2) {                                                                          \
                    memcpy(&a4, a + lo + 4 * g, 4);                                                    \
                    av = _mm256_set1_epi32(a4);                                                        \
                    l = _mm256_add_epi16(l, _mm256_maddubs_epi16(wu, SG ? _mm256_sign_epi8(av, w[g]) : av)); \
                }                                                                                      \
                if ((g + 1) % T8_GROUPS(type) == 0) {                                                  \
                    __m256i s = _mm256_madd_epi16(h, P == 2 ? _mm256_set1_epi16(128) : _mm256_set1_epi16(1)); \
                    if (P == 2) s = _mm256_add_epi32(s, _mm256_madd_epi16(l, _mm256_set1_epi16(1)));    \
                    if (Q6 && g >= 4) d2 = _mm256_add_epi32(d2, s);                                    \
                    else d = _mm256_add_epi32(d, s);                                                   \
                    h = l = _mm256_setzero_si256();                                                    \
                }                                                                                      \
            }                                                                                          \
            const int64_t tb = (int64_t)t * fs + b;                                                    \
            const __m256 dav = _mm256_set1_ps(da[tb]);                                                 \
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s0v, dav), acc[t]);          \
            if (Q6) acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d2), _mm256_mul_ps(s1v, dav), acc[t]); \
            if (!SG) corr[t] = _mm256_add_ps(corr[t], _mm256_mul_ps(cwv, _mm256_set1_ps(sa[tb])));     \
        }                                                                                              \
    }
#endif

/* the low 16 bits of 8 dwords -> 8 words (vpmovdw where AVX-512 VL has it) */
static inline __m128i rl_words(__m256i x) {
#if defined(GG_VNNI)
    return _mm256_cvtepi32_epi16(x);
#else
    const __m256i m = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                       0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, m), 0x08));
#endif
}

static inline int32_t ld32(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline int32_t ld16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* An octet of rows (rows[r]: nb native blocks each) against NT tokens (activations qa + t * qs,
 * low parts at + lo, da / sa + t * fs; ST: the activation sums of each token's runs' halves, for
 * the signed formats). res[t * RL + r]: row r, token t. */
static inline __attribute__((always_inline)) void
rl_rows(const int type, const int NT, const int P, const uint8_t *const *rows, int nb, const int8_t *qa,
        int64_t qs, int64_t lo, const float *da, const float *sa, int64_t fs, const int32_t *ST, const uint8_t *pf,
        int64_t pfn, float *res) {
    /* pf: the next octet's pfn bytes, prefetched a slice a block: each row is a stream of only a few
     * cache lines, too short for the hardware prefetchers, which the 8-token tile kernels' single
     * sweep over consecutive rows feeds */
    const int64_t pfstep = ((pfn + nb - 1) / nb + 63) & ~(int64_t)63;
    const int SG = type == T_Q8_0 || type == T_Q6_K, Q6 = type == T_Q6_K;
    const int bb = block_bytes(type);
    __m256 acc[Q8_TILE], corr[Q8_TILE];
    for (int t = 0; t < NT; t++) { acc[t] = _mm256_setzero_ps(); corr[t] = _mm256_setzero_ps(); }
    for (int i = 0; i < nb; i++) {
        for (int64_t o = i * pfstep; o < (i + 1) * pfstep && o < pfn; o += 64) _mm_prefetch((const char *)pf + o, _MM_HINT_T0);
        const uint8_t *p[RL];   /* the octet's block i */
        for (int r = 0; r < RL; r++) p[r] = rows[r] + (int64_t)i * bb;
        if (type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0) {   /* one run a block */
            __m256i w[8];
            if (type == T_Q8_0) {
                rl_load8(p, 2, w);
#if defined(GG_VNNI)
                for (int g = 0; g < 8; g++) w[g] = _mm256_xor_si256(w[g], _mm256_set1_epi8((char)0x80));
#endif
            } else {
                /* 16 bytes a row: byte l holds element l (low nibble) and l + 16 (high); dword g of
                 * the 8 rows' bytes, transposed, gives groups g (low nibbles) and g + 4 (high) */
                __m256i g4[4];
                rl_load4(p, bb - 16, g4);
                const __m256i m4 = _mm256_set1_epi8(15);
                for (int g = 0; g < 4; g++) {
                    w[g] = _mm256_and_si256(g4[g], m4);
                    w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(g4[g], 4), m4);
                }
            }
            /* the rows' fp16 d (and Q4_1's m), as h16 converts them (exactly) */
            const __m256i hv = _mm256_setr_epi32(ld32(p[0]), ld32(p[1]), ld32(p[2]), ld32(p[3]), ld32(p[4]), ld32(p[5]),
                                                 ld32(p[6]), ld32(p[7]));
            const __m256 s0v = _mm256_cvtph_ps(rl_words(hv));
            const __m256 cwv = type == T_Q4_0 ? _mm256_mul_ps(_mm256_set1_ps(-8.0f), s0v)
                                              : _mm256_cvtph_ps(rl_words(_mm256_srli_epi32(hv, 16)));
            const __m256 s1v = s0v;   /* (Q6_K's second scale: not these formats) */
#if !defined(GG_VNNI)
            if (type == T_Q8_0 && P == 2) {   /* 16-bit dots on pairs of weights (ST: the activations' pairs) */
                __m256i W2[16];   /* (in L1: 16 registers' worth) */
                const __m256i sh = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                    0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
                for (int g = 0; g < 8; g++) {   /* W2[2g] dword r = row r's weights 4g, 4g+1 (s16); W2[2g+1]: 4g+2, 4g+3 */
                    const __m256i q = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w[g], sh), 0xd8);
                    W2[2 * g] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
                    W2[2 * g + 1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
                }
_Pragma("GCC unroll 1")   /* tokens in pairs: each pair of weights loaded once for two tokens */
                for (int t = 0; t < NT; t += 2) {
                    const int32_t *a0 = ST + t * 16 * fs + 16 * i, *a1 = t + 1 < NT ? a0 + 16 * fs : a0;
                    __m256i d0 = _mm256_setzero_si256(), d1 = d0;
                    for (int k = 0; k < 16; k++) {
                        d0 = _mm256_add_epi32(d0, _mm256_madd_epi16(W2[k], _mm256_set1_epi32(a0[k])));
                        d1 = _mm256_add_epi32(d1, _mm256_madd_epi16(W2[k], _mm256_set1_epi32(a1[k])));
                    }
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(s0v, _mm256_set1_ps(da[(int64_t)t * fs + i])),
                                             acc[t]);
                    if (t + 1 < NT)
                        acc[t + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1),
                                                     _mm256_mul_ps(s0v, _mm256_set1_ps(da[(int64_t)(t + 1) * fs + i])), acc[t + 1]);
                }
                continue;
            }
#endif
            RL_TOKENS(i)
            continue;
        }
        if (type == T_Q4_K || type == T_Q5_K) {   /* all in registers too: 32-byte pieces of the 8 rows transposed */
            __m256i H[8], QH[8];
            /* the first 32 bytes: dword 0 = d | dmin (fp16), dwords 1-3 = the 12 bytes of packed 6-bit
             * scales and mins; per row in the lanes after the transpose */
            rl_load8(p, 0, H);
            const __m256 dv = _mm256_cvtph_ps(rl_words(H[0]));
            const __m256 dminv = _mm256_cvtph_ps(rl_words(_mm256_srli_epi32(H[0], 16)));
            if (type == T_Q5_K) rl_load8(p, 16, QH);   /* qh: bit j of byte l is element l's fifth bit in sub-block j */
            const int q4 = type == T_Q4_K ? 16 : 48;
            const __m256i m4 = _mm256_set1_epi8(15), m63 = _mm256_set1_epi32(63);
            /* scale byte k of each row (scale_min_k4's q[k]) */
#define RL_QB(k) _mm256_and_si256(_mm256_srli_epi32(H[1 + (k) / 4], 8 * ((k) % 4)), _mm256_set1_epi32(0xff))
            for (int c = 0; c < 4; c++) {   /* 32 bytes: sub-blocks 2c (low nibbles) and 2c + 1 (high) */
                __m256i G[8];
                rl_load8(p, q4 + 32 * c, G);
                for (int half = 0; half < 2; half++) {
                    const int j = 2 * c + half;
                    __m256i w[8];
                    for (int g = 0; g < 8; g++) {
                        w[g] = _mm256_and_si256(half ? _mm256_srli_epi16(G[g], 4) : G[g], m4);
                        if (type == T_Q5_K)   /* as FOR_EACH_RUN: bit j of each byte to bit 4 */
                            w[g] = _mm256_or_si256(w[g], _mm256_and_si256(
                                j >= 4 ? _mm256_srli_epi16(QH[g], j - 4) : _mm256_slli_epi16(QH[g], 4 - j),
                                _mm256_set1_epi8(16)));
                    }
                    __m256i sc, mn;   /* scale_min_k4(j) in the lanes */
                    if (j < 4) {
                        sc = _mm256_and_si256(RL_QB(j), m63);
                        mn = _mm256_and_si256(RL_QB(j + 4), m63);
                    } else {
                        sc = _mm256_or_si256(_mm256_and_si256(RL_QB(j + 4), _mm256_set1_epi32(15)),
                                             _mm256_slli_epi32(_mm256_srli_epi32(RL_QB(j - 4), 6), 4));
                        mn = _mm256_or_si256(_mm256_srli_epi32(RL_QB(j + 4), 4),
                                             _mm256_slli_epi32(_mm256_srli_epi32(RL_QB(j), 6), 4));
                    }
                    /* FOR_EACH_RUN's sc_ = d * (float)s, cw_ = -(dmin * (float)m): the same IEEE operations */
                    const __m256 s0v = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(sc)), s1v = s0v;
                    const __m256 cwv = _mm256_xor_ps(_mm256_mul_ps(dminv, _mm256_cvtepi32_ps(mn)),
                                                     _mm256_set1_ps(-0.0f));
                    const int b = 8 * i + j;
                    RL_TOKENS(b)
                }
            }
#undef RL_QB
            continue;
        }
        {   /* Q6_K, in registers as well: ql, qh and the int8 scales of the 8 rows transposed */
            const __m256 dv = _mm256_cvtph_ps(rl_words(_mm256_setr_epi32(
                ld16(p[0] + 208), ld16(p[1] + 208), ld16(p[2] + 208), ld16(p[3] + 208), ld16(p[4] + 208),
                ld16(p[5] + 208), ld16(p[6] + 208), ld16(p[7] + 208))));
            /* the 16 int8 scales: S4[q] dword r = row r's scales 4q .. 4q + 3 */
            __m256i S4[4];
            rl_load4(p, 192, S4);
            /* scale k of each row, sign-extended */
#define RL_SC(k) _mm256_srai_epi32(_mm256_slli_epi32(S4[(k) / 4], 24 - 8 * ((k) % 4)), 24)
            const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3 << 4), off = _mm256_set1_epi8(RL_Q6_OFF);
            for (int h = 0; h < 2; h++) {
                __m256i QH[8], L[2][8];
                rl_load8(p, 128 + 32 * h, QH);
                for (int c = 0; c < 2; c++) rl_load8(p, 64 * h + 32 * c, L[c]);
                for (int j = 0; j < 4; j++) {
                    __m256i w[8];
                    /* as FOR_EACH_RUN: v = lo | hi << 4, the weight v - 32; unsigned here: (v - 32) ^ 0x80 = v + 96 */
                    for (int g = 0; g < 8; g++) {
                        const __m256i lo = _mm256_and_si256(j >> 1 ? _mm256_srli_epi16(L[j & 1][g], 4) : L[j & 1][g], m4);
                        const __m256i hi = _mm256_and_si256(
                            2 * j >= 4 ? _mm256_srli_epi16(QH[g], 2 * j - 4) : _mm256_slli_epi16(QH[g], 4 - 2 * j), m2);
                        w[g] = _mm256_add_epi8(_mm256_or_si256(lo, hi), off);
                    }
                    const int e = 128 * h + 32 * j;
                    const __m256 s0v = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(RL_SC(e / 16)));
                    const __m256 s1v = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(RL_SC(e / 16 + 1))), cwv = s0v;
                    const int b = 8 * i + 4 * h + j;
                    RL_TOKENS(b)
                }
            }
#undef RL_SC
        }
    }
    for (int t = 0; t < NT; t++) _mm256_storeu_ps(res + t * RL, _mm256_add_ps(acc[t], corr[t]));
}

#define RL_NT(TY, PP)                                                                              \
    switch (nt) {                                                                                  \
    case 1: rl_rows(TY, 1, PP, rows, nb, qa, qs, lo, da, sa, fs, ST, pf, pfn, res); break;                  \
    case 2: rl_rows(TY, 2, PP, rows, nb, qa, qs, lo, da, sa, fs, ST, pf, pfn, res); break;                  \
    case 3: rl_rows(TY, 3, PP, rows, nb, qa, qs, lo, da, sa, fs, ST, pf, pfn, res); break;                  \
    case 4: rl_rows(TY, 4, PP, rows, nb, qa, qs, lo, da, sa, fs, ST, pf, pfn, res); break;                  \
    case 5: rl_rows(TY, 5, PP, rows, nb, qa, qs, lo, da, sa, fs, ST, pf, pfn, res); break;                  \
    case 6: rl_rows(TY, 6, PP, rows, nb, qa, qs, lo, da, sa, fs, ST, pf, pfn, res); break;                  \
    case 7: rl_rows(TY, 7, PP, rows, nb, qa, qs, lo, da, sa, fs, ST, pf, pfn, res); break;                  \
    default: rl_rows(TY, Q8_TILE, PP, rows, nb, qa, qs, lo, da, sa, fs, ST, pf, pfn, res); break;           \
    }
#define RL_CASE(TY)                                                                                \
        if (P == 2) { RL_NT(TY, 2) } else { RL_NT(TY, 1) }
/* nt: 1 .. Q8_TILE tokens */
static void rl_rows_any(int type, int nt, int P, const uint8_t *const *rows, int nb, const int8_t *qa, int64_t qs,
                        int64_t lo, const float *da, const float *sa, int64_t fs, const int32_t *ST, const uint8_t *pf,
                        int64_t pfn, float *res) {
    SWITCH_FORMATS(type, RL_CASE)
}
#undef RL_NT
#undef RL_CASE


#if !defined(GG_TL)
/* Token-lane kernel for AVX2 builds without AVX-512 VNNI (Zen 3; CPUs or guests without AVX-512),
 * with GG_Q8_LANES, for calls of more than T8_RL_MAX tokens (smaller calls, and a remainder of up
 * to T8_SPLIT tokens past whole tiles, run on the row-lane kernel rl_rows with the AVX2 dots of its
 * second RL_TOKENS): tiles of T8 = 8 tokens, one token per int32 lane of a ymm, on tl_rows's numbers. Per run, each token's exact integer dot is summed in the lanes, then per
 * (row, token) the same fp32 steps in the same order as tl_rows and rl_rows:
 *   acc = fma(float(dot), scale * da, acc) run after run (Q6_K: its two 16-element halves one
 *   after the other), corr = corr + cw * sa, result acc + corr,
 * so a token's result does not depend on its call's other tokens, and it is the one the AVX-512
 * VNNI lane kernels give on the same blocks and activations.
 * The dots without VNNI: per group of 4 weights, maddubs multiplies the group's 4 weight bytes,
 * broadcast to every lane (unsigned: the unsigned formats' values as they are; the signed ones,
 * Q8_0 and Q6_K, as |v| with v's sign moved onto the activations, llama.cpp's sign trick), by
 * the 8 tokens' 4 activation bytes (s8, as quantized), and adds adjacent pairs into 16 s16 lanes.
 * Those s16 lanes are summed over T8_GROUPS(type) groups (the most for which no sum can leave
 * s16: 2 * 15 * 127 * 8 = 30480 for the 4-bit formats; 5-bit 4 groups; Q6_K 4; Q8_0 1) before one
 * madd widens them to int32 (times 128 for the high part of parts 2): about one multiply per
 * group, token and part instead of tl_rows's vpdpbusd, where the 8-token tile kernels above spend
 * two multiplies and a convert + fma per token and run. Each row's runs are unpacked once per
 * call (FOR_EACH_RUN into an L2-resident buffer, a chunk of rows at a time), then swept by every
 * tile. */
#define GG_T8 1
#define T8 8
#define T8_SPLIT 4   /* a remainder past whole tiles of up to this many tokens: row-lane */
#ifndef T8_RL_MAX
#define T8_RL_MAX 8   /* calls of up to this many tokens: row-lane only */
#endif

typedef struct { float s0, s1, cw; } t8_meta;

/* Q8_0 with two parts: 16-bit operands instead (activations 128 q + q_lo, weights widened; one
 * madd a pair of weights and 8 tokens), cheaper than Q8_0's one-group 8-bit sums with the sign trick */
#define T8_W16(type, parts) ((type) == T_Q8_0 && (parts) == 2)
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

/* One row (unpacked: wb, T8_WB bytes a run, and mt; nr runs) against a tile of T8 tokens:
 * activations A by run, then (8-bit) part, group of 4, token: A + ((b * P + part) * 8 + g) * 32, or
 * (T8_W16) pair of elements, token: A + (b * 16 + k) * 32 (s16 pairs); dT, sT: the tile's da, sa
 * by run then token (T8 a run). res[t]: token t. (Two or three rows a call, sharing the
 * activation loads, measured slower in one-off runs: their accumulators leave the 16 ymm registers.) */
static inline __attribute__((always_inline)) void
t8_row(const int P, const int TY, const int8_t *wb, const t8_meta *mt, int nr, const int8_t *A, const float *dT,
       const float *sT, float *res) {
    const int Q6 = TY == T_Q6_K, SGN = TY == T_Q8_0 || TY == T_Q6_K, NG = T8_GROUPS(TY);
    const __m256i one = _mm256_set1_epi16(1), c128 = _mm256_set1_epi16(128);
    __m256 acc = _mm256_setzero_ps(), corr = acc;
    for (int b = 0; b < nr; b++) {
        const int8_t *Ab = A + (int64_t)b * P * 8 * 32;
        const __m256 da = _mm256_load_ps(dT + (int64_t)b * T8);
        const t8_meta m = mt[b];
        __m256i d = _mm256_setzero_si256(), h = d, l = d;
        if (T8_W16(TY, P)) {
            const int8_t *w2 = wb + (int64_t)b * 64;
            for (int k = 0; k < 16; k++) {
                int32_t wk;
                memcpy(&wk, w2 + 4 * k, 4);
                d = _mm256_add_epi32(d, _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(Ab + k * 32)),
                                                          _mm256_set1_epi32(wk)));
            }
        } else {
            const int8_t *w4p = wb + (int64_t)b * 32;
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                const __m256i ah = _mm256_load_si256((const __m256i *)(Ab + g * 32));
                int32_t w4;
                memcpy(&w4, w4p + 4 * g, 4);
                const __m256i wv = _mm256_set1_epi32(w4), u = SGN ? _mm256_abs_epi8(wv) : wv;
                h = _mm256_add_epi16(h, _mm256_maddubs_epi16(u, SGN ? _mm256_sign_epi8(ah, wv) : ah));
                if (P == 2) {
                    const __m256i al = _mm256_load_si256((const __m256i *)(Ab + (8 + g) * 32));
                    l = _mm256_add_epi16(l, _mm256_maddubs_epi16(u, SGN ? _mm256_sign_epi8(al, wv) : al));
                }
                if ((g + 1) % NG == 0) {   /* widen: d += 128 h + l (parts 2), or h */
                    d = _mm256_add_epi32(d, _mm256_madd_epi16(h, P == 2 ? c128 : one));
                    if (P == 2) d = _mm256_add_epi32(d, _mm256_madd_epi16(l, one));
                    h = l = _mm256_setzero_si256();
                }
                if (Q6 && g == 3) {   /* Q6_K: the first half, at its own scale */
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(_mm256_set1_ps(m.s0), da), acc);
                    d = _mm256_setzero_si256();
                }
            }
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(_mm256_set1_ps(Q6 ? m.s1 : m.s0), da), acc);
        if (!SGN) corr = _mm256_add_ps(corr, _mm256_mul_ps(_mm256_set1_ps(m.cw), _mm256_load_ps(sT + (int64_t)b * T8)));
    }
    _mm256_store_ps(res, _mm256_add_ps(acc, corr));
}

#define T8_CASE(TY)                                                                                \
        if (P == 2) t8_row(2, TY, wb, mt, nr, A, dT, sT, res);                                     \
        else t8_row(1, TY, wb, mt, nr, A, dT, sT, res);
static void t8_row_any(int type, int P, const int8_t *wb, const t8_meta *mt, int nr, const int8_t *A,
                       const float *dT, const float *sT, float *res) {
    SWITCH_FORMATS(type, T8_CASE)
}
#undef T8_CASE

#endif
#undef FOR_EACH_RUN
#endif

/* The activation quantization (also for tests): x [T, K] (row stride xs) -> token t's high parts
 * at q + t * qs, low parts (parts == 2) at q + t * qs + lo, d and s [T, K/32]. */
int gguf_quantize_act(const float *x, int64_t xs, int T, int K, int8_t *q, int64_t qs, int64_t lo,
                      float *d, float *s, int parts, int force_scalar) {
    if (K % 32 || T < 0 || parts < 1 || parts > 2) return -1;
    const int nb = K / 32;
    (void)force_scalar;
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

/* scalar: the same integer dots and fp32 scale products, summed per run (a different fp32
 * summation order from the SIMD lanes). Not auto-vectorized: GCC 12 with AVX512-VNNI
 * (-march=znver4 / native on Zen 4) miscompiles a signed int8 x int8 dot reduction (it emits
 * vpdpbusd, which is unsigned x signed: wrong sums; reproduced here for Q8_0). */
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
                    for (int l = 0; l < 32; l++) {
                        int v = (q4[32 * (j / 2) + l] >> (4 * (j & 1))) & 15;
                        if (type == T_Q5_K) v |= ((qh[l] >> j) & 1) << 4;
                        dot += v * a(256 * i + 32 * j + l);
                    }
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
                        for (int l = 0; l < 32; l++) {
                            const int lo = (ql[64 * h + 32 * (j & 1) + l] >> (4 * (j >> 1))) & 15;
                            const int hi = (qh[32 * h + l] >> (2 * j)) & 3;
                            dots[l >> 4] += ((lo | (hi << 4)) - 32) * a(256 * i + e0 + l);
                        }
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

#if defined(GG_TL)
/* gguf_linear_q8 on the token-lane kernel (see tl_rows), from the quantized activations */
static int tl_linear(int type, const uint8_t *w, int64_t row_bytes, const int8_t *qa, int64_t qs, int64_t lo,
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
    memset(A, 0x80, (size_t)(ntiles * tile_a));   /* tokens past T: q = 0 (their lanes are dropped) */
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
/* what gguf_linear_q8's lane path routes (with rl_linear for small calls and short remainders) */
#define LANE_TILE TL
#define LANE_RL_MAX RL_MAX_TOKENS
#define LANE_SPLIT RL_SPLIT
#define lane_linear tl_linear

#endif

#if defined(GG_AVX2)
/* gguf_linear_q8 on the row-lane kernel (see rl_rows): calls of 1 .. RL_MAX_TOKENS tokens, in passes
 * of up to Q8_TILE tokens over each octet of rows */
static int rl_linear(int type, const uint8_t *w, int64_t row_bytes, const int8_t *qa, int64_t qs, int64_t lo,
                     const float *da, const float *sa, int64_t fs, const float *bias, float *out, int64_t os,
                     int T, int N, int nb, int parts, int num_threads) {
    /* the signed formats' activation sums by token, run, half (ST[2 (t fs + b) + h]) */
    int32_t *ST = NULL;
#if defined(GG_VNNI)   /* (the AVX2 dots keep the weights signed: no offset to take back) */
    if (type == T_Q8_0 || type == T_Q6_K) {
        ST = malloc(sizeof(int32_t) * (size_t)(2 * T * fs));
        if (!ST) return -2;
        for (int t = 0; t < T; t++)
            for (int64_t e = 0; e < 32 * fs; e += 16) {
                const int8_t *q = qa + t * qs + e;
                int32_t s = 0;
                for (int l = 0; l < 16; l++) s += parts == 2 ? 128 * q[l] + q[l + lo] : q[l];
                ST[2 * t * fs + e / 16] = s;
            }
    }
    const int64_t ts = 2 * fs;   /* ST's ints a token */
#else
    /* Q8_0 with two parts: the activations as s16 pairs (128 q + q_lo of elements 2k, 2k + 1 in
     * ST[t * 16 fs + k]) for rl_rows's 16-bit dots */
    const int64_t ts = 16 * fs;
    if (type == T_Q8_0 && parts == 2) {
        ST = malloc(sizeof(int32_t) * (size_t)(ts * T));
        if (!ST) return -2;
        for (int t = 0; t < T; t++)
            for (int64_t e = 0; e < 32 * fs; e += 2) {
                const int8_t *q = qa + t * qs + e;
                const int16_t v[2] = {(int16_t)(128 * q[0] + q[lo]), (int16_t)(128 * q[1] + q[1 + lo])};
                memcpy(ST + t * ts + e / 2, v, 4);
            }
    }
#endif
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int r0, r1;
        thread_rows(N, &r0, &r1);
        float res[Q8_TILE * RL] __attribute__((aligned(32)));
        for (int n = r0; n < r1; n += RL) {
            const int R = r1 - n < RL ? r1 - n : RL;
            const uint8_t *rows[RL];
            for (int r = 0; r < RL; r++) rows[r] = w + (int64_t)(n + (r < R ? r : R - 1)) * row_bytes;
            const int nn = r1 - (n + RL) < RL ? r1 - (n + RL) : RL;   /* the next octet's rows (<= 0: none) */
            for (int t0 = 0; t0 < T; t0 += Q8_TILE) {   /* up to Q8_TILE tokens a pass (the octet cached after the first) */
                const int nt = T - t0 < Q8_TILE ? T - t0 : Q8_TILE;
                rl_rows_any(type, nt, parts, rows, nb, qa + t0 * qs, qs, lo, da + t0 * fs, sa + t0 * fs, fs,
                            ST ? ST + t0 * ts : NULL, w + (int64_t)(n + RL) * row_bytes,
                            nn > 0 && t0 == 0 ? nn * row_bytes : 0, res);
                for (int r = 0; r < R; r++) {
                    const float bb = bias ? bias[n + r] : 0.0f;
                    for (int t = 0; t < nt; t++) out[(int64_t)(t0 + t) * os + n + r] = res[t * RL + r] + bb;
                }
            }
        }
    }
    free(ST);
    return 0;
}
#endif

#if defined(GG_T8)
/* gguf_linear_q8 on the AVX2 token-lane kernel (see t8_row), from the quantized activations */
static int t8_linear(int type, const uint8_t *w, int64_t row_bytes, const int8_t *qa, int64_t qs, int64_t lo,
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
    memset(A, 0, (size_t)(ntiles * tile_a));   /* tokens past T: q = 0 (their lanes are dropped) */
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
        float res[T8] __attribute__((aligned(32)));
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
                    for (int n = n0; n < n1; n++) {
                        t8_row_any(type, parts, wb + (int64_t)(n - n0) * nr * ws, mt + (int64_t)(n - n0) * nr, nr,
                                   A + k * tile_a, dT + (int64_t)k * nr * T8, sT + (int64_t)k * nr * T8, res);
                        const float bb = bias ? bias[n] : 0.0f;
                        for (int t = 0; t < nt; t++) out[(int64_t)(k * T8 + t) * os + n] = res[t] + bb;
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
/* what gguf_linear_q8's lane path routes (with rl_linear for small calls and short remainders) */
#define LANE_TILE T8
#define LANE_RL_MAX T8_RL_MAX
#define LANE_SPLIT T8_SPLIT
#define lane_linear t8_linear
#endif

/* out [T, N] (row stride os) = x W^T (+ bias) on the integer-dot path (see above); parts 1: 8-bit
 * activations (llama.cpp's), 2: 8 + 7 bits (x ~ d (q + q_lo / 128): two integer dots per run).
 * flags: GG_Q8_SCALAR runs the scalar path; GG_Q8_LANES the lane kernels where the build has them
 * (AVX-512 VNNI: rl_rows for 1 .. RL_MAX_TOKENS tokens, tl_rows above; AVX2: rl_rows for 1 .. T8_RL_MAX,
 * t8_row above; one fp32 summation order for all, another than the tile kernels'). Returns 0; -1 for an unsupported type or inconsistent shape; -2 out of
 * memory. */
#define GG_Q8_SCALAR 1
#define GG_Q8_LANES 2
int gguf_linear_q8(int type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t xs,
                   const float *bias, float *out, int64_t os, int T, int N, int K, int num_threads,
                   int parts, int flags) {
    const int force_scalar = flags & GG_Q8_SCALAR;
    if (check(type, row_bytes, N, K) || T < 0 || parts < 1 || parts > 2) return -1;
    if (T == 0 || N == 0) return 0;
    const int nb = K / block_elems(type), nb32 = K / 32;
    const int64_t kp = ((int64_t)K + 63) & ~(int64_t)63, qs = parts * kp, fs = nb32, lo = parts == 2 ? kp : 0;
    int8_t *qa = aligned_alloc(64, (size_t)(qs * T));
    float *da = malloc(sizeof(float) * (size_t)(2 * fs * T));
    if (!qa || !da) { free(qa); free(da); return -2; }
    float *sa = da + fs * T;
    num_threads = threads_for(num_threads, N, K);
    gguf_quantize_act(x, xs, T, K, qa, qs, lo, da, sa, parts, force_scalar);
#if defined(GG_TL) || defined(GG_T8)
    if (!force_scalar && (flags & GG_Q8_LANES)) {   /* the lane kernels: rl_rows, then tl_rows or t8_row */
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
#if defined(GG_AVX2)
    const int simd = !force_scalar;
    /* the 8-token tiles' dots: 8-bit maddubs on the int8 parts (1: parts 1; 2: parts 2 of the
     * unsigned formats, two maddubs and two madd a token and run), or (0) 16-bit madd on act16's
     * values for parts 2 of the signed ones (Q8_0, Q6_K: no sign trick on two parts) */
    const int mode = parts == 1 ? 1 : type == T_Q8_0 || type == T_Q6_K ? 0 : 2;
    /* tiles of more than Q8_SMALL tokens: act16 activations, a tile's runs by block then token
     * (token t0 + t's block b at a16 + (t0 * K + (b * Q8_TILE + t) * 32)), and its da and sa by
     * block then token (0 past T) */
    int16_t *a16 = NULL;
    float *dT = NULL, *sT = NULL;
    if (simd && T > Q8_SMALL) {
        const int ntiles = (T + Q8_TILE - 1) / Q8_TILE;
        a16 = aligned_alloc(64, sizeof(int16_t) * (size_t)K * (size_t)(ntiles * Q8_TILE));
        dT = aligned_alloc(64, sizeof(float) * (size_t)(2 * ntiles * fs * Q8_TILE));
        if (!a16 || !dT) { free(qa); free(da); free(a16); free(dT); return -2; }
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
#endif
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
#if defined(GG_AVX2)
                    if (simd && nt <= Q8_SMALL)
                        q8_small_avx2_any(type, nt, p, nb, qa + t0 * qs, qs, lo, dt, st, fs, res);
                    else if (simd)
                        q8_row_avx2_any(type, nt, mode, p, nb,
                                        parts == 1 ? (const void *)((int8_t *)a16 + (int64_t)t0 * K)
                                                   : (const void *)(a16 + (int64_t)t0 * K),
                                        dT + t0 * fs, sT + t0 * fs, res);
                    else
#endif
                        q8_row_scalar(type, nt, p, nb, qa + t0 * qs, qs, lo, dt, st, fs, res);
                    const float b = bias ? bias[n] : 0.0f;
                    for (int t = 0; t < nt; t++) out[(int64_t)(t0 + t) * os + n] = res[t] + b;
                }
            }
        }
    }
    free(qa);
    free(da);
#if defined(GG_AVX2)
    free(a16);
    free(dT);
#endif
    return 0;
}

/* 1: this build has the lane kernels (GG_Q8_LANES: rl_rows, and tl_rows or t8_row); 0 (the scalar
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
