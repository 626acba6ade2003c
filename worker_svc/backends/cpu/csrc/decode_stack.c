/* A decode-only step through a whole stack of decoder layers in one native call.
 *
 * The per-layer Python path (worker_svc/model/llama.py DecoderLayer.forward on the CPU backend)
 * makes ten native calls a layer: add + RMSNorm, the QKV linear, rotary, the KV write, decode
 * attention, the O linear, add + RMSNorm, the gate/up linear, silu * up, the down linear. At
 * batch 1 each call's Python side (argument marshalling, tensor allocation, module dispatch)
 * costs about as much as its kernel.
 * cpu_decode_stack makes the same ten calls, to the same exported kernels with the same
 * arguments, in a C loop: its output is bit-identical to the Python path (a test checks it).
 *
 * Applies when every query of the batch is a decode (one token, attention on the paged kernel)
 * and every linear layer runs on GGUF blocks with the integer-dot kernel (gguf_linear_q8); the
 * caller (worker_svc/backends/cpu/stack.py) checks that and falls back otherwise.
 *
 * Per layer l, fields[l * STACK_FIELDS + f] (int64: pointers and codes):
 *   0..3  blocks of qkv, o, gate_up, down (uint8 [N, row_bytes])
 *   4..7  their row bytes          8..11 their ggml types
 *   12    qkv bias fp32 [(Hq + 2 Hkv) D] or 0     13  o bias fp32 [H] or 0
 *   14    input RMSNorm weight fp32 [H]            15  post-attention RMSNorm weight fp32 [H]
 *   16    K cache, 17 V cache ([num_blocks, bs, Hkv, D], kv_dt)
 * Activations are fp32. x [T, H] holds the stack's input hidden state on entry and the last
 * layer's MLP output on return; residual [T, H] receives the residual stream (the layer
 * output hidden state is x + residual, as DecoderLayer.forward returns it).
 * Returns 0; STACK_NOMEM when its buffer cannot be allocated; else the first nonzero code a kernel
 * returned (plus STACK_STEP * the call's index in the layer, and the layer in *failed_layer), so
 * the caller can name the failing kernel.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define STACK_FIELDS 18
#define STACK_NOMEM -1000
#define STACK_STEP 10000   /* rc = kernel code - STACK_STEP * (index of the failing call, 1..10) */

int gguf_linear_q8(int type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t xs,
                   const float *bias, float *out, int64_t os, int T, int N, int K, int num_threads,
                   int parts, int flags);
int cpu_rms_norm(const void *x, int64_t xs, const void *res, int64_t rs, void *res_out, int64_t ros,
                 void *out, int64_t os, const void *w, int T, int H, float eps, int dtype, int nthreads);
int cpu_rotary(void *q, int64_t qs, void *k, int64_t ks, const void *cos, const void *sin,
               int T, int hq, int hkv, int D, int dtype, int nthreads);
int cpu_silu_mul(const void *x, int64_t xs, void *out, int64_t os, int T, int I, int dtype, int nthreads);
int cpu_write_kv(const void *k, int64_t ks, const void *v, int64_t vs, int sdt, void *kc, void *vc,
                 int cdt, const int64_t *slots, int64_t num_slots, int T, int hkv, int D);
int paged_decode_attention_split(const void *q, int q_dt, int64_t q_row_stride, const void *k_cache,
                                 const void *v_cache, int kv_dt, const int32_t *block_tables, int max_blocks,
                                 const int32_t *context_lens, const int32_t *rows, int B, int Hq, int Hkv,
                                 int D, int bs, float scale, void *out, int out_dt, int64_t out_row_stride,
                                 int num_threads, int split_blocks);

int cpu_decode_stack_fields(void) { return STACK_FIELDS; }

#define P(i) ((void *)(intptr_t)f[i])
#define CHECK(step, call)                                                                          \
    do {                                                                                           \
        const int rc_ = (call);                                                                    \
        if (rc_) { rc = rc_ - STACK_STEP * (step); *failed_layer = l; goto done; }                 \
    } while (0)

int cpu_decode_stack(const int64_t *fields, int L, int T, int H, int Hq, int Hkv, int D, int I, float eps,
                     float *x, float *residual, const float *cos, const float *sin,
                     const int64_t *slots, int kv_dt, int64_t num_slots, int bs,
                     const int32_t *tables, int max_blocks, const int32_t *lens, const int32_t *rows,
                     float scale, int parts, int q8_flags, int nthreads, int *failed_layer) {
    if (T <= 0 || L <= 0) return 0;
    const int64_t NQKV = (int64_t)(Hq + 2 * Hkv) * D, NA = (int64_t)Hq * D;
    /* h [T, H], qkv [T, NQKV], attn [T, NA], gate_up [T, 2I], act [T, I] */
    float *buf = malloc(sizeof(float) * (size_t)T * (size_t)(H + NQKV + NA + 3 * (int64_t)I));
    if (!buf) return STACK_NOMEM;
    float *h = buf, *qkv = h + (int64_t)T * H, *attn = qkv + T * NQKV, *gu = attn + T * NA,
          *act = gu + (int64_t)T * 2 * I;
    int rc = 0;
    memcpy(residual, x, sizeof(float) * (size_t)T * (size_t)H);
    for (int l = 0; l < L; l++) {
        const int64_t *f = fields + (int64_t)l * STACK_FIELDS;
        /* the first layer: residual = x, h = norm(x); later: residual += x, h = norm(residual) */
        if (l == 0) CHECK(1, cpu_rms_norm(x, H, NULL, 0, NULL, 0, h, H, P(14), T, H, eps, 0, nthreads));
        else CHECK(1, cpu_rms_norm(x, H, residual, H, residual, H, h, H, P(14), T, H, eps, 0, nthreads));
        CHECK(2, gguf_linear_q8((int)f[8], P(0), f[4], h, H, P(12), qkv, NQKV, T, (int)NQKV, H, nthreads, parts, q8_flags));
        float *k = qkv + NA, *v = k + (int64_t)Hkv * D;
        CHECK(3, cpu_rotary(qkv, NQKV, k, NQKV, cos, sin, T, Hq, Hkv, D, 0, nthreads));
        CHECK(4, cpu_write_kv(k, NQKV, v, NQKV, 0, P(16), P(17), kv_dt, slots, num_slots, T, Hkv, D));
        CHECK(5, paged_decode_attention_split(qkv, 0, NQKV, P(16), P(17), kv_dt, tables, max_blocks, lens, rows,
                                           T, Hq, Hkv, D, bs, scale, attn, 0, NA, nthreads, 0));
        CHECK(6, gguf_linear_q8((int)f[9], P(1), f[5], attn, NA, P(13), x, H, T, H, (int)NA, nthreads, parts, q8_flags));
        CHECK(7, cpu_rms_norm(x, H, residual, H, residual, H, h, H, P(15), T, H, eps, 0, nthreads));
        CHECK(8, gguf_linear_q8((int)f[10], P(2), f[6], h, H, NULL, gu, 2 * (int64_t)I, T, 2 * I, H, nthreads, parts, q8_flags));
        CHECK(9, cpu_silu_mul(gu, 2 * (int64_t)I, act, I, T, I, 0, nthreads));
        CHECK(10, gguf_linear_q8((int)f[11], P(3), f[7], act, I, NULL, x, H, T, H, I, nthreads, parts, q8_flags));
    }
done:
    free(buf);
    return rc;
}
