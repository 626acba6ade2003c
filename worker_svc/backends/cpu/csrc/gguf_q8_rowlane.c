/* The integer-dot path's row-lane kernel (rl_rows): gguf_linear_q8 with GG_Q8_LANES, calls of up
 * to LANE_RL_MAX tokens and the short remainders past whole token-lane tiles (gguf_q8.h). AVX2
 * builds, with vpdpbusd on ymm registers where AVX-512 VNNI is built (GG_VNNI).
 *
 * Numbers: the token-lane kernels' (gguf_q8_toklane_*.c). The same exact integer dot per run, and
 * per (row, token) the same fp32 steps in the same order: acc = fma(float(dot), scale * da, acc)
 * run after run (Q6_K: its two 16-element halves one after the other), corr = corr + cw * sa,
 * result acc + corr. So a token's result is bit-identical whichever lane kernel its call runs on.
 *
 * Layout: the lanes are rows, RL = 8 rows (an octet), one per int32 lane of a ymm. Each run's
 * 8 x 8 dwords (row, group of 4 weights) are transposed in registers, so that one vpdpbusd
 * multiplies group g of all 8 rows by a token's 4 activation bytes of that group, broadcast from
 * memory; the transposed run serves all the call's tokens (in passes of up to Q8_TILE), and a
 * run's dots take one convert, scale and fma for 8 rows. Everything stays in registers: a block's
 * 32-byte pieces of the 8 rows (nibbles, high bits, bytes) are transposed as they are (Q4_0 /
 * Q4_1 / Q6_K's scales 4 x 4 dwords), then unpacked with FOR_EACH_RUN's operations, and the scales
 * are decoded 8 rows a vector (fp16 converted 8 at a time; the K-quants' 6-bit scales and mins and
 * Q6_K's int8 scales in the lanes), with FOR_EACH_RUN's IEEE operations. (Unpacking each row
 * through FOR_EACH_RUN into a buffer and reading the scales back lane by lane gave up the gain
 * over the tile kernels.)
 *
 * Dots: vpdpbusd is unsigned x signed, so the weights go unsigned (the unsigned formats' values as
 * they are; signed ones, Q8_0 and Q6_K, as v + 128, and 128 times the token's activation sum over
 * the run is subtracted in int32: exact), the activations as their signed bytes. Without VNNI,
 * maddubs and madd (the second RL_TOKENS below) give the same integer dots. There, Q8_0 passes of
 * at most RL_Q8_ROWDOT tokens skip the transpose: each row's dot in its own vector, the octet's
 * partial sums transposed at the end (rl_rowsums); the same integer dots again.
 *
 * Prefetch: an octet's rows are short streams (K / 32 runs) that the hardware prefetchers barely
 * start on, so the next octet's bytes are prefetched in software while this one runs.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_q8.h"

#if defined(GG_AVX2)
#define RL 8   /* rows in a vector's lanes: an octet */

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
/* the run's dots and fp32 steps at vector width W (256: an octet in ymm; 512: two in zmm, rl2_rows):
 * one body for both widths, so the two kernels' steps are the same lane for lane */
