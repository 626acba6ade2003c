/* Weight-only int8 linear layer on the CPU: out = (x @ (w * scale[:, None]).T) + bias.
 *
 * x: fp32 [T, K] (row stride x_stride, elements); w: int8 [N, K] contiguous, one symmetric scale
 * per output row (scale[n] = max |W[n, :]| / 127, so w = round(W / scale) in [-127, 127]);
 * bias: fp32 [N] or NULL; out: fp32 [T, N] (row stride out_stride). Accumulation is fp32:
 * out[t, n] = scale[n] * sum_k x[t, k] * w[n, k] (+ bias[n]), the same function as F.linear on
 * the dequantized weight up to fp32 summation order.
 *
 * Why: decode steps with few tokens read every weight once and do ~T FLOPs per weight, so they
 * run at memory bandwidth; int8 weights are a quarter of the fp32 bytes. The widening (int8 ->
 * int32 -> fp32: 2 instructions per 8 weights on AVX2) is paid once per weight and shared by the
 * tile's tokens, so above a few tens of tokens the float GEMM (compute-bound, better blocked)
 * wins again; the caller switches on T (quant.py, beside csrc/).
 *
 * Parallel over tiles of 4 output rows (OpenMP, static split: every tile costs the same). Tiles
 * run 4 rows x 2 tokens = 8 independent FMA chains (enough to hide the FMA latency), or for a
 * lone token 4 rows x 2 k-halves. AVX2+FMA path when built with it (-march=native on any AVX2
 * CPU, AVX-512 ones included); a scalar path otherwise (correct, slow: the caller should not
 * pick int8 there).
 */
#include <stdint.h>
#include <string.h>

#include "common.h"
#if defined(__AVX2__) && defined(__FMA__)
#define I8_AVX2 1
#endif

/* Software prefetch of the tile PREFETCH_TILES (tiles of 4 rows) ahead into L2 (T1), not L1:
 * an L1 prefetch burst competes with the FMAs' own loads for the L1 fill buffers
 * (bench/int8_prefetch.py measures the distance and the hint). */
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 8
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T1
#endif
/* token count from which tiles widen each weight once into an L1 buffer (tile4_buffered) */
#ifndef BUFFERED_MIN_T
#if defined(I8_AVX2)
#define BUFFERED_MIN_T 3
#else
#define BUFFERED_MIN_T (1 << 30)   /* never: the scalar path has no buffered tile */
#endif
#endif

#if defined(I8_AVX2)
static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* the 4 horizontal sums of a0..a3, in lanes 0..3 */
static inline __m128 hsum4x(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}
#endif

/* rows [n0, n0 + 4) x tokens [t0, t0 + tn), tn in {1, 2}; K8 = K rounded down to 8 */
static inline void tile4(const float *x, int64_t xs, const int8_t *w, int K, int n0, int t0, int tn,
                         float sums[4][2]) {
    int k = 0;
#if defined(I8_AVX2)
    const int8_t *w0 = w + (int64_t)n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const float *x0 = x + (int64_t)t0 * xs;
    if (tn == 2) {
        const float *x1 = x0 + xs;
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
               a30 = a00, a31 = a00;
        for (; k + 8 <= K; k += 8) {
            const __m256 xa = _mm256_loadu_ps(x0 + k), xb = _mm256_loadu_ps(x1 + k);
            __m256 wv = widen8(w0 + k);
            a00 = _mm256_fmadd_ps(wv, xa, a00); a01 = _mm256_fmadd_ps(wv, xb, a01);
            wv = widen8(w1 + k);
            a10 = _mm256_fmadd_ps(wv, xa, a10); a11 = _mm256_fmadd_ps(wv, xb, a11);
            wv = widen8(w2 + k);
            a20 = _mm256_fmadd_ps(wv, xa, a20); a21 = _mm256_fmadd_ps(wv, xb, a21);
            wv = widen8(w3 + k);
            a30 = _mm256_fmadd_ps(wv, xa, a30); a31 = _mm256_fmadd_ps(wv, xb, a31);
        }
        float h0[4], h1[4];
        _mm_storeu_ps(h0, hsum4x(a00, a10, a20, a30));
        _mm_storeu_ps(h1, hsum4x(a01, a11, a21, a31));
        for (int r = 0; r < 4; r++) { sums[r][0] = h0[r]; sums[r][1] = h1[r]; }
    } else {
        /* one token: two accumulators per row over alternating 8-wide k chunks */
        __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
        for (; k + 16 <= K; k += 16) {
            const __m256 xa = _mm256_loadu_ps(x0 + k), xb = _mm256_loadu_ps(x0 + k + 8);
            a0 = _mm256_fmadd_ps(widen8(w0 + k), xa, a0); b0 = _mm256_fmadd_ps(widen8(w0 + k + 8), xb, b0);
            a1 = _mm256_fmadd_ps(widen8(w1 + k), xa, a1); b1 = _mm256_fmadd_ps(widen8(w1 + k + 8), xb, b1);
            a2 = _mm256_fmadd_ps(widen8(w2 + k), xa, a2); b2 = _mm256_fmadd_ps(widen8(w2 + k + 8), xb, b2);
            a3 = _mm256_fmadd_ps(widen8(w3 + k), xa, a3); b3 = _mm256_fmadd_ps(widen8(w3 + k + 8), xb, b3);
        }
        for (; k + 8 <= K; k += 8) {
            const __m256 xa = _mm256_loadu_ps(x0 + k);
            a0 = _mm256_fmadd_ps(widen8(w0 + k), xa, a0);
            a1 = _mm256_fmadd_ps(widen8(w1 + k), xa, a1);
            a2 = _mm256_fmadd_ps(widen8(w2 + k), xa, a2);
            a3 = _mm256_fmadd_ps(widen8(w3 + k), xa, a3);
        }
        float h[4];
        _mm_storeu_ps(h, hsum4x(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1),
                                _mm256_add_ps(a2, b2), _mm256_add_ps(a3, b3)));
        for (int r = 0; r < 4; r++) sums[r][0] = h[r];
    }
