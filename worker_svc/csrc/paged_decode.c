/* Paged decode attention on the CPU: one query token per sequence, K/V read in place.
 *
 * Layout (see worker_svc/kv_cache.py): k_cache, v_cache are [num_blocks, block_size, Hkv, D],
 * contiguous; token p of sequence b lives at block block_tables[b][p / block_size], row
 * p % block_size. q and out are rows of [*, Hq, D] (heads and dims contiguous, row stride
 * given); sequence b reads/writes row rows[b] (or b when rows is NULL). Query head h uses kv
 * head h / G with G = Hq / Hkv (GQA).
 *
 * Each (sequence, kv head) is one work unit: its G query heads stream over the context once,
 * in tiles of at most 16 tokens inside one block, with an online softmax (running max m,
 * running sum l, accumulator acc rescaled when m grows). So every K/V byte is read exactly
 * once, and all arithmetic is fp32 whatever the storage dtype.
 *
 * Three code paths, chosen at compile time by the -march=native macros (paged_decode_isa()
 * names the one built): AVX-512 (16 floats per vector), AVX2+FMA (8 per vector; Zen 2/3,
 * Haswell..Alder Lake) and a portable scalar path (correct, ~10x slower). Both SIMD paths: the
 * next tile's K/V rows are prefetched by hand because block tables jump around memory; q.k
 * partial sums of a tile's tokens are reduced together (hsum16 / hsum8 transpose-add trees); the
 * V accumulators of up to 4 query rows stay in registers across a tile. On a shared 2-core
 * Sapphire Rapids the AVX-512 path reads fp32 K/V at ~9-10 GB/s per core, near a plain
 * streaming sum's 11-13 GB/s. The AVX-512 path cannot run on the AVX2 machines it was last
 * edited on: tests compile it (-march=skylake-avx512) but only the AVX2 and scalar paths ran.
 *
 * KV storage dtypes: fp32, bf16 (widened by a 16-bit shift) and fp16 (F16C vcvtph2ps / AVX-512
 * vcvtph2ps; a bit-exact scalar conversion otherwise). q and out: fp32 or bf16.
 *
 * Invariants: the kernel checks 1 <= D <= MAX_D, 1 <= G <= MAX_ROWS, Hq % Hkv == 0 (else it
 * returns -1); the caller guarantees that context_lens[b] <= max_blocks * block_size and that
 * the first ceil(len / block_size) block ids of each table are valid (the executor validates
 * block ids per batch). A sequence of length 0 gets a zero output.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#define SIMD_W 16
#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD_W 8
#endif
#if defined(SIMD_W) || defined(__F16C__)
#include <immintrin.h>
#endif

#define MAX_D 256
#define MAX_ROWS 64   /* query heads per work unit: stack arrays of MAX_ROWS * MAX_D floats */
#define TILE 16   /* tokens per softmax update: one AVX-512 vector (two AVX2 vectors) of scores */
#define MIN_BYTES_PER_THREAD (4 << 20)   /* K+V bytes (~0.4 ms of one core's reading) per thread */

/* Storage dtypes (the numbers native.py passes). */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;   /* bf16 is the top half of an fp32 */
    float f;
    memcpy(&f, &u, 4);
    return f;
}

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
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2 in two steps (Cody-Waite) so r stays accurate */
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 r2 = _mm512_mul_ps(r, r);
    p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
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
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Lane j of the result = sum of the 8 lanes of v[j] (hadd tree: 9 ops for 8 vectors). */
static inline __m256 hsum8(const __m256 v[8]) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0: low half = v0..v3 low-half sums, high half = their high-half sums; u1 likewise */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline float hadd8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
#endif

/* One work unit: one sequence, kv heads [h0, h0 + nh). Its R = nh * G query rows (row r uses kv
 * head h0 + r / G) stream over the context together, so for nh = Hkv each block's K and V are
 * read as one contiguous run, which the hardware prefetchers follow.
 * qs: fp32 [R][D], already scaled. acc: fp32 [R][D] output (normalised on return).
 * dt and D are compile-time constants at the hot call sites, so the inner loops unroll. */
