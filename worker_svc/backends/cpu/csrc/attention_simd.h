/* What the two attention kernels share (internal header): paged_decode.c (decodes) and
 * chunk_attention.c (prefill chunks) include it after common.h.
 *
 * The KV storage dtypes (DT_*: the numbers native.py passes), element loads that widen fp16 /
 * bf16 to fp32, exp for x <= 0, horizontal sums, and one vector abstraction over the two SIMD
 * paths (vf = SIMD_W floats: 16 with AVX-512, 8 with AVX2 + FMA; SIMD_W undefined on the portable
 * build), so that each kernel body is written once. Everything is static inline.
 */
#ifndef SARATHI_ATTENTION_SIMD_H
#define SARATHI_ATTENTION_SIMD_H

#include <stdint.h>
#include <string.h>

#include "common.h"

#if defined(__AVX512F__)
#define SIMD_W 16
#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD_W 8
#endif

/* Storage dtypes (the numbers native.py passes). */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);   /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* IEEE half -> float, exact for every input (normals, subnormals, inf, NaN). */
static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return f16_to_f32_soft(h);
#endif
}

static inline float load_elem(const void *p, int dt, int64_t i) {
    if (dt == DT_F32) return ((const float *)p)[i];
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return f16_to_f32(((const uint16_t *)p)[i]);
}

#if defined(__AVX512F__)
/* 16 consecutive elements as fp32 (bf16 widened by a 16-bit shift). */
static inline __m512 load16(const void *p, int dt, int64_t i) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (dt == DT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* exp(x) for x <= 0 (scores minus their running max): 2^n * poly(r), |rel err| < 2e-7.
 * Inputs below -87 give ~0 (they are clamped, never inf/NaN). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(exp_poly_f32x16(x, n), n);
}

/* Lane j of the result = sum of the 16 lanes of v[j]: a transpose-and-add tree, ~3 ops per input
 * vector instead of ~8 for a horizontal sum each. */
static inline __m512 hsum16(const __m512 v[16]) {
    __m512 w[8], u[4], z[2];
    for (int i = 0; i < 8; i++)    /* quarters 0,1 sum to v[2i], quarters 2,3 to v[2i+1] */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)    /* quarter k sums to v[4i+k] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)    /* in quarter k: lanes 0,1 sum to v[8i+k], lanes 2,3 to v[8i+4+k] */
        z[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    /* quarter k, lane p = sum of v[4p+k]; permute so lane j holds v[j]'s sum */
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),
                                   _mm512_shuffle_ps(z[0], z[1], 0xDD));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, f);
}
#elif SIMD_W == 8
/* 8 consecutive elements as fp32: bf16 widened by a shift, fp16 by F16C's vcvtph2ps. */
static inline __m256 load8(const void *p, int dt, int64_t i) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
#if defined(__F16C__)
    if (dt == DT_F16) return _mm256_cvtph_ps(h);
#else
    if (dt == DT_F16) {
        float f[8];
        for (int j = 0; j < 8; j++) f[j] = f16_to_f32(((const uint16_t *)p)[i + j]);
        return _mm256_loadu_ps(f);
    }
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* exp(x) for x <= 0, as exp512 (same polynomial); 2^n is built in the exponent bits (AVX2 has
 * no scalef). x >= -87 after the clamp, so n >= -126 and 2^n stays a normal float. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_mul_ps(exp_poly_f32x8(x, n), pow2_f32x8(_mm256_cvtps_epi32(n)));
}

/* Lane j of the result = sum of the 8 lanes of v[j] (hadd tree: 9 ops for 8 vectors). */
static inline __m256 hsum8(const __m256 v[8]) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0: low half = v0..v3 low-half sums, high half = their high-half sums; u1 likewise */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif


/* One vector abstraction over both SIMD paths, so the kernel below is written once: vf is W
 * floats, vmask selects lanes. */
#if defined(__AVX512F__)
typedef __m512 vf;
typedef __mmask16 vmask;
#define vzero() _mm512_setzero_ps()
#define vset1(x) _mm512_set1_ps(x)
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, x) _mm512_storeu_ps(p, x)
#define vfmadd(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vmax(a, b) _mm512_max_ps(a, b)
#define vexp(x) exp512(x)
#define vhsum(v) hsum16(v)
#define vload1(p, dt, i) load16(p, dt, i)
static inline vmask vlanes_lt(int n) {   /* lanes 0 .. n-1 */
    return n >= 16 ? (vmask)0xffff : n <= 0 ? (vmask)0 : (vmask)((1u << n) - 1u);
}
static inline vf vsel(vmask m, vf a, vf b) { return _mm512_mask_blend_ps(m, b, a); }   /* m ? a : b */
static inline float vreduce_max(vf x) { return _mm512_reduce_max_ps(x); }
static inline float vreduce_add(vf x) { return _mm512_reduce_add_ps(x); }
/* 2W = 32 consecutive elements as two vectors, see vload2 below */
static inline void vload2(const void *p, int dt, int64_t i, vf *lo, vf *hi) {
    if (dt == DT_BF16) {
        const __m512i x = _mm512_loadu_si512((const void *)((const uint16_t *)p + i));
        *lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        *hi = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
    } else {
        *lo = load16(p, dt, i);
        *hi = load16(p, dt, i + 16);
    }
}
#elif SIMD_W == 8
typedef __m256 vf;
typedef __m256 vmask;
#define vzero() _mm256_setzero_ps()
#define vset1(x) _mm256_set1_ps(x)
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, x) _mm256_storeu_ps(p, x)
#define vfmadd(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vmax(a, b) _mm256_max_ps(a, b)
#define vexp(x) exp256(x)
#define vhsum(v) hsum8(v)
#define vload1(p, dt, i) load8(p, dt, i)
static inline vmask vlanes_lt(int n) {
    return _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)n), _CMP_LT_OQ);
}
static inline vf vsel(vmask m, vf a, vf b) { return _mm256_blendv_ps(b, a, m); }
static inline float vreduce_max(vf x) { return hmax_f32x8(x); }
static inline float vreduce_add(vf x) { return hsum_f32x8(x); }
static inline void vload2(const void *p, int dt, int64_t i, vf *lo, vf *hi) {
    if (dt == DT_BF16) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        *hi = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        *lo = load8(p, dt, i);
        *hi = load8(p, dt, i + 8);
    }
}
#endif

#endif