#else
    for (int r = 0; r < 4; r++) for (int t = 0; t < tn; t++) sums[r][t] = 0.0f;
#endif
    for (; k < K; k++)    /* the tail (K % 8) or the whole row on the scalar path */
        for (int r = 0; r < 4; r++)
            for (int t = 0; t < tn; t++)
                sums[r][t] += x[(int64_t)(t0 + t) * xs + k] * (float)w[(int64_t)(n0 + r) * K + k];
}

#if defined(I8_AVX2)
#define KC 1024          /* k columns widened per chunk: 4 rows x 1024 fp32 = 16 KB, half of L1d */
#define TB 64            /* tokens per pass over a widened chunk (the partial sums live on the stack) */

/* acc[t][r] += sum_{k < kc} x[t, k] * wf[r][k] for tn in {1, 2, 3} tokens starting at x0;
 * kc % 8 == 0. 4 rows x 3 tokens = 12 independent FMA chains; weights come from the widened
 * L1-resident buffer, so each FMA costs one load shared by tn tokens. */
static inline __attribute__((always_inline)) void
micro4(const float *x0, int64_t xs, const float *wf, int kc, int tn, float acc[][4]) {
    __m256 a[3][4];
    for (int t = 0; t < 3; t++) for (int r = 0; r < 4; r++) a[t][r] = _mm256_setzero_ps();
    for (int k = 0; k < kc; k += 8) {
        const __m256 w0 = _mm256_load_ps(wf + k), w1 = _mm256_load_ps(wf + KC + k),
                     w2 = _mm256_load_ps(wf + 2 * KC + k), w3 = _mm256_load_ps(wf + 3 * KC + k);
        for (int t = 0; t < tn; t++) {      /* tn is a constant at each call site: unrolled */
            const __m256 xv = _mm256_loadu_ps(x0 + t * xs + k);
            a[t][0] = _mm256_fmadd_ps(w0, xv, a[t][0]); a[t][1] = _mm256_fmadd_ps(w1, xv, a[t][1]);
            a[t][2] = _mm256_fmadd_ps(w2, xv, a[t][2]); a[t][3] = _mm256_fmadd_ps(w3, xv, a[t][3]);
        }
    }
    for (int t = 0; t < tn; t++) {
        float h[4];
        _mm_storeu_ps(h, hsum4x(a[t][0], a[t][1], a[t][2], a[t][3]));
        for (int r = 0; r < 4; r++) acc[t][r] += h[r];
    }
}

/* Rows [n0, n0 + 4) x every token: for T >= 3 tokens the widening (int8 -> fp32) is done once
 * per weight into wf and shared by all tokens, so the tile runs at the FMA rate instead of the
 * widening rate (2 extra instructions per 8 weights per token pair on the direct path). */