#define RL_TOKENS_W(b, W)                                                                                  \
    for (int t = 0; t < NT; t++) {                                                                     \
        const int8_t *a = qa + t * qs + 32 * (b);                                                      \
        __m##W##i h = _mm##W##_setzero_si##W(), l = h, h2 = h, l2 = h;                                 \
_Pragma("GCC unroll 8")                                                                                   \
        for (int g = 0; g < 8; g++) {                                                                  \
            int32_t a4;                                                                                \
            memcpy(&a4, a + 4 * g, 4);                                                                 \
            if (Q6 && g >= 4) h2 = _mm##W##_dpbusd_epi32(h2, w[g], _mm##W##_set1_epi32(a4));           \
            else h = _mm##W##_dpbusd_epi32(h, w[g], _mm##W##_set1_epi32(a4));                          \
            if (P == 2) {                                                                              \
                memcpy(&a4, a + lo + 4 * g, 4);                                                        \
                if (Q6 && g >= 4) l2 = _mm##W##_dpbusd_epi32(l2, w[g], _mm##W##_set1_epi32(a4));       \
                else l = _mm##W##_dpbusd_epi32(l, w[g], _mm##W##_set1_epi32(a4));                      \
            }                                                                                          \
        }                                                                                              \
        const int64_t tb = (int64_t)t * fs + (b);                                                      \
        __m##W##i d = P == 2 ? _mm##W##_add_epi32(_mm##W##_slli_epi32(h, 7), l) : h;                   \
        const __m##W dav = _mm##W##_set1_ps(da[tb]);                                                   \
        if (SG) d = _mm##W##_sub_epi32(d, _mm##W##_set1_epi32(128 * (Q6 ? ST[2 * tb] : ST[2 * tb] + ST[2 * tb + 1])));\
        acc[t] = _mm##W##_fmadd_ps(_mm##W##_cvtepi32_ps(d), _mm##W##_mul_ps(s0v, dav), acc[t]);        \
        if (Q6) {                                                                                      \
            __m##W##i d2 = P == 2 ? _mm##W##_add_epi32(_mm##W##_slli_epi32(h2, 7), l2) : h2;           \
            d2 = _mm##W##_sub_epi32(d2, _mm##W##_set1_epi32(128 * ST[2 * tb + 1]));                    \
            acc[t] = _mm##W##_fmadd_ps(_mm##W##_cvtepi32_ps(d2), _mm##W##_mul_ps(s1v, dav), acc[t]);   \
        }                                                                                              \
        if (!SG) corr[t] = _mm##W##_add_ps(corr[t], _mm##W##_mul_ps(cwv, _mm##W##_set1_ps(sa[tb])));   \
    }
#define RL_TOKENS(b) RL_TOKENS_W(b, 256)


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
                    Q8_KEEP(h);                                                                        \
                    Q8_KEEP(l);                                                                        \
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

/* each row's first dword of its block p[r] (its fp16 d, and Q4_1's m) in lane r */
static inline __attribute__((always_inline)) __m256i rl_heads(const uint8_t *const *p) {
    return _mm256_setr_epi32(ld32(p[0]), ld32(p[1]), ld32(p[2]), ld32(p[3]), ld32(p[4]), ld32(p[5]), ld32(p[6]),
                             ld32(p[7]));
}

#if !defined(GG_VNNI)
/* v[r]: 8 dword partial sums of row r -> dword r: their sum (int32: exact in any order) */
static inline __attribute__((always_inline)) __m256i rl_rowsums(const __m256i *v) {
    const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3])),
                  u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    /* u0's lanes: rows 0-3's sums of dwords 0-3 (low) and 4-7 (high); u1: rows 4-7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

#ifndef RL_Q8_ROWDOT
#define RL_Q8_ROWDOT 4   /* Q8_0 passes of at most this many tokens take the row dots */
#endif
/* SARATHI_GGUF_Q8_ROWDOT=0: every Q8_0 pass through the pairs (W2), as before (A/B) */
static int rl_q8_rowdot(void) {
    static int on = -1;
    if (on < 0) { const char *e = getenv("SARATHI_GGUF_Q8_ROWDOT"); on = !(e && e[0] == '0'); }
    return on;
}
#endif

/* an octet's block of a format of one run a block (Q4_0, Q4_1, Q8_0): its 8 weight groups, transposed
 * (w[g] dword r: row r's group g), and each row's first dword (hv: its fp16 d, and Q4_1's m) */
static inline __attribute__((always_inline)) void rl_octet_run(const int type, const uint8_t *const *p, int bb,
                                                               __m256i *w, __m256i *hv) {
    if (type == T_Q8_0) {
        rl_load8(p, 2, w);
#if defined(GG_VNNI)
        for (int g = 0; g < 8; g++) w[g] = _mm256_xor_si256(w[g], _mm256_set1_epi8((char)0x80));
#endif
    } else {
        /* 16 bytes a row: byte l holds element l (low nibble) and l + 16 (high); dword g of the 8
         * rows' bytes, transposed, gives groups g (low nibbles) and g + 4 (high) */
        __m256i g4[4];
        rl_load4(p, bb - 16, g4);
        for (int g = 0; g < 4; g++) {
            w[g] = nibbles(g4[g], 0);
            w[g + 4] = nibbles(g4[g], 1);
        }
    }
    *hv = rl_heads(p);
}

/* Q4_K / Q5_K sub-block j's scale and min term of an octet (H: its blocks' first 32 bytes,
 * transposed; d, dmin: their fp16 d and dmin, converted): s = d * (float)sc_j and
 * cw = -(dmin * (float)m_j), FOR_EACH_RUN's IEEE operations (scale_min_k4 in the lanes) */