static inline __attribute__((always_inline)) void
unit(const float *qs, const void *kc, const void *vc, const int dt, const int32_t *table, int len,
     int bs, int64_t tok_stride, int64_t head_off, int nh, int G, const int D, float *acc) {
    const int R = nh * G;
    float m[MAX_ROWS], l[MAX_ROWS];
    float s[MAX_ROWS][TILE] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    memset(acc, 0, sizeof(float) * R * D);

    for (int pos = 0; pos < len;) {
        const int off = pos % bs;
        int n = bs - off;
        if (n > TILE) n = TILE;
        if (n > len - pos) n = len - pos;
        /* element index of token (block, off) at kv head h0 */
        const int64_t base = ((int64_t)table[pos / bs] * bs + off) * tok_stride + head_off;
#if defined(SIMD_W)
        {
            /* next tile's K/V rows: the block tables jump, so hardware prefetchers cannot guess */
            const int np = pos + n;
            if (np < len) {
                int nn = bs - np % bs;
                if (nn > TILE) nn = TILE;
                if (nn > len - np) nn = len - np;
                const int64_t nb = ((int64_t)table[np / bs] * bs + np % bs) * tok_stride + head_off;
                const int esz = dt == DT_F32 ? 4 : 2;   /* bf16, fp16: 2 bytes */
                for (int j = 0; j < nn; j++) {
                    const char *kp = (const char *)kc + (nb + (int64_t)j * tok_stride) * esz;
                    const char *vp = (const char *)vc + (nb + (int64_t)j * tok_stride) * esz;
                    for (int b = 0; b < nh * D * esz; b += 64) {
                        _mm_prefetch(kp + b, _MM_HINT_T0);
                        _mm_prefetch(vp + b, _MM_HINT_T0);
                    }
                }
            }
        }
#endif

        /* scores s[r][j] = q_r . k_j (q already carries the softmax scale) */
        for (int hh = 0; hh < nh; hh++) {
            const int64_t k0 = base + (int64_t)hh * D;
#if defined(__AVX512F__)
            if (D % 16 == 0) {
                /* per 4 query rows: each k_j is loaded once; the 16 per-token partial-sum
                 * vectors of a row are reduced together by hsum16 */
                for (int g0 = 0; g0 < G; g0 += 4) {
                    const int gn = G - g0 < 4 ? G - g0 : 4;
                    const float *qh = qs + (int64_t)(hh * G + g0) * D;
                    __m512 part[4][TILE];
                    for (int j = 0; j < TILE; j++) {
                        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(),
                                       _mm512_setzero_ps(), _mm512_setzero_ps()};
                        if (j < n) {
                            for (int c = 0; c < D / 16; c++) {
                                const __m512 k = load16(kc, dt, k0 + (int64_t)j * tok_stride + 16 * c);
                                for (int gi = 0; gi < gn; gi++)
                                    a[gi] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + gi * D + 16 * c), k, a[gi]);
                            }
                        }
                        for (int gi = 0; gi < gn; gi++) part[gi][j] = a[gi];
                    }
                    for (int gi = 0; gi < gn; gi++) _mm512_store_ps(s[hh * G + g0 + gi], hsum16(part[gi]));
                }
                continue;
            }
#elif SIMD_W == 8
            if (D % 8 == 0) {
                /* per 4 query rows and 8 tokens: each k_j chunk is loaded once; hsum8 reduces the
                 * 8 per-token partial-sum vectors of a row together */
                for (int g0 = 0; g0 < G; g0 += 4) {
                    const int gn = G - g0 < 4 ? G - g0 : 4;
                    const float *qh = qs + (int64_t)(hh * G + g0) * D;
                    for (int j0 = 0; j0 < n; j0 += 8) {
                        __m256 part[4][8];
                        for (int jj = 0; jj < 8; jj++) {
                            const int j = j0 + jj;
                            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(),
                                           _mm256_setzero_ps(), _mm256_setzero_ps()};
                            if (j < n) {
                                for (int c = 0; c < D / 8; c++) {
                                    const __m256 k = load8(kc, dt, k0 + (int64_t)j * tok_stride + 8 * c);
                                    for (int gi = 0; gi < gn; gi++)
                                        a[gi] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + gi * D + 8 * c), k, a[gi]);
                                }
                            }
                            for (int gi = 0; gi < gn; gi++) part[gi][jj] = a[gi];
                        }
                        for (int gi = 0; gi < gn; gi++) _mm256_store_ps(s[hh * G + g0 + gi] + j0, hsum8(part[gi]));
                    }
                }
                continue;
            }
