/* Fused elementwise ops of a decoder layer on the CPU (the glue between the linear layers and
 * attention): RMSNorm (optionally fused with the residual add), rotary embedding in place on q
 * and k, silu(gate) * up, and the paged KV cache write.
 *
 * Why: at decode sizes a layer's glue is many tiny torch ops, each costing more in dispatch
 * than in arithmetic; each op below replaces several of them with one call.
 *
 * Numerics: every op follows the torch expression it replaces (worker_svc/backends/base.py,
 * Ops) operation by operation, with the same roundings:
 * - fp32: the same sequence of IEEE operations, no FMA contraction (pragma below), so rotary,
 *   the residual add, the KV cast and the elementwise parts of RMSNorm are bit-equal to torch;
 *   the sum of squares of RMSNorm is summed in another order (a few ulp of the row's rms), and
 *   silu's exp is a Cephes polynomial (~1 ulp) instead of torch's Sleef exp.
 * - bf16: values are widened to fp32, each torch op's result is rounded to bf16
 *   (round-to-nearest-even, like c10::BFloat16) where torch rounds it, so bf16 differs from
 *   torch only where fp32 does.
 * dtype codes: 0 fp32, 1 bf16, 2 fp16 (the KV cache only). Strides are in elements.
 *
 * Threads: the ops are memory-light and tiny at decode sizes, where an OpenMP fork/join costs
 * more than the op; rows are split across threads only when a call touches at least
 * PAR_MIN_ELEMS elements (prefill chunks).
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#if defined(__AVX2__) && defined(__FMA__)
#define OPS_AVX2 1
#endif

#define PAR_MIN_ELEMS (1 << 16)

const char *cpu_ops_isa(void) {
#ifdef OPS_AVX2
    return "avx2";
#else
    return "scalar";
#endif
}

static inline uint16_t f32_to_bf16(float f) {   /* c10::BFloat16: RNE, NaN -> 0x7fc0 */
    union { float f; uint32_t u; } v = { f };
    if (f != f)
        return 0x7fc0;
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float rbf(float f) { return bf16_to_f32(f32_to_bf16(f)); }   /* round to bf16 */

#ifdef OPS_AVX2
/* exp(x), Cephes expf (as in avx_mathfun): ~1 ulp over [-88.38, 88.38], inputs clamped there
 * (exp(-100) gives 6e-39 instead of 0: only silu's far tail sees it); n = floor(x / ln2 + 1/2) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    return _mm256_mul_ps(exp_poly_f32x8(x, fx), pow2_f32x8(_mm256_cvttps_epi32(fx)));
}

/* 8 fp32 -> 8 bf16 (RNE, NaN -> 0x7fc0), like f32_to_bf16 */
static inline __m128i cvt8_bf16(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    __m256i p = _mm256_packus_epi32(r, r);                      /* lanes: r0..3 r0..3 | r4..7 r4..7 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
}
#endif

static float silu_scalar(float g) { return g / (1.0f + expf(-g)); }

/* ---------------------------------------------------------------- RMSNorm (+ residual add) */

/* one row, fp32: r = x (+ res, stored to res_out); out = w * (r * (1 / sqrt(mean(r^2) + eps))) */
static void rms_row_f32(const float *x, const float *res, float *res_out, float *out, const float *w,
                        int H, float eps) {
    const float *r = x;
    int i = 0;
    float ss = 0.0f;
    if (res) {
        for (i = 0; i < H; i++)
            res_out[i] = x[i] + res[i];
        r = res_out;
    }
    i = 0;
#ifdef OPS_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 32 <= H; i += 32) {
        __m256 v0 = _mm256_loadu_ps(r + i), v1 = _mm256_loadu_ps(r + i + 8);
        __m256 v2 = _mm256_loadu_ps(r + i + 16), v3 = _mm256_loadu_ps(r + i + 24);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
        a2 = _mm256_fmadd_ps(v2, v2, a2);
        a3 = _mm256_fmadd_ps(v3, v3, a3);
    }
    for (; i + 8 <= H; i += 8) {
        __m256 v = _mm256_loadu_ps(r + i);
        a0 = _mm256_fmadd_ps(v, v, a0);
    }
    ss = hsum_f32x8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; i < H; i++)
        ss += r[i] * r[i];
    const float inv = 1.0f / sqrtf(ss / (float)H + eps);
    i = 0;
#ifdef OPS_AVX2
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; i + 8 <= H; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(r + i), vinv)));
#endif
    for (; i < H; i++)
        out[i] = w[i] * (r[i] * inv);
}

/* one row, bf16: like torch on bf16 tensors: r = bf16(x + res); h = r as fp32 normalised in
 * fp32, rounded to bf16; out = bf16(w * h) */
