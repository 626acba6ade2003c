/* Paged decode attention on the CPU: one query token per sequence, K/V read in place.
 *
 * Layout (see worker_svc/kv_cache.py): k_cache, v_cache are [num_blocks, block_size, Hkv, D],
 * contiguous; token p of sequence b lives at block block_tables[b][p / block_size], row
 * p % block_size. q and out are rows of [*, Hq, D] (heads and dims contiguous, row stride
 * given); sequence b reads/writes row rows[b] (or b when rows is NULL). Query head h uses kv
 * head h / G with G = Hq / Hkv (GQA).
 *
 * A work unit is one sequence's kv heads (all of them: each block's K and V are then two
 * contiguous runs) over a run of its context: the unit's query rows stream over it in tiles of
 * at most 16 tokens inside one block, with an online softmax (running max m, running sum l,
 * accumulator acc rescaled when m grows). So every K/V byte is read exactly once, and all
 * arithmetic is fp32 whatever the storage dtype. A sequence is one run, unless there are fewer
 * than UNITS_PER_THREAD units per thread: then long contexts are split (flash-decoding) and a
 * second pass merges the runs' (m, l, acc).
 *
 * Three code paths, chosen at compile time by the -march=native macros (paged_decode_isa()
 * names the one built): AVX-512 (16 floats per vector), AVX2+FMA (8 per vector) and a portable
 * scalar path (correct, much slower). The two SIMD paths share one body written with vector
 * macros (vf, vload2, vfmadd, ...). In it: bf16 K/V widen as even/odd lanes (q and acc are
 * stored in that order, perm_pos); q.k partial sums of W tokens are reduced together (hsum8 /
 * hsum16 trees); P.V runs token-outer with a register block of accumulators; later tiles' K/V
 * rows are prefetched into L2 a row per token (PD_PF). The kernel is bound by reading K/V: its
 * target is the time of a plain read of the same randomly placed blocks (measurements:
 * bench/results/kernels/README.md).
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
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "attention_simd.h"

#define MAX_D 256
#define MAX_ROWS 64   /* query heads per work unit: stack arrays of MAX_ROWS * MAX_D floats */
#define TILE 16   /* tokens per softmax update: one AVX-512 vector (two AVX2 vectors) of scores */
#ifndef MIN_BYTES_PER_THREAD
/* K+V bytes per thread: a few tens of microseconds of one core's reading, small enough that a
 * single sequence's layer of a 1k context splits over two threads */
#define MIN_BYTES_PER_THREAD (256 << 10)
#endif
#define UNITS_PER_THREAD 4      /* fewer work units than this per thread: split contexts */
#define MIN_SPLIT_TOKENS 256    /* shortest split: its merge costs little next to reading it */
#ifndef PD_NH
#define PD_NH 0                 /* kv heads per work unit; 0: all */
#endif

/* P.V register block: PV_ROWS rows x 2 PV_PAIRS vectors of accumulators */
#if defined(__AVX512F__)
#define PV_ROWS 4
#define PV_PAIRS 2
#elif SIMD_W == 8
/* 3 rows x 2 vectors = 6 accumulators + v pair + 3 broadcasts: 11 of the 16 ymm. With 2 pairs
 * (12 accumulators, 17 registers) GCC spilled an accumulator every token and the store-to-load
 * round trip sat on its chain; one pair a pass re-reads the tile's V rows from L1 instead, and is
 * the faster (measured: bench/results/kernels/README.md, "Attention kernel"). */
#define PV_ROWS 3
#define PV_PAIRS 1
#endif
#define QK_ROWS 4    /* query rows sharing one widened K chunk in the score loop */

/* vload2(p, dt, i): elements i .. i + 2W - 1 as two vectors. fp32 / fp16: lo = the first W, hi =
 * the next W. bf16: lo = the even elements, hi = the odd ones: one load, a shift and an and
 * widen 2W values (zero-extending each half costs twice that). q and the accumulators are
 * stored in the same order (perm_pos), so dot products and P.V need no shuffles; the output is
 * put back in natural order at the end.
 *
 * SIMD layout of a row of D floats (D % W == 0): NP = D / 2W pairs, then one tail vector when
 * D / W is odd (natural order). D % W != 0 runs the scalar loops, natural order. */