static inline __attribute__((always_inline)) void rl_kq_scales(const __m256i *H, int j, __m256 d, __m256 dmin,
                                                               __m256 *s, __m256 *cw) {
    const __m256i m63 = _mm256_set1_epi32(63);
#define RL_QB(k) _mm256_and_si256(_mm256_srli_epi32(H[1 + (k) / 4], 8 * ((k) % 4)), _mm256_set1_epi32(0xff))
    __m256i sc, mn;
    if (j < 4) {
        sc = _mm256_and_si256(RL_QB(j), m63);
        mn = _mm256_and_si256(RL_QB(j + 4), m63);
    } else {
        sc = _mm256_or_si256(_mm256_and_si256(RL_QB(j + 4), _mm256_set1_epi32(15)),
                             _mm256_slli_epi32(_mm256_srli_epi32(RL_QB(j - 4), 6), 4));
        mn = _mm256_or_si256(_mm256_srli_epi32(RL_QB(j + 4), 4), _mm256_slli_epi32(_mm256_srli_epi32(RL_QB(j), 6), 4));
    }
#undef RL_QB
    *s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
    *cw = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn)), _mm256_set1_ps(-0.0f));
}

/* Q6_K: an octet's d (fp16 at byte 208 of each row's block p[r]), converted */
static inline __attribute__((always_inline)) __m256 rl_q6_d(const uint8_t *const *p) {
    return _mm256_cvtph_ps(rl_words(_mm256_setr_epi32(ld16(p[0] + 208), ld16(p[1] + 208), ld16(p[2] + 208),
                                                      ld16(p[3] + 208), ld16(p[4] + 208), ld16(p[5] + 208),
                                                      ld16(p[6] + 208), ld16(p[7] + 208))));
}

/* Q6_K: int8 scale k of each row of an octet, sign-extended (S4[q] dword r = row r's scales 4q .. 4q + 3) */
static inline __attribute__((always_inline)) __m256i rl_q6_sc(const __m256i *S4, int k) {
    return _mm256_srai_epi32(_mm256_slli_epi32(S4[k / 4], 24 - 8 * (k % 4)), 24);
}

/* Q6_K: run j of a half's weight groups of an octet (L: its two 32-byte ql pieces, QH: its qh, both
 * transposed), as FOR_EACH_RUN: v = lo | hi << 4, the weight v - 32; unsigned on VNNI builds
 * ((v - 32) ^ 0x80 = v + 96), signed otherwise (RL_Q6_OFF) */
static inline __attribute__((always_inline)) void rl_q6_run(__m256i L[2][8], const __m256i *QH, int j, __m256i *w) {
    for (int g = 0; g < 8; g++) w[g] = _mm256_add_epi8(q6k_quants(L[j & 1][g], QH[g], j), _mm256_set1_epi8(RL_Q6_OFF));
}

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
#if !defined(GG_VNNI)
            if (type == T_Q8_0 && P == 2 && NT <= RL_Q8_ROWDOT && rl_q8_rowdot()) {
                /* few tokens: each row's run widened straight from memory (again for each token:
                 * a load-and-widen) and dotted with the token's 16-bit activations (ST) in 8 dword
                 * partial sums, the octet's sums then transposed together (rl_rowsums): no
                 * transpose of the bytes and no pairs (W2), which pay back only over more tokens.
                 * The same integer dot (exact in int32), so the same fp32 steps give the same bits. */
                const __m256 s0v = _mm256_cvtph_ps(rl_words(rl_heads(p)));
                for (int t = 0; t < NT; t++) {
                    const int32_t *st = ST + t * 16 * fs + 16 * i;
                    const __m256i a0 = _mm256_loadu_si256((const __m256i *)st),
                                  a1 = _mm256_loadu_si256((const __m256i *)(st + 8));
                    __m256i v[RL];
                    for (int r = 0; r < RL; r++)
                        v[r] = _mm256_add_epi32(
                            _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p[r] + 2))), a0),
                            _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p[r] + 18))), a1));
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rl_rowsums(v)),
                                             _mm256_mul_ps(s0v, _mm256_set1_ps(da[(int64_t)t * fs + i])), acc[t]);
                }
                continue;
            }