static void rms_row_bf16(const uint16_t *x, const uint16_t *res, uint16_t *res_out, uint16_t *out,
                         const uint16_t *w, int H, float eps) {
    const uint16_t *r = x;
    if (res) {
        for (int i = 0; i < H; i++)
            res_out[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(res[i]));
        r = res_out;
    }
    float ss = 0.0f;
    for (int i = 0; i < H; i++) {
        float f = bf16_to_f32(r[i]);
        ss += f * f;
    }
    const float inv = 1.0f / sqrtf(ss / (float)H + eps);
    for (int i = 0; i < H; i++)
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * rbf(bf16_to_f32(r[i]) * inv));
}

/* out[t] = rmsnorm(x[t] (+ res[t])) * w for t < T, rows of H. res == NULL: no residual;
 * else res_out[t] = x[t] + res[t] (res_out may be res or x itself: each element is read before
 * it is written). out must not overlap the inputs. Returns 0, or -1 for an unknown dtype. */
int cpu_rms_norm(const void *x, int64_t xs, const void *res, int64_t rs, void *res_out, int64_t ros,
                 void *out, int64_t os, const void *w, int T, int H, float eps, int dtype, int nthreads) {
    if (dtype != 0 && dtype != 1)
        return -1;
    const int par = (int64_t)T * H >= PAR_MIN_ELEMS && nthreads > 1 && T > 1;
    (void)par;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int t = 0; t < T; t++) {
        if (dtype == 0)
            rms_row_f32((const float *)x + t * xs, res ? (const float *)res + t * rs : NULL,
                        res ? (float *)res_out + t * ros : NULL, (float *)out + t * os, (const float *)w, H, eps);
        else
            rms_row_bf16((const uint16_t *)x + t * xs, res ? (const uint16_t *)res + t * rs : NULL,
                         res ? (uint16_t *)res_out + t * ros : NULL, (uint16_t *)out + t * os,
                         (const uint16_t *)w, H, eps);
    }
    return 0;
}

/* ---------------------------------------------------------------- rotary embedding */

/* one head of D, in place: HF rotate_half, x * cos + cat(-x2, x1) * sin, products rounded
 * before the sum (no FMA) like torch's three ops */
static inline void rope_head_f32(float *x, const float *c, const float *s, int D) {
    const int h = D / 2;
    int i = 0;
#ifdef OPS_AVX2
    for (; i + 8 <= h; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + h + i);
        __m256 lo = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)), _mm256_mul_ps(b, _mm256_loadu_ps(s + i)));
        __m256 hi = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + h + i)), _mm256_mul_ps(a, _mm256_loadu_ps(s + h + i)));
        _mm256_storeu_ps(x + i, lo);
        _mm256_storeu_ps(x + h + i, hi);
    }
#endif
    for (; i < h; i++) {
        const float a = x[i], b = x[h + i];
        x[i] = a * c[i] - b * s[i];            /* a*c + (-b)*s: the same rounding */
        x[h + i] = b * c[h + i] + a * s[h + i];
    }
}

static inline void rope_head_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int D) {
    const int h = D / 2;
    for (int i = 0; i < h; i++) {
        const float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[h + i]);
        x[i] = f32_to_bf16(rbf(a * bf16_to_f32(c[i])) - rbf(b * bf16_to_f32(s[i])));
        x[h + i] = f32_to_bf16(rbf(b * bf16_to_f32(c[h + i])) + rbf(a * bf16_to_f32(s[h + i])));
    }
}

/* q [T, hq, D] (row stride qs, heads contiguous) and k [T, hkv, D] (row stride ks) rotated in
 * place by cos, sin [T, D] contiguous (token t's position's table rows), all of one dtype.
 * D must be even. Returns 0, -1 for an unknown dtype or odd D. */