#endif
            for (int j = 0; j < n; j++) {
                const int64_t kj = k0 + (int64_t)j * tok_stride;
                for (int g = 0; g < G; g++) {
                    float a = 0.0f;
                    for (int d = 0; d < D; d++) a += qs[(hh * G + g) * D + d] * load_elem(kc, dt, kj + d);
                    s[hh * G + g][j] = a;
                }
            }
        }

        /* online softmax: s[r][j] becomes the weight p_j = exp(s_j - m_new); acc, l rescaled */
        for (int r = 0; r < R; r++) {
            float mx = m[r], sum = 0.0f;
#if defined(__AVX512F__)
            const __mmask16 mask = (__mmask16)((1u << n) - 1u);
            const __m512 sv = _mm512_maskz_loadu_ps(mask, s[r]);
            const float tmax = _mm512_mask_reduce_max_ps(mask, sv);
            mx = tmax > mx ? tmax : mx;
            const float alpha = expf(m[r] - mx);   /* 0 on the first tile (m = -inf) */
            __m512 p = exp512(_mm512_sub_ps(sv, _mm512_set1_ps(mx)));
            p = _mm512_maskz_mov_ps(mask, p);
            _mm512_store_ps(s[r], p);
            sum = _mm512_reduce_add_ps(p);
#elif SIMD_W == 8
            /* lanes >= n hold stale scores: masked out of the max and zeroed after exp */
            const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256 m0 = _mm256_cmp_ps(lane, _mm256_set1_ps((float)n), _CMP_LT_OQ);
            const __m256 m1 = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(8.0f)),
                                            _mm256_set1_ps((float)n), _CMP_LT_OQ);
            const __m256 ninf = _mm256_set1_ps(-INFINITY);
            const __m256 s0 = _mm256_blendv_ps(ninf, _mm256_load_ps(s[r]), m0);
            const __m256 s1 = _mm256_blendv_ps(ninf, _mm256_load_ps(s[r] + 8), m1);
            const float tmax = hmax8(_mm256_max_ps(s0, s1));
            mx = tmax > mx ? tmax : mx;
            const float alpha = expf(m[r] - mx);   /* 0 on the first tile (m = -inf) */
            const __m256 mxv = _mm256_set1_ps(mx);
            const __m256 p0 = _mm256_and_ps(exp256(_mm256_sub_ps(s0, mxv)), m0);
            const __m256 p1 = _mm256_and_ps(exp256(_mm256_sub_ps(s1, mxv)), m1);
            _mm256_store_ps(s[r], p0);
            _mm256_store_ps(s[r] + 8, p1);
            sum = hadd8(_mm256_add_ps(p0, p1));
#else
            for (int j = 0; j < n; j++) mx = s[r][j] > mx ? s[r][j] : mx;
            const float alpha = expf(m[r] - mx);
            for (int j = 0; j < n; j++) { s[r][j] = expf(s[r][j] - mx); sum += s[r][j]; }
