/* The entry points the layer stack's loop (layer_stack.c) calls, declared once: each
 * defining file includes this too, so a signature changed on one side fails the build
 * rather than the call. */
#ifndef KVFLOW_ENTRIES_H
#define KVFLOW_ENTRIES_H
#include <stdint.h>

/* layer_ops.c */
void kvflow_rms_norm(float *x, const void *delta, const float *w, void *out, int T, int R, int C,
                     float eps, int delta_bf16, int out_bf16);
void kvflow_rope_store(const void *qkv, float *out, const float *cos, const float *sin,
                       const int64_t *slots, void *k_cache, void *v_cache, int T, int H, int KVH,
                       int D, int BS, int in_bf16, int cache_bf16, int k_i8, int v_i8,
                       int kv_out, int k_pairs);
void kvflow_silu_mul(const void *gate_up, void *out, int T, int R, int I, int in_bf16,
                     int out_bf16);
/* small_matmul.c */
int kvflow_matmul_rows_bf16(const uint16_t *x, const uint16_t *wp, uint16_t *out, int M, int R,
                            int N, int K);
/* int16_matmul.c */
int kvflow_linear_i16(const float *x, int16_t *xq, float *xs, const int16_t *wq,
                      const float *ws, const float *bias, float *out, int M, int N, int K);
/* paged_decode.c: one entry point a pair of cache kinds, all of this type */
typedef int decode_entry(const float *q, const void *k_cache, const void *v_cache,
                         const int32_t *block_tables, const int32_t *context_lens, void *out,
                         int out_bf16, int n, int H, int KVH, int D, int BS, int max_blocks,
                         float scale, int window);
decode_entry kvflow_paged_decode_f32, kvflow_paged_decode_bf16, kvflow_paged_decode_i8,
    kvflow_paged_decode_bf16_i8, kvflow_paged_decode_bf16p, kvflow_paged_decode_bf16p_i8;
#endif