int cpu_rotary(void *q, int64_t qs, void *k, int64_t ks, const void *cos, const void *sin,
               int T, int hq, int hkv, int D, int dtype, int nthreads) {
    if ((dtype != 0 && dtype != 1) || D % 2)
        return -1;
    const int par = (int64_t)T * (hq + hkv) * D >= PAR_MIN_ELEMS && nthreads > 1 && T > 1;
    (void)par;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int t = 0; t < T; t++) {
        for (int j = 0; j < hq + hkv; j++) {
            if (dtype == 0) {
                float *x = j < hq ? (float *)q + t * qs + (int64_t)j * D : (float *)k + t * ks + (int64_t)(j - hq) * D;
                rope_head_f32(x, (const float *)cos + (int64_t)t * D, (const float *)sin + (int64_t)t * D, D);
            } else {
                uint16_t *x = j < hq ? (uint16_t *)q + t * qs + (int64_t)j * D
                                     : (uint16_t *)k + t * ks + (int64_t)(j - hq) * D;
                rope_head_bf16(x, (const uint16_t *)cos + (int64_t)t * D, (const uint16_t *)sin + (int64_t)t * D, D);
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- silu(gate) * up */

/* x [T, 2 * I] (row stride xs): gate = x[:, :I], up = x[:, I:]; out [T, I] (row stride os)
 * = silu(gate) * up, silu(g) = g / (1 + exp(-g)) like torch. Returns 0, -1 for an unknown dtype. */
int cpu_silu_mul(const void *x, int64_t xs, void *out, int64_t os, int T, int I, int dtype, int nthreads) {
    if (dtype != 0 && dtype != 1)
        return -1;
    const int par = (int64_t)T * I >= PAR_MIN_ELEMS && nthreads > 1 && T > 1;
    (void)par;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int t = 0; t < T; t++) {
        int i = 0;
        if (dtype == 0) {
            const float *g = (const float *)x + t * xs, *u = g + I;
            float *o = (float *)out + t * os;
#ifdef OPS_AVX2
            const __m256 one = _mm256_set1_ps(1.0f);
            for (; i + 8 <= I; i += 8) {
                __m256 gv = _mm256_loadu_ps(g + i);
                __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
            }
#endif
            for (; i < I; i++)
                o[i] = silu_scalar(g[i]) * u[i];
        } else {
            const uint16_t *g = (const uint16_t *)x + t * xs, *u = g + I;
            uint16_t *o = (uint16_t *)out + t * os;
            for (; i < I; i++)
                o[i] = f32_to_bf16(rbf(silu_scalar(bf16_to_f32(g[i]))) * bf16_to_f32(u[i]));
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- paged KV cache write */

static void put_row(const void *src, int sdt, void *dst, int ddt, int n) {
    int i = 0;
    if (sdt == ddt) {
        memcpy(dst, src, (size_t)n * (sdt == 0 ? 4 : 2));
        return;
    }
    if (sdt == 0 && ddt == 1) {
        const float *s = (const float *)src;
        uint16_t *d = (uint16_t *)dst;
#ifdef OPS_AVX2
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i), cvt8_bf16(_mm256_loadu_ps(s + i)));
#endif
        for (; i < n; i++)
            d[i] = f32_to_bf16(s[i]);
    } else if (sdt == 1 && ddt == 0) {
        for (; i < n; i++)
            ((float *)dst)[i] = bf16_to_f32(((const uint16_t *)src)[i]);
    }
#ifdef __F16C__
    else if (ddt == 2) {      /* fp32 or bf16 -> fp16, RNE like c10::Half */
        uint16_t *d = (uint16_t *)dst;
        for (; i + 8 <= n; i += 8) {
            __m256 v;
            if (sdt == 0)
                v = _mm256_loadu_ps((const float *)src + i);
            else
                v = _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))), 16));
            _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        }
        for (; i < n; i++) {
            float f = sdt == 0 ? ((const float *)src)[i] : bf16_to_f32(((const uint16_t *)src)[i]);
            d[i] = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
        }
    }
#endif
}

/* Whether cpu_write_kv converts src dtype sdt to cache dtype cdt on this build (1/0). */
int cpu_write_kv_supports(int sdt, int cdt) {
    if ((sdt != 0 && sdt != 1) || cdt < 0 || cdt > 2)
        return 0;
#ifndef __F16C__
    if (cdt == 2)
        return 0;
#endif
    return 1;
}

/* k, v [T, hkv, D] (row strides ks, vs; heads contiguous) of dtype sdt -> the caches kc, vc
 * [num_slots, hkv, D] contiguous of dtype cdt, row t at slot slots[t] (int64), cast with RNE
 * (torch's .to()). Every slot is checked before anything is written: returns -2 for a slot
 * outside [0, num_slots), -1 for an unsupported dtype pair, 0 on success. */
int cpu_write_kv(const void *k, int64_t ks, const void *v, int64_t vs, int sdt, void *kc, void *vc,
                 int cdt, const int64_t *slots, int64_t num_slots, int T, int hkv, int D) {
    if (!cpu_write_kv_supports(sdt, cdt))
        return -1;
    for (int t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots)
            return -2;
    const int n = hkv * D;
    const int se = sdt == 0 ? 4 : 2, ce = cdt == 0 ? 4 : 2;
    for (int t = 0; t < T; t++) {
        put_row((const char *)k + t * ks * se, sdt, (char *)kc + slots[t] * n * ce, cdt, n);
        put_row((const char *)v + t * vs * se, sdt, (char *)vc + slots[t] * n * ce, cdt, n);
    }
    return 0;
}