#endif
            if (alpha != 1.0f)
                for (int d = 0; d < D; d++) acc[r * D + d] *= alpha;
            l[r] = l[r] * alpha + sum;
            m[r] = mx;
        }

        /* acc_r += sum_j p_j v_j */
        for (int hh = 0; hh < nh; hh++) {
            const int64_t v0 = base + (int64_t)hh * D;
#if defined(__AVX512F__)
            if (D % 16 == 0) {
                /* accumulators of up to 4 query rows stay in registers across the tile's tokens;
                 * each v chunk is loaded once per 4 rows */
                for (int c = 0; c < D / 16; c++) {
                    for (int g0 = 0; g0 < G; g0 += 4) {
                        const int gn = G - g0 < 4 ? G - g0 : 4;
                        const int r0 = hh * G + g0;
                        float *a = acc + (int64_t)r0 * D + 16 * c;
                        __m512 a0 = _mm512_loadu_ps(a), a1 = a0, a2 = a0, a3 = a0;
                        if (gn > 1) a1 = _mm512_loadu_ps(a + D);
                        if (gn > 2) a2 = _mm512_loadu_ps(a + 2 * D);
                        if (gn > 3) a3 = _mm512_loadu_ps(a + 3 * D);
                        for (int j = 0; j < n; j++) {
                            const __m512 v = load16(vc, dt, v0 + (int64_t)j * tok_stride + 16 * c);
                            a0 = _mm512_fmadd_ps(_mm512_set1_ps(s[r0][j]), v, a0);
                            if (gn > 1) a1 = _mm512_fmadd_ps(_mm512_set1_ps(s[r0 + 1][j]), v, a1);
                            if (gn > 2) a2 = _mm512_fmadd_ps(_mm512_set1_ps(s[r0 + 2][j]), v, a2);
                            if (gn > 3) a3 = _mm512_fmadd_ps(_mm512_set1_ps(s[r0 + 3][j]), v, a3);
                        }
                        _mm512_storeu_ps(a, a0);
                        if (gn > 1) _mm512_storeu_ps(a + D, a1);
                        if (gn > 2) _mm512_storeu_ps(a + 2 * D, a2);
                        if (gn > 3) _mm512_storeu_ps(a + 3 * D, a3);
                    }
                }
                continue;
            }
#elif SIMD_W == 8
            if (D % 8 == 0) {
                for (int c = 0; c < D / 8; c++) {
                    for (int g0 = 0; g0 < G; g0 += 4) {
                        const int gn = G - g0 < 4 ? G - g0 : 4;
                        const int r0 = hh * G + g0;
                        float *a = acc + (int64_t)r0 * D + 8 * c;
                        __m256 a0 = _mm256_loadu_ps(a), a1 = a0, a2 = a0, a3 = a0;
                        if (gn > 1) a1 = _mm256_loadu_ps(a + D);
                        if (gn > 2) a2 = _mm256_loadu_ps(a + 2 * D);
                        if (gn > 3) a3 = _mm256_loadu_ps(a + 3 * D);
                        for (int j = 0; j < n; j++) {
                            const __m256 v = load8(vc, dt, v0 + (int64_t)j * tok_stride + 8 * c);
                            a0 = _mm256_fmadd_ps(_mm256_set1_ps(s[r0][j]), v, a0);
                            if (gn > 1) a1 = _mm256_fmadd_ps(_mm256_set1_ps(s[r0 + 1][j]), v, a1);
                            if (gn > 2) a2 = _mm256_fmadd_ps(_mm256_set1_ps(s[r0 + 2][j]), v, a2);
                            if (gn > 3) a3 = _mm256_fmadd_ps(_mm256_set1_ps(s[r0 + 3][j]), v, a3);
                        }
                        _mm256_storeu_ps(a, a0);
                        if (gn > 1) _mm256_storeu_ps(a + D, a1);
                        if (gn > 2) _mm256_storeu_ps(a + 2 * D, a2);
                        if (gn > 3) _mm256_storeu_ps(a + 3 * D, a3);
                    }
                }
                continue;
            }
#endif
            for (int j = 0; j < n; j++) {
                const int64_t vj = v0 + (int64_t)j * tok_stride;
                for (int d = 0; d < D; d++) {
                    const float v = load_elem(vc, dt, vj + d);
                    for (int g = 0; g < G; g++) acc[(hh * G + g) * D + d] += s[hh * G + g][j] * v;
                }
            }
        }
        pos += n;
    }
    for (int r = 0; r < R; r++) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;   /* len 0 -> zeros */
        for (int d = 0; d < D; d++) acc[r * D + d] *= inv;
    }
}

/* Other head sizes: one out-of-line copy with runtime dtype and D (fewer copies, faster build). */
static __attribute__((noinline)) void
unit_any(const float *qs, const void *kc, const void *vc, int dt, const int32_t *table, int len,
         int bs, int64_t tok_stride, int64_t head_off, int nh, int G, int D, float *acc) {
    unit(qs, kc, vc, dt, table, len, bs, tok_stride, head_off, nh, G, D, acc);
}