#endif
            __m256i w[8], hv;
            rl_octet_run(type, p, bb, w, &hv);
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
                        Q8_KEEP(d0);
                        Q8_KEEP(d1);
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
            for (int c = 0; c < 4; c++) {   /* 32 bytes: sub-blocks 2c (low nibbles) and 2c + 1 (high) */
                __m256i G[8];
                rl_load8(p, q4 + 32 * c, G);
                for (int half = 0; half < 2; half++) {
                    const int j = 2 * c + half;
                    __m256i w[8];
                    for (int g = 0; g < 8; g++) {
                        w[g] = nibbles(G[g], half);
                        if (type == T_Q5_K) w[g] = q5k_quants(w[g], QH[g], j);   /* as FOR_EACH_RUN */
                    }
                    __m256 s0v, cwv;   /* scale_min_k4(j) in the lanes */
                    rl_kq_scales(H, j, dv, dminv, &s0v, &cwv);
                    const __m256 s1v = s0v;
                    const int b = 8 * i + j;
                    RL_TOKENS(b)
                }
            }
            continue;
        }
        {   /* Q6_K, in registers as well: ql, qh and the int8 scales of the 8 rows transposed */
            const __m256 dv = rl_q6_d(p);
            __m256i S4[4];   /* the 16 int8 scales (rl_q6_sc) */
            rl_load4(p, 192, S4);
            for (int h = 0; h < 2; h++) {
                __m256i QH[8], L[2][8];
                rl_load8(p, 128 + 32 * h, QH);
                for (int c = 0; c < 2; c++) rl_load8(p, 64 * h + 32 * c, L[c]);
                for (int j = 0; j < 4; j++) {
                    __m256i w[8];
                    rl_q6_run(L, QH, j, w);
                    const int e = 128 * h + 32 * j;
                    const __m256 s0v = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(rl_q6_sc(S4, e / 16)));
                    const __m256 s1v = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(rl_q6_sc(S4, e / 16 + 1))), cwv = s0v;
                    const int b = 8 * i + 4 * h + j;
                    RL_TOKENS(b)
                }
            }
        }
    }
    for (int t = 0; t < NT; t++) _mm256_storeu_ps(res + t * RL, _mm256_add_ps(acc[t], corr[t]));
}

/* FN(type, NT, P, ...) with the pass's token count nt a constant 1 .. Q8_TILE (compiled per count) */
#define RL_ARGS rows, nb, qa, qs, lo, da, sa, fs, ST, pf, pfn, res
#define RL_CASES_1_7(FN, TY, PP)                                                                   \
    case 1: FN(TY, 1, PP, RL_ARGS); break;                                                         \
    case 2: FN(TY, 2, PP, RL_ARGS); break;                                                         \
    case 3: FN(TY, 3, PP, RL_ARGS); break;                                                         \
    case 4: FN(TY, 4, PP, RL_ARGS); break;                                                         \
    case 5: FN(TY, 5, PP, RL_ARGS); break;                                                         \
    case 6: FN(TY, 6, PP, RL_ARGS); break;                                                         \
    case 7: FN(TY, 7, PP, RL_ARGS); break;
#define RL_NT(FN, TY, PP)                                                                          \
    switch (nt) {                                                                                  \
    RL_CASES_1_7(FN, TY, PP)                                                                       \
    default: FN(TY, Q8_TILE, PP, RL_ARGS); break;                                                  \
    }
#define RL_CASE(TY)                                                                                \
        if (P == 2) { RL_NT(rl_rows, TY, 2) } else { RL_NT(rl_rows, TY, 1) }
/* nt: 1 .. Q8_TILE tokens */
static void rl_rows_any(int type, int nt, int P, const uint8_t *const *rows, int nb, const int8_t *qa, int64_t qs,
                        int64_t lo, const float *da, const float *sa, int64_t fs, const int32_t *ST, const uint8_t *pf,
                        int64_t pfn, float *res) {
    SWITCH_FORMATS(type, RL_CASE)
}
#undef RL_CASE