static inline int perm_pos(int d, int D, int dt) {
#if defined(SIMD_W)
    const int np = D % SIMD_W == 0 ? D / (2 * SIMD_W) : 0;
    if (dt == DT_BF16 && d < np * 2 * SIMD_W) {
        const int e = d % (2 * SIMD_W);
        return d - e + (e & 1 ? SIMD_W : 0) + e / 2;
    }
#else
    (void)D; (void)dt;
#endif
    return d;
}

/* Software prefetch into L2 (T1), PD_PF tiles ahead, one token row per score-loop token rather
 * than a burst per tile: the block tables scatter K/V, so the hardware prefetchers cannot run
 * ahead. Not into L1 (T0): a burst of L1 prefetches fills the miss buffers that the loads of the
 * math need. */
#ifndef PD_PF
#define PD_PF 2      /* prefetch distance in tiles, >= 1 */
#endif
#ifndef PD_PF_HINT
#define PD_PF_HINT _MM_HINT_T1
#endif

/* K/V rows of tokens [p, p + n) for kv heads [h0, h0 + nh) into the caches, ahead of use: the
 * block tables jump around memory, so the hardware prefetchers cannot run ahead across blocks. */
static inline __attribute__((always_inline)) void
prefetch_tokens(const void *kc, const void *vc, int esz, const int32_t *table, int p, int n, int bs,
                int64_t tok_stride, int64_t head_off, int nh, int D) {
#if defined(SIMD_W)
    for (int t = p; t < p + n; t++) {
        const int64_t e = ((int64_t)table[t / bs] * bs + t % bs) * tok_stride + head_off;
        const char *kp = (const char *)kc + e * esz, *vp = (const char *)vc + e * esz;
        for (int b = 0; b < nh * D * esz; b += 64) {
            _mm_prefetch(kp + b, PD_PF_HINT);
            _mm_prefetch(vp + b, PD_PF_HINT);
        }
    }
#else
    (void)kc; (void)vc; (void)esz; (void)table; (void)p; (void)n; (void)bs; (void)tok_stride;
    (void)head_off; (void)nh; (void)D;
#endif
}

#if defined(SIMD_W)
/* s[g][j] = q_g . k_j for gn (<= QK_ROWS) query rows q (row stride D, perm_pos order) and the
 * n tokens of a tile at element k0 (token stride tok_stride). Each widened K chunk feeds all gn
 * rows; the W per-token partial-sum vectors of a row are reduced together by vhsum. Tile lanes
 * j >= n get 0. */
static inline __attribute__((always_inline)) void
scores(const float *q, const void *kc, const int dt, int64_t k0, int64_t tok_stride, int n,
       const int gn, const int D, float (*s)[TILE], const char *pk, const char *pv, int pn, int pbytes) {
    const int NP = D / (2 * SIMD_W), NT = (D / SIMD_W) % 2;
    const int64_t pstride = tok_stride * (dt == DT_F32 ? 4 : 2);
    for (int j0 = 0; j0 < n; j0 += SIMD_W) {
        vf part[QK_ROWS][SIMD_W];
        for (int jj = 0; jj < SIMD_W; jj++) {
            const int64_t kj = k0 + (int64_t)(j0 + jj) * tok_stride;
            if (j0 + jj < pn)   /* a later tile's K/V rows, spread over this tile's work */
                for (int b = 0; b < pbytes; b += 64) {
                    _mm_prefetch(pk + (j0 + jj) * pstride + b, PD_PF_HINT);
                    _mm_prefetch(pv + (j0 + jj) * pstride + b, PD_PF_HINT);
                }
            vf a[QK_ROWS], b[QK_ROWS];   /* two chains per row: half the FMA latency per token */
            for (int g = 0; g < gn; g++) a[g] = b[g] = vzero();
            if (j0 + jj < n) {
                for (int c = 0; c < NP; c++) {
                    vf lo, hi;
                    vload2(kc, dt, kj + 2 * SIMD_W * c, &lo, &hi);
                    for (int g = 0; g < gn; g++) {
                        a[g] = vfmadd(vload(q + g * D + 2 * SIMD_W * c), lo, a[g]);
                        b[g] = vfmadd(vload(q + g * D + 2 * SIMD_W * c + SIMD_W), hi, b[g]);
                    }
                }
                if (NT) {
                    const vf k = vload1(kc, dt, kj + 2 * SIMD_W * NP);
                    for (int g = 0; g < gn; g++) a[g] = vfmadd(vload(q + g * D + 2 * SIMD_W * NP), k, a[g]);
                }
            }
            for (int g = 0; g < gn; g++) part[g][jj] = vadd(a[g], b[g]);
        }
        for (int g = 0; g < gn; g++) vstore(s[g] + j0, vhsum(part[g]));
    }
}