/* Returns 0, or -1 when the shape is outside what this kernel supports (nothing written). */
int paged_decode_attention(
    const void *q, int q_dt, int64_t q_row_stride,      /* [*, Hq, D], row stride in elements */
    const void *k_cache, const void *v_cache, int kv_dt, /* [num_blocks, bs, Hkv, D] */
    const int32_t *block_tables, int max_blocks,         /* [B, max_blocks] */
    const int32_t *context_lens,                         /* [B] */
    const int32_t *rows,                                 /* [B] batch row per sequence, or NULL */
    int B, int Hq, int Hkv, int D, int bs, float scale,
    void *out, int out_dt, int64_t out_row_stride, int num_threads) {
    if (D < 1 || D > MAX_D || Hkv < 1 || Hq % Hkv != 0 || Hq / Hkv > MAX_ROWS || bs < 1) return -1;
    if (kv_dt < DT_F32 || kv_dt > DT_F16 || q_dt < DT_F32 || q_dt > DT_BF16 || out_dt < DT_F32 || out_dt > DT_BF16)
        return -1;
    const int G = Hq / Hkv;
    const int64_t tok_stride = (int64_t)Hkv * D;
    if (num_threads < 1) num_threads = 1;
    /* kv heads per unit: one. Measured on SmolLM2 shapes (32 x 1k context, 1 thread, with the
     * next-tile prefetch): whole-sequence units (contiguous reads) were 5-10% slower; units
     * of one head also balance threads better. -DPD_NH=n builds the other variants. */
    int nh = 1;
#ifdef PD_NH
    nh = PD_NH;
#endif
    while (nh > 1 && (Hkv % nh != 0 || nh * G > MAX_ROWS)) nh--;
    const int per_seq = Hkv / nh;
    const int64_t units = (int64_t)B * per_seq;
    /* one more thread per MIN_BYTES_PER_THREAD of K/V: a fork/join costs microseconds, and on a
     * loaded machine a descheduled helper thread stalls the join for a whole timeslice (ms) */
    int64_t kv_bytes = 0;
    for (int b = 0; b < B; b++) kv_bytes += context_lens[b];
    kv_bytes *= 2 * tok_stride * (kv_dt == DT_F32 ? 4 : 2);
    if (num_threads > 1 + kv_bytes / MIN_BYTES_PER_THREAD)
        num_threads = (int)(1 + kv_bytes / MIN_BYTES_PER_THREAD);

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && units > 1)
    for (int64_t u = 0; u < units; u++) {
        const int b = (int)(u / per_seq), h0 = (int)(u % per_seq) * nh;
        const int R = nh * G;
        const int64_t row = rows ? rows[b] : b;
        float qs[MAX_ROWS * MAX_D] __attribute__((aligned(64)));
        float acc[MAX_ROWS * MAX_D] __attribute__((aligned(64)));
        const int64_t q0 = row * q_row_stride + (int64_t)h0 * G * D;
        for (int i = 0; i < R * D; i++) qs[i] = load_elem(q, q_dt, q0 + i) * scale;
        const int32_t *table = block_tables + (int64_t)b * max_blocks;
        const int len = context_lens[b];
        const int64_t head_off = (int64_t)h0 * D;
        /* constant dtype and D at the common call sites (head_dim 64, 128): fully unrolled loops */
#define UNIT(DT, DD) unit(qs, k_cache, v_cache, DT, table, len, bs, tok_stride, head_off, nh, G, DD, acc)
        if (D == 64 && kv_dt == DT_F32) UNIT(DT_F32, 64);
        else if (D == 64 && kv_dt == DT_BF16) UNIT(DT_BF16, 64);
        else if (D == 64) UNIT(DT_F16, 64);
        else if (D == 128 && kv_dt == DT_F32) UNIT(DT_F32, 128);
        else if (D == 128 && kv_dt == DT_BF16) UNIT(DT_BF16, 128);
        else if (D == 128) UNIT(DT_F16, 128);
        else unit_any(qs, k_cache, v_cache, kv_dt, table, len, bs, tok_stride, head_off, nh, G, D, acc);
#undef UNIT
        const int64_t o0 = row * out_row_stride + (int64_t)h0 * G * D;
        if (out_dt == DT_F32)
            memcpy((float *)out + o0, acc, sizeof(float) * R * D);
        else
            for (int i = 0; i < R * D; i++) ((uint16_t *)out)[o0 + i] = f32_to_bf16(acc[i]);
    }
    return 0;
}

/* Which SIMD path this build runs: "avx512", "avx2" or "scalar". */
const char *paged_decode_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif SIMD_W == 8
    return "avx2";
#else
    return "scalar";
#endif
}