#if defined(GG_TL)
/* Two octets at once in zmm lanes (rows 0-7 in the low 256 bits, 8-15 in the high), every format:
 * each octet's weights and scales are loaded and transposed exactly as rl_rows does (its helpers),
 * then joined, so that one 512-bit vpdpbusd does the work of two 256-bit
 * ones (the same instruction rate on the AVX-512 cores measured: twice the multiplies). Per (row,
 * token) the integer dot and the fp32 steps are rl_rows's, lane for lane: the same bits. Used by
 * rl_linear where 16 rows remain, in calls of at least rl2_min() tokens: on the Xeons measured,
 * RL2_MIN_TOKENS (with fewer, the dots are too few for the wider vectors to pay for joining two
 * octets' unpacked runs); on AMD family 19h (Zen 4: the VNNI build's only AMD cores of that family),
 * every call, where a 512-bit dot issues as two 256-bit halves and the wider vectors' gain is the
 * halved instruction count: faster at every size measured, 1 token included
 * (bench/results/kernels/README.md, "Sixteen rows a vector", "On Zen 4"), but for Q4_K and Q5_K
 * from 2 tokens with two parts and 4 with one (RL2_MIN_TOKENS_KQ: below, their joined unpacking
 * cost 5-9% there), and Q6_K everywhere from 9 (RL2_MIN_TOKENS_Q6: below, within noise of the
 * octets on Zen 4; from 9 the octets take two passes, this kernel one); a call's last rows go
 * through rl_rows.
 * A call's tokens go in as few passes as RL2_TILE allows, of equal size: each pass loads, transposes
 * and unpacks the rows again, which costs more than the accumulators that do not fit the registers
 * up to 12 tokens, and less above (bench/results/kernels/README.md, "Fewer passes"). */