/* acc_g += sum_j p[g][j] v_j for gn (<= PV_ROWS) rows (acc row stride D, perm_pos order) over the
 * n tokens of a tile at element v0. Loops run token-outer with PV_ROWS x 2 PV_PAIRS accumulators
 * in registers: each weight is broadcast once per token per pass, and the FMA chains are
 * independent enough to keep both FMA pipes busy. */
static inline __attribute__((always_inline)) void
pv(float *acc, const void *vc, const int dt, int64_t v0, int64_t tok_stride, int n,
   const int gn, const int D, float (*p)[TILE]) {
    const int NP = D / (2 * SIMD_W), NT = (D / SIMD_W) % 2;
    for (int c0 = 0; c0 < NP; c0 += PV_PAIRS) {
        vf a[PV_ROWS][2 * PV_PAIRS];
        for (int g = 0; g < gn; g++)
            for (int c = 0; c < 2 * PV_PAIRS; c++)
                if (c0 + c / 2 < NP) a[g][c] = vload(acc + g * D + 2 * SIMD_W * c0 + SIMD_W * c);
        for (int j = 0; j < n; j++) {
            const int64_t vj = v0 + (int64_t)j * tok_stride;
            vf w[PV_ROWS];
            for (int g = 0; g < gn; g++) w[g] = vset1(p[g][j]);
            for (int c = 0; c < PV_PAIRS; c++) {
                if (c0 + c >= NP) break;
                vf lo, hi;
                vload2(vc, dt, vj + 2 * SIMD_W * (c0 + c), &lo, &hi);
                for (int g = 0; g < gn; g++) {
                    a[g][2 * c] = vfmadd(w[g], lo, a[g][2 * c]);
                    a[g][2 * c + 1] = vfmadd(w[g], hi, a[g][2 * c + 1]);
                }
            }
        }
        for (int g = 0; g < gn; g++)
            for (int c = 0; c < 2 * PV_PAIRS; c++)
                if (c0 + c / 2 < NP) vstore(acc + g * D + 2 * SIMD_W * c0 + SIMD_W * c, a[g][c]);
    }
    if (NT) {
        const int t = 2 * SIMD_W * NP;
        vf a[PV_ROWS];
        for (int g = 0; g < gn; g++) a[g] = vload(acc + g * D + t);
        for (int j = 0; j < n; j++) {
            const vf v = vload1(vc, dt, v0 + (int64_t)j * tok_stride + t);
            for (int g = 0; g < gn; g++) a[g] = vfmadd(vset1(p[g][j]), v, a[g]);
        }
        for (int g = 0; g < gn; g++) vstore(acc + g * D + t, a[g]);
    }
}
#endif

/* One work unit: tokens [p0, p1) of one sequence, kv heads [h0, h0 + nh) (head_off = h0 * D).
 * Its R = nh * G query rows (row r uses kv head h0 + r / G) stream over those tokens together in
 * tiles of at most TILE tokens inside one block, with an online softmax. On return m[r] is the
 * max score, l[r] the sum of exp(score - m[r]) and acc[r] the matching unnormalised sum of
 * weighted V rows (perm_pos order); an empty range leaves m = -inf, l = 0, acc = 0.
 * qs: fp32 [R][D], scaled, perm_pos order. dt and D are compile-time constants at the hot call
 * sites, so the inner loops unroll. */