static void tile4_buffered(const float *x, int64_t xs, const int8_t *w, int K, int n0, int T,
                           const float *scale, const float *bias, float *out, int64_t os) {
    float wf[4 * KC] __attribute__((aligned(32)));
    float acc[TB][4];
    const int K8 = K & ~7;
    for (int tb = 0; tb < T; tb += TB) {
        const int tbn = T - tb < TB ? T - tb : TB;
        memset(acc, 0, sizeof(float) * 4 * tbn);
        for (int k0 = 0; k0 < K8; k0 += KC) {
            const int kc = K8 - k0 < KC ? K8 - k0 : KC;
            for (int r = 0; r < 4; r++)
                for (int k = 0; k < kc; k += 8)
                    _mm256_store_ps(wf + r * KC + k, widen8(w + (int64_t)(n0 + r) * K + k0 + k));
            int t = 0;
            for (; t + 3 <= tbn; t += 3) micro4(x + (int64_t)(tb + t) * xs + k0, xs, wf, kc, 3, acc + t);
            if (tbn - t == 2) micro4(x + (int64_t)(tb + t) * xs + k0, xs, wf, kc, 2, acc + t);
            else if (tbn - t == 1) micro4(x + (int64_t)(tb + t) * xs + k0, xs, wf, kc, 1, acc + t);
        }
        for (int t = 0; t < tbn; t++)
            for (int r = 0; r < 4; r++) {
                float a = acc[t][r];
                for (int k = K8; k < K; k++)   /* the K % 8 tail */
                    a += x[(int64_t)(tb + t) * xs + k] * (float)w[(int64_t)(n0 + r) * K + k];
                out[(int64_t)(tb + t) * os + n0 + r] = a * scale[n0 + r] + (bias ? bias[n0 + r] : 0.0f);
            }
    }
}
#endif

/* Returns 0, or -1 for a shape it does not take (nothing written). */
int int8_linear(const float *x, int64_t x_stride, const int8_t *w, const float *scale,
                const float *bias, float *out, int64_t out_stride, int T, int N, int K,
                int num_threads) {
    if (T < 0 || N < 0 || K < 1) return -1;
    if (T == 0 || N == 0) return 0;
    const int tiles = (N + 3) / 4;
    num_threads = threads_for_weights(num_threads, (int64_t)N * K);

#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tiles > 1)
    for (int i = 0; i < tiles; i++) {
        const int n0 = i * 4;
#if defined(I8_AVX2) && PREFETCH_TILES > 0
        /* the tile PREFETCH_TILES ahead: each tile is a short run of 4 * K bytes, too short for
         * the hardware prefetchers to ramp up on while the FMAs keep the core busy */
        if (n0 + 4 * (PREFETCH_TILES + 1) <= N) {
            const char *p = (const char *)(w + (int64_t)(n0 + 4 * PREFETCH_TILES) * K);
            for (int64_t b = 0; b < 4 * (int64_t)K; b += 64) _mm_prefetch(p + b, PREFETCH_HINT);
        }
#endif
        if (n0 + 4 <= N && T >= BUFFERED_MIN_T) {
#if defined(I8_AVX2)
            tile4_buffered(x, x_stride, w, K, n0, T, scale, bias, out, out_stride);
#endif
        } else if (n0 + 4 <= N) {
            for (int t0 = 0; t0 < T; t0 += 2) {
                const int tn = T - t0 < 2 ? T - t0 : 2;
                float sums[4][2];
                tile4(x, x_stride, w, K, n0, t0, tn, sums);
                for (int r = 0; r < 4; r++)
                    for (int t = 0; t < tn; t++)
                        out[(int64_t)(t0 + t) * out_stride + n0 + r] =
                            sums[r][t] * scale[n0 + r] + (bias ? bias[n0 + r] : 0.0f);
            }
        } else {   /* the last N % 4 rows: plain dot products */
            for (int n = n0; n < N; n++)
                for (int t = 0; t < T; t++) {
                    float a = 0.0f;
                    for (int k = 0; k < K; k++) a += x[(int64_t)t * x_stride + k] * (float)w[(int64_t)n * K + k];
                    out[(int64_t)t * out_stride + n] = a * scale[n] + (bias ? bias[n] : 0.0f);
                }
        }
    }
    return 0;
}

/* "avx2" or "scalar": the path this build runs. */
const char *int8_linear_isa(void) {
#if defined(I8_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}
