/* What the CPU kernel sources share: an internal header, not part of the library's API.
 *
 * The C sources beside this header are compiled into one shared library with -march=native
 * (native.py); each includes this header and uses what it needs. Contents: the threads' split of
 * a call, the 16-bit float conversions, horizontal reductions of a vector, and exp's polynomial.
 *
 * Rules for what lives here:
 * - every helper is `static inline` (no code where unused) and guarded by the CPU features it
 *   needs, with the same macros the sources test (__AVX2__ + __FMA__, __F16C__, __AVX512F__);
 * - a helper does exactly the IEEE operations, in the same order, of the code it replaced in
 *   each source, so a kernel's results do not depend on whether it calls the helper;
 * - a source that must not contract a * b + c into an FMA (cpu_ops.c, gguf_*.c) states
 *   #pragma GCC optimize("fp-contract=off") before including this header, so that the helpers
 *   are compiled under the source's rule.
 * Functions one source defines for another (never exported from the library) are declared
 * KERNEL_INTERNAL.
 */
#ifndef SARATHI_CPU_COMMON_H
#define SARATHI_CPU_COMMON_H

#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define KERNEL_INTERNAL __attribute__((visibility("hidden")))

/* ------------------------------------------------------------------------------------------ */
/* threads                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* A weight-streaming kernel (the int8 and GGUF linear layers) uses one more thread per this
 * many weights: below it, an OpenMP fork/join costs more than the thread saves. */
#define MIN_WEIGHTS_PER_THREAD (1 << 16)

/* num_threads (at least 1) capped at 1 + weights / MIN_WEIGHTS_PER_THREAD */
static inline int threads_for_weights(int num_threads, int64_t weights) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > 1 + weights / MIN_WEIGHTS_PER_THREAD) num_threads = (int)(1 + weights / MIN_WEIGHTS_PER_THREAD);
    return num_threads;
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

/* ------------------------------------------------------------------------------------------ */
/* 16-bit floats                                                                              */
/* ------------------------------------------------------------------------------------------ */

/* bf16 -> fp32: bf16 is the top half of an fp32 (exact) */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* IEEE half -> float in integer operations, exact for every input (normals, subnormals, inf,
 * NaN), as numpy's astype(float32) and F16C's vcvtph2ps */
static inline float f16_to_f32_soft(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0x1f) u = sign | 0x7f800000u | (m << 13);                  /* inf / NaN */
    else if (e != 0) u = sign | ((e + 112u) << 23) | (m << 13);          /* normal */
    else if (m == 0) u = sign;                                           /* +-0 */
    else {                                                               /* subnormal: m * 2^-24 */
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__AVX2__) && defined(__FMA__)
/* ------------------------------------------------------------------------------------------ */
/* horizontal reductions of 8 floats / ints (lane order: (0+4 + 2+6) + (1+5 + 3+7))          */
/* ------------------------------------------------------------------------------------------ */

static inline float hsum_f32x8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static inline float hmax_f32x8(__m256 v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static inline int hsum_i32x8(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
}

/* ------------------------------------------------------------------------------------------ */
/* exp: Cephes expf's polynomial (as avx_mathfun's exp256_ps)                                 */
/* ------------------------------------------------------------------------------------------ */
/* exp(x) = 2^n e^r with n an integer near x / ln2 (rounded as each caller chooses) and
 * r = x - n ln2, taken in two steps (Cody-Waite: ln2 = 0.693359375 - 2.12194440e-4, the first
 * exact in few bits) so that r stays accurate; e^r by a degree-7 polynomial, ~1 ulp for
 * |r| <= ln2 / 2. The callers clamp x and scale by 2^n. */
static inline __m256 exp_poly_f32x8(__m256 x, __m256 n) {
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    return _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
}

/* 2^n as floats, n integers in [-126, 127] (built in the exponent bits) */
static inline __m256 pow2_f32x8(__m256i n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
#endif

#if defined(__AVX512F__)
/* exp_poly_f32x8 in 16 lanes */
static inline __m512 exp_poly_f32x16(__m512 x, __m512 n) {
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    return _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
}
#endif

#endif