static inline __attribute__((always_inline)) void
unit(const float *qs, const void *kc, const void *vc, const int dt, const int32_t *table, int p0,
     int p1, int bs, int64_t tok_stride, int64_t head_off, int nh, int G, const int D, float *acc,
     float *m, float *l) {
    const int R = nh * G;
    float s[MAX_ROWS][TILE] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    memset(acc, 0, sizeof(float) * R * D);
#if defined(SIMD_W)
    const int simd = D % SIMD_W == 0;
    const int esz = dt == DT_F32 ? 4 : 2;   /* bf16, fp16: 2 bytes */
    /* the first PD_PF tiles; then each tile asks for the one PD_PF tiles ahead */
    prefetch_tokens(kc, vc, esz, table, p0, (p1 - p0 < PD_PF * TILE ? p1 - p0 : PD_PF * TILE), bs,
                    tok_stride, head_off, nh, D);
#endif

    for (int pos = p0; pos < p1;) {
        const int off = pos % bs;
        int n = bs - off;
        if (n > TILE) n = TILE;
        if (n > p1 - pos) n = p1 - pos;
        /* element index of token (block, off) at kv head h0 */
        const int64_t base = ((int64_t)table[pos / bs] * bs + off) * tok_stride + head_off;
#if defined(SIMD_W)
        /* the tile PD_PF tiles ahead (clipped to its block and the range), prefetched a token
         * row at a time inside the score loop */
        const int pfp = pos + PD_PF * TILE;
        int pn = 0;
        int64_t pfb = 0;
        if (pfp < p1) {
            pn = bs - pfp % bs;
            if (pn > TILE) pn = TILE;
            if (pn > p1 - pfp) pn = p1 - pfp;
            pfb = (((int64_t)table[pfp / bs] * bs + pfp % bs) * tok_stride + head_off) * esz;
        }
#endif

        /* scores s[r][j] = q_r . k_j (q already carries the softmax scale) */
        for (int hh = 0; hh < nh; hh++) {
            const int64_t k0 = base + (int64_t)hh * D;
#if defined(SIMD_W)
            if (simd) {
                /* K and V rows of head hh in the tile ahead; the first row group issues them */
#define PFARGS (const char *)kc + pfb + hh * D * esz, (const char *)vc + pfb + hh * D * esz, g0 ? 0 : pn, D * esz
                for (int g0 = 0; g0 < G; g0 += QK_ROWS) {
                    const float *qh = qs + (int64_t)(hh * G + g0) * D;
                    float (*sh)[TILE] = s + hh * G + g0;
                    switch (G - g0 < QK_ROWS ? G - g0 : QK_ROWS) {   /* constant row counts */
                    case 1: scores(qh, kc, dt, k0, tok_stride, n, 1, D, sh, PFARGS); break;
                    case 2: scores(qh, kc, dt, k0, tok_stride, n, 2, D, sh, PFARGS); break;
                    case 3: scores(qh, kc, dt, k0, tok_stride, n, 3, D, sh, PFARGS); break;
                    default: scores(qh, kc, dt, k0, tok_stride, n, 4, D, sh, PFARGS); break;
                    }
                }
#undef PFARGS
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
#if defined(SIMD_W)
            vf sv[TILE / SIMD_W];
            vmask mk[TILE / SIMD_W];
            vf vm = vset1(-INFINITY);
            for (int i = 0; i < TILE / SIMD_W; i++) {   /* lanes >= n: out of the max, 0 after exp */
                mk[i] = vlanes_lt(n - i * SIMD_W);
                sv[i] = vsel(mk[i], vload(s[r] + i * SIMD_W), vset1(-INFINITY));
                vm = vmax(vm, sv[i]);
            }
            const float tmax = vreduce_max(vm);
            mx = tmax > mx ? tmax : mx;
            /* the rescale factor, 0 on the first tile (m = -inf) and 1 while the max holds: expf(-inf)
             * and expf(0) are exactly 0 and 1, so the libm call (a row's scalar step every tile)
             * runs only where the max moved by a finite step; the same bits */
            const float alpha = mx == m[r] ? 1.0f : m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);
            vf vs = vzero();
            for (int i = 0; i < TILE / SIMD_W; i++) {
                const vf p = vsel(mk[i], vexp(vsub(sv[i], vset1(mx))), vzero());
                vstore(s[r] + i * SIMD_W, p);
                vs = vadd(vs, p);
            }
            sum = vreduce_add(vs);
            if (alpha != 1.0f) {
                if (simd)
                    for (int d = 0; d < D; d += SIMD_W)
                        vstore(acc + r * D + d, vmul(vload(acc + r * D + d), vset1(alpha)));
                else
                    for (int d = 0; d < D; d++) acc[r * D + d] *= alpha;
            }
#else
            for (int j = 0; j < n; j++) mx = s[r][j] > mx ? s[r][j] : mx;
            const float alpha = expf(m[r] - mx);
            for (int j = 0; j < n; j++) { s[r][j] = expf(s[r][j] - mx); sum += s[r][j]; }
            if (alpha != 1.0f)
                for (int d = 0; d < D; d++) acc[r * D + d] *= alpha;
#endif
            l[r] = l[r] * alpha + sum;
            m[r] = mx;
        }

        /* acc_r += sum_j p_j v_j */
        for (int hh = 0; hh < nh; hh++) {
            const int64_t v0 = base + (int64_t)hh * D;
#if defined(SIMD_W)
            if (simd) {
                for (int g0 = 0; g0 < G; g0 += PV_ROWS) {
                    const int r0 = hh * G + g0;
                    float *ah = acc + (int64_t)r0 * D;
                    switch (G - g0 < PV_ROWS ? G - g0 : PV_ROWS) {
                    case 1: pv(ah, vc, dt, v0, tok_stride, n, 1, D, s + r0); break;
                    case 2: pv(ah, vc, dt, v0, tok_stride, n, 2, D, s + r0); break;
#if PV_ROWS == 4
                    case 3: pv(ah, vc, dt, v0, tok_stride, n, 3, D, s + r0); break;
#endif
                    default: pv(ah, vc, dt, v0, tok_stride, n, PV_ROWS, D, s + r0); break;
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
}

/* Other head sizes: one out-of-line copy with runtime dtype and D (fewer copies, faster build). */
static __attribute__((noinline)) void
unit_any(const float *qs, const void *kc, const void *vc, int dt, const int32_t *table, int p0, int p1,
         int bs, int64_t tok_stride, int64_t head_off, int nh, int G, int D, float *acc, float *m, float *l) {
    unit(qs, kc, vc, dt, table, p0, p1, bs, tok_stride, head_off, nh, G, D, acc, m, l);
}

/* Writes out row o0 (R rows of D): acc (perm_pos order) / l, in out_dt; l = 0 (no tokens) gives 0. */
static void finish(const float *acc, const float *l, int R, int D, int kv_dt, void *out, int out_dt, int64_t o0) {
    for (int r = 0; r < R; r++) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int d = 0; d < D; d++) {
            const float x = acc[r * D + perm_pos(d, D, kv_dt)] * inv;
            if (out_dt == DT_F32) ((float *)out)[o0 + r * D + d] = x;
            else ((uint16_t *)out)[o0 + r * D + d] = f32_to_bf16(x);
        }
    }
}

typedef struct {
    int b, h0;     /* sequence, first kv head */
    int p0, p1;    /* token range */
    int slot;      /* -1: the whole sequence, write out; else its partial result's scratch slot */
} work_t;

typedef struct { int b, h0, slot0, n; } merge_t;   /* n partial results in slots slot0 .. */

/* Returns 0, or -1 when the shape is outside what this kernel supports (nothing written), -2 when
 * out of memory. split_blocks > 0 forces context splits of that many blocks (tests); 0 picks
 * them (see below). */
int paged_decode_attention_split(
    const void *q, int q_dt, int64_t q_row_stride,      /* [*, Hq, D], row stride in elements */
    const void *k_cache, const void *v_cache, int kv_dt, /* [num_blocks, bs, Hkv, D] */
    const int32_t *block_tables, int max_blocks,         /* [B, max_blocks] */
    const int32_t *context_lens,                         /* [B] */
    const int32_t *rows,                                 /* [B] batch row per sequence, or NULL */
    int B, int Hq, int Hkv, int D, int bs, float scale,
    void *out, int out_dt, int64_t out_row_stride, int num_threads, int split_blocks) {
    if (D < 1 || D > MAX_D || Hkv < 1 || Hq % Hkv != 0 || Hq / Hkv > MAX_ROWS || bs < 1) return -1;
    if (kv_dt < DT_F32 || kv_dt > DT_F16 || q_dt < DT_F32 || q_dt > DT_BF16 || out_dt < DT_F32 || out_dt > DT_BF16)
        return -1;
    const int G = Hq / Hkv;
    const int64_t tok_stride = (int64_t)Hkv * D;
    if (num_threads < 1) num_threads = 1;
    /* kv heads per unit: all of them (nh = Hkv, PD_NH = 0), so a unit reads each block's K and V
     * as two contiguous runs, or PD_NH (a compile-time knob for measurements) */
    int nh = PD_NH > 0 ? PD_NH : Hkv;
    if (nh > Hkv) nh = Hkv;
    while (nh > 1 && (Hkv % nh != 0 || nh * G > MAX_ROWS)) nh--;
    const int per_seq = Hkv / nh, R = nh * G;
    /* one more thread per MIN_BYTES_PER_THREAD of K/V: a fork/join costs microseconds, and on a
     * loaded machine a descheduled helper thread stalls the join for a whole timeslice (ms) */
    int64_t kv_bytes = 0, total_blocks = 0;
    for (int b = 0; b < B; b++) {
        kv_bytes += context_lens[b];
        total_blocks += (context_lens[b] + bs - 1) / bs;
    }
    kv_bytes *= 2 * tok_stride * (kv_dt == DT_F32 ? 4 : 2);
    if (num_threads > 1 + kv_bytes / MIN_BYTES_PER_THREAD)
        num_threads = (int)(1 + kv_bytes / MIN_BYTES_PER_THREAD);

    /* Context splits (flash-decoding): with fewer than UNITS_PER_THREAD units per thread, long
     * contexts are cut into runs of `chunk` blocks (at least MIN_SPLIT_TOKENS) so every thread
     * gets work; each run leaves (m, l, acc) and a second pass merges a sequence's runs. One
     * thread never splits. */
    int64_t chunk = INT32_MAX;
    if (split_blocks > 0) chunk = split_blocks;
    else if (num_threads > 1 && (int64_t)B * per_seq < (int64_t)UNITS_PER_THREAD * num_threads) {
        const int64_t want = (int64_t)UNITS_PER_THREAD * num_threads;
        chunk = (total_blocks * per_seq + want - 1) / want;
        if (chunk < (MIN_SPLIT_TOKENS + bs - 1) / bs) chunk = (MIN_SPLIT_TOKENS + bs - 1) / bs;
    }
    int64_t nunits = 0, nslots = 0, nmerge = 0;
    for (int b = 0; b < B; b++) {
        const int64_t nb = (context_lens[b] + bs - 1) / bs, S = nb > chunk ? (nb + chunk - 1) / chunk : 1;
        nunits += S * per_seq;
        if (S > 1) { nslots += S * per_seq; nmerge += per_seq; }
    }
    work_t *work = malloc(sizeof(work_t) * nunits);
    merge_t *merges = nmerge ? malloc(sizeof(merge_t) * nmerge) : NULL;
    float *scratch = nslots ? malloc(sizeof(float) * nslots * R * (D + 2)) : NULL;
    if (!work || (nmerge && (!merges || !scratch))) {
        free(work); free(merges); free(scratch);
        return -2;
    }
    {
        int64_t u = 0, slot = 0, mi = 0;
        for (int b = 0; b < B; b++) {
            const int len = context_lens[b];
            const int64_t nb = (len + bs - 1) / bs, S = nb > chunk ? (nb + chunk - 1) / chunk : 1;
            for (int hg = 0; hg < per_seq; hg++) {
                if (S > 1) merges[mi++] = (merge_t){b, hg * nh, (int)slot, (int)S};
                for (int64_t s = 0; s < S; s++) {
                    const int64_t p0 = s * chunk * bs, p1 = (s + 1) * chunk * bs;
                    work[u++] = (work_t){b, hg * nh, S > 1 ? (int)p0 : 0, S > 1 && p1 < len ? (int)p1 : len,
                                         S > 1 ? (int)slot++ : -1};
                }
            }
        }
    }

#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && nunits > 1)
    {
        float qs[MAX_ROWS * MAX_D] __attribute__((aligned(64)));
        float acc[MAX_ROWS * MAX_D] __attribute__((aligned(64)));
        float m[MAX_ROWS], l[MAX_ROWS];
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < nunits; u++) {
            const work_t w = work[u];
            const int64_t row = rows ? rows[w.b] : w.b;
            const int64_t q0 = row * q_row_stride + (int64_t)w.h0 * G * D;
            for (int r = 0; r < R; r++)
                for (int d = 0; d < D; d++)
                    qs[r * D + perm_pos(d, D, kv_dt)] = load_elem(q, q_dt, q0 + r * D + d) * scale;
            const int32_t *table = block_tables + (int64_t)w.b * max_blocks;
            const int64_t head_off = (int64_t)w.h0 * D;
            /* constant dtype and D at the common call sites (head_dim 64, 128): fully unrolled loops */
#define UNIT(DT, DD) unit(qs, k_cache, v_cache, DT, table, w.p0, w.p1, bs, tok_stride, head_off, nh, G, DD, acc, m, l)
            if (D == 64 && kv_dt == DT_F32) UNIT(DT_F32, 64);
            else if (D == 64 && kv_dt == DT_BF16) UNIT(DT_BF16, 64);
            else if (D == 64) UNIT(DT_F16, 64);
            else if (D == 128 && kv_dt == DT_F32) UNIT(DT_F32, 128);
            else if (D == 128 && kv_dt == DT_BF16) UNIT(DT_BF16, 128);
            else if (D == 128) UNIT(DT_F16, 128);
            else unit_any(qs, k_cache, v_cache, kv_dt, table, w.p0, w.p1, bs, tok_stride, head_off, nh, G, D, acc, m, l);
#undef UNIT
            if (w.slot < 0) {
                finish(acc, l, R, D, kv_dt, out, out_dt, row * out_row_stride + (int64_t)w.h0 * G * D);
            } else {
                float *sp = scratch + (int64_t)w.slot * R * (D + 2);
                memcpy(sp, m, sizeof(float) * R);
                memcpy(sp + R, l, sizeof(float) * R);
                memcpy(sp + 2 * R, acc, sizeof(float) * R * D);
            }
        }
        /* (implicit barrier) merge the runs: m = max m_s, l = sum l_s e^(m_s - m), acc likewise */
        if (nmerge) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < nmerge; i++) {
                const merge_t mg = merges[i];
                memset(acc, 0, sizeof(float) * R * D);
                for (int r = 0; r < R; r++) {
                    float mx = -INFINITY, sum = 0.0f;
                    for (int s = 0; s < mg.n; s++) {
                        const float ms = scratch[(int64_t)(mg.slot0 + s) * R * (D + 2) + r];
                        mx = ms > mx ? ms : mx;
                    }
                    for (int s = 0; s < mg.n; s++) {
                        const float *sp = scratch + (int64_t)(mg.slot0 + s) * R * (D + 2);
                        if (sp[r] == -INFINITY) continue;   /* an empty run (and mx = -inf: all empty) */
                        const float e = expf(sp[r] - mx);
                        sum += e * sp[R + r];
                        for (int d = 0; d < D; d++) acc[r * D + d] += e * sp[2 * R + r * D + d];
                    }
                    l[r] = sum;
                }
                const int64_t row = rows ? rows[mg.b] : mg.b;
                finish(acc, l, R, D, kv_dt, out, out_dt, row * out_row_stride + (int64_t)mg.h0 * G * D);
            }
        }
    }
    free(work); free(merges); free(scratch);
    return 0;
}

/* paged_decode_attention_split with the automatic splits. */
int paged_decode_attention(
    const void *q, int q_dt, int64_t q_row_stride, const void *k_cache, const void *v_cache, int kv_dt,
    const int32_t *block_tables, int max_blocks, const int32_t *context_lens, const int32_t *rows,
    int B, int Hq, int Hkv, int D, int bs, float scale, void *out, int out_dt, int64_t out_row_stride,
    int num_threads) {
    return paged_decode_attention_split(q, q_dt, q_row_stride, k_cache, v_cache, kv_dt, block_tables,
                                        max_blocks, context_lens, rows, B, Hq, Hkv, D, bs, scale, out,
                                        out_dt, out_row_stride, num_threads, 0);
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