#define RL2 16
#define RL2_MIN_TOKENS 5
#define RL2_MIN_TOKENS_ZEN4 1
/* Q4_K, Q5_K at least (by parts): with fewer tokens a call unpacks two octets' scales for too few dots */
#define RL2_MIN_TOKENS_KQ(parts) ((parts) == 2 ? 2 : 4)
/* Q6_K (two scales a run, the heaviest unpacking) at least: where the octets need a second pass */
#define RL2_MIN_TOKENS_Q6 (Q8_TILE + 1)
#define RL2_TILE 12   /* tokens a pass at most */
static inline __m512i rl_join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
static inline __m512 rl_joinf(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

/* rl2_rows's run b (w[8] zmm: its groups of 4 for 16 rows, s0v, s1v, cwv) against the call's NT
 * tokens: RL_TOKENS's body at 512 bits (Q6_K: its two 16-element halves' dots, each with its own
 * scale and offset sum) */
#define RL2_TOKENS(b) RL_TOKENS_W(b, 512)

static inline __attribute__((always_inline)) void
rl2_rows(const int type, const int NT, const int P, const uint8_t *const *rows, int nb, const int8_t *qa,
         int64_t qs, int64_t lo, const float *da, const float *sa, int64_t fs, const int32_t *ST, const uint8_t *pf,
         int64_t pfn, float *res) {
    const int64_t pfstep = ((pfn + nb - 1) / nb + 63) & ~(int64_t)63;
    const int SG = type == T_Q8_0 || type == T_Q6_K, Q6 = type == T_Q6_K;
    const int bb = block_bytes(type);
    __m512 acc[RL2_TILE], corr[RL2_TILE];
    for (int t = 0; t < NT; t++) { acc[t] = _mm512_setzero_ps(); corr[t] = _mm512_setzero_ps(); }
    for (int i = 0; i < nb; i++) {
        for (int64_t o = i * pfstep; o < (i + 1) * pfstep && o < pfn; o += 64) _mm_prefetch((const char *)pf + o, _MM_HINT_T0);
        const uint8_t *p[RL2];
        for (int r = 0; r < RL2; r++) p[r] = rows[r] + (int64_t)i * bb;
        if (type == T_Q4_K || type == T_Q5_K) {   /* rl_rows's K-quant unpacking, each octet, joined */
            __m256i HA[8], HB[8], QA[8], QB[8];
            rl_load8(p, 0, HA);
            rl_load8(p + RL, 0, HB);
            const __m256 dA = _mm256_cvtph_ps(rl_words(HA[0])), dB = _mm256_cvtph_ps(rl_words(HB[0]));
            const __m256 mA = _mm256_cvtph_ps(rl_words(_mm256_srli_epi32(HA[0], 16)));
            const __m256 mB = _mm256_cvtph_ps(rl_words(_mm256_srli_epi32(HB[0], 16)));
            if (type == T_Q5_K) {
                rl_load8(p, 16, QA);
                rl_load8(p + RL, 16, QB);
            }
            const int q4 = type == T_Q4_K ? 16 : 48;
            for (int c = 0; c < 4; c++) {
                __m256i GA[8], GB[8];
                rl_load8(p, q4 + 32 * c, GA);
                rl_load8(p + RL, q4 + 32 * c, GB);
                for (int half = 0; half < 2; half++) {
                    const int j = 2 * c + half;
                    __m512i w[8];
                    for (int g = 0; g < 8; g++) {
                        __m256i a = nibbles(GA[g], half), b = nibbles(GB[g], half);
                        if (type == T_Q5_K) {
                            a = q5k_quants(a, QA[g], j);
                            b = q5k_quants(b, QB[g], j);
                        }
                        w[g] = rl_join(a, b);
                    }
                    __m256 sA, sB, cA, cB;
                    rl_kq_scales(HA, j, dA, mA, &sA, &cA);
                    rl_kq_scales(HB, j, dB, mB, &sB, &cB);
                    const __m512 s0v = rl_joinf(sA, sB), s1v = s0v, cwv = rl_joinf(cA, cB);
                    RL2_TOKENS(8 * i + j)
                }
            }
            continue;
        }
        if (type == T_Q6_K) {   /* rl_rows's Q6_K unpacking, each octet, joined */
            const __m512 dv = rl_joinf(rl_q6_d(p), rl_q6_d(p + RL));
            __m256i SA[4], SB[4];
            rl_load4(p, 192, SA);
            rl_load4(p + RL, 192, SB);
#define RL2_SC(k) rl_join(rl_q6_sc(SA, k), rl_q6_sc(SB, k))
            for (int h = 0; h < 2; h++) {
                __m256i QA[8], QB[8], LA[2][8], LB[2][8];
                rl_load8(p, 128 + 32 * h, QA);
                rl_load8(p + RL, 128 + 32 * h, QB);
                for (int c = 0; c < 2; c++) {
                    rl_load8(p, 64 * h + 32 * c, LA[c]);
                    rl_load8(p + RL, 64 * h + 32 * c, LB[c]);
                }
                for (int j = 0; j < 4; j++) {
                    __m256i wA[8], wB[8];
                    rl_q6_run(LA, QA, j, wA);
                    rl_q6_run(LB, QB, j, wB);
                    __m512i w[8];
                    for (int g = 0; g < 8; g++) w[g] = rl_join(wA[g], wB[g]);
                    const int e = 128 * h + 32 * j;
                    const __m512 s0v = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(RL2_SC(e / 16)));
                    const __m512 s1v = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(RL2_SC(e / 16 + 1))), cwv = s0v;
                    const int run = 8 * i + 4 * h + j;   /* (a name: the macro's own h shadows this one) */
                    RL2_TOKENS(run)
                }
            }
#undef RL2_SC
            continue;
        }
        __m256i wl[8], wh[8], hl, hh;
        rl_octet_run(type, p, bb, wl, &hl);
        rl_octet_run(type, p + RL, bb, wh, &hh);
        __m512i w[8];
        for (int g = 0; g < 8; g++) w[g] = rl_join(wl[g], wh[g]);
        const __m256 s0l = _mm256_cvtph_ps(rl_words(hl)), s0h = _mm256_cvtph_ps(rl_words(hh));
        const __m512 s0v = rl_joinf(s0l, s0h), s1v = s0v;
        const __m512 cwv = type == T_Q4_0 ? _mm512_mul_ps(_mm512_set1_ps(-8.0f), s0v)
                                          : rl_joinf(_mm256_cvtph_ps(rl_words(_mm256_srli_epi32(hl, 16))),
                                                     _mm256_cvtph_ps(rl_words(_mm256_srli_epi32(hh, 16))));
        RL2_TOKENS(i)
    }
    for (int t = 0; t < NT; t++) _mm512_storeu_ps(res + t * RL2, _mm512_add_ps(acc[t], corr[t]));
}

/* rl2_rows with the pass's token count nt a constant 1 .. RL2_TILE */
#define RL2_NT(TY, PP)                                                                             \
    switch (nt) {                                                                                  \
    RL_CASES_1_7(rl2_rows, TY, PP)                                                                 \
    case 8: rl2_rows(TY, 8, PP, RL_ARGS); break;                                                   \
    case 9: rl2_rows(TY, 9, PP, RL_ARGS); break;                                                   \
    case 10: rl2_rows(TY, 10, PP, RL_ARGS); break;                                                 \
    case 11: rl2_rows(TY, 11, PP, RL_ARGS); break;                                                 \
    default: rl2_rows(TY, RL2_TILE, PP, RL_ARGS); break;                                           \
    }
#define RL2_CASE(TY)                                                                               \
        if (P == 2) { RL2_NT(TY, 2) } else { RL2_NT(TY, 1) }
/* SARATHI_GGUF_ROWS16=0: octets only (for A/B measurements; the same bits either way) */
static int rl2_enabled(void) {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("SARATHI_GGUF_ROWS16");
        on = !(e && e[0] == '0');
    }
    return on;
}
/* the tokens of each pass of rl2_rows over a call of T tokens: equal passes of at most RL2_TILE,
 * or of at most SARATHI_GGUF_ROWS16_PASS = 1 .. RL2_TILE (for A/B measurements; the same bits) */
static int rl2_pass(int T) {
    static int most = 0;
    if (most == 0) {
        const char *e = getenv("SARATHI_GGUF_ROWS16_PASS");
        const int v = e ? atoi(e) : 0;
        most = v >= 1 && v <= RL2_TILE ? v : RL2_TILE;
    }
    const int passes = (T + most - 1) / most;
    return (T + passes - 1) / passes;
}
/* the fewest tokens of a call of `type` and `parts` that rl2_rows takes (see there): by CPU and
 * format, or SARATHI_GGUF_ROWS16_MIN = 1 .. RL2_TILE for every format (for A/B measurements; the
 * same bits either way) */
static int rl2_min(int type, int parts) {
    static int least = 0, set = 0;
    if (least == 0) {
        const char *e = getenv("SARATHI_GGUF_ROWS16_MIN");
        const int v = e ? atoi(e) : 0;
        __builtin_cpu_init();
        set = v >= 1 && v <= RL2_TILE;
        least = set ? v : __builtin_cpu_is("amdfam19h") ? RL2_MIN_TOKENS_ZEN4 : RL2_MIN_TOKENS;
    }
    if (!set && type == T_Q6_K) return RL2_MIN_TOKENS_Q6 > least ? RL2_MIN_TOKENS_Q6 : least;
    if (!set && (type == T_Q4_K || type == T_Q5_K) && least < RL2_MIN_TOKENS_KQ(parts))
        return RL2_MIN_TOKENS_KQ(parts);
    return least;
}
static void rl2_rows_any(int type, int nt, int P, const uint8_t *const *rows, int nb, const int8_t *qa, int64_t qs,
                         int64_t lo, const float *da, const float *sa, int64_t fs, const int32_t *ST, const uint8_t *pf,
                         int64_t pfn, float *res) {
    SWITCH_FORMATS(type, RL2_CASE)
}
#undef RL2_CASE
#undef RL2_NT
#endif
#undef RL_NT
#undef RL_CASES_1_7
#undef RL_ARGS

/* gguf_linear_q8 on the row-lane kernel (see rl_rows): calls of 1 .. RL_MAX_TOKENS tokens, in passes
 * of up to Q8_TILE tokens over each octet of rows */
int rl_linear(int type, const uint8_t *w, int64_t row_bytes, const int8_t *qa, int64_t qs, int64_t lo,
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
        int n = r0;
#if defined(GG_TL)
        if (T >= rl2_min(type, parts) && rl2_enabled()) {   /* 16 rows at a time while 16 remain */
            float res2[RL2_TILE * RL2] __attribute__((aligned(64)));
            const int pass = rl2_pass(T);
            for (; r1 - n >= RL2; n += RL2) {
                const uint8_t *rows[RL2];
                for (int r = 0; r < RL2; r++) rows[r] = w + (int64_t)(n + r) * row_bytes;
                const int nn = r1 - (n + RL2) < RL2 ? r1 - (n + RL2) : RL2;   /* the next rows (<= 0: none) */
                for (int t0 = 0; t0 < T; t0 += pass) {
                    const int nt = T - t0 < pass ? T - t0 : pass;
                    rl2_rows_any(type, nt, parts, rows, nb, qa + t0 * qs, qs, lo, da + t0 * fs, sa + t0 * fs, fs,
                                 ST ? ST + t0 * ts : NULL, w + (int64_t)(n + RL2) * row_bytes,
                                 nn > 0 && t0 == 0 ? nn * row_bytes : 0, res2);
                    for (int r = 0; r < RL2; r++) {
                        const float bb = bias ? bias[n + r] : 0.0f;
                        for (int t = 0; t < nt; t++) out[(int64_t)(t0 + t) * os + n + r] = res2[t * RL2 + r] + bb;
                    }
                }
            }
        }
#endif
        for (; n < r1; n += RL) {
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
