/* A step's decoder layers as one C call (worker.model.layer_stack).
 *
 * The same kernels, in the same order, with the same arguments as LayerStack's Python
 * loop makes them (so the same bits): per layer, the norm (adding the last layer's MLP
 * output into x), the qkv projection, rotary and K/V store, attention read in place, the
 * output projection, the residual add and norm, gate and up, SiLU and multiply, down. The
 * loop saves the ~270 ctypes calls of the default model's 30 layers (1.4-3 us each, and
 * the Python around them) where every linear layer is a C kernel's: the row kernel
 * (bfloat16) or the int16 products (float32 activations). Layers through torch's matmuls
 * stay with the Python loop.
 *
 * Buffers as layer_stack.py's docstring lays them out, T rows each (no padding rows: only
 * torch's matmuls pad). The last layer's MLP output is left in m: the caller adds it to x.
 */
#include <stddef.h>
#include <stdint.h>

#include "entries.h"

enum { LINEAR_ROWS = 0, LINEAR_I16 = 1 };
enum { QKV = 0, O = 1, GATE_UP = 2, DOWN = 3, ATTENTION = 4 }; /* ops that can fail */

/* A layer's weights and caches by address: mirrored by layer_stack._CLayer */
typedef struct {
    const float *norm1, *norm2;
    float eps, scale;
    void *k_cache, *v_cache;
    int kind[4];        /* qkv, o, gate and up, down: LINEAR_ROWS or LINEAR_I16 */
    const void *w[4];   /* the row kernel's bfloat16 copy, or the int16 values */
    const float *ws[4]; /* int16: the weight's scales */
    const float *bias[4];
} kvflow_stack_layer;

/* The stack, built once: mirrored by layer_stack._CStack. failed_layer and failed_op say
 * where a kernel refused. */
typedef struct {
    const kvflow_stack_layer *layers;
    decode_entry *decode;
    int L, C, H, KVH, D, inter, BS;
    int act_bf16, cache_bf16, k_i8, v_i8, k_pairs;
    void *h, *qkv, *o, *a, *gu, *act, *m;
    float *q;
    char *scratch; /* the int16 products' rounded inputs, then their scales at xq_bytes */
    size_t xq_bytes;
    int failed_layer, failed_op;
} kvflow_stack;

static int failed(kvflow_stack *s, int layer, int op, int status) {
    s->failed_layer = layer;
    s->failed_op = op;
    return status;
}

static int linear(const kvflow_stack *s, const kvflow_stack_layer *l, int i, const void *x,
                  void *out, int T, int N, int K) {
    if (l->kind[i] == LINEAR_I16)
        return kvflow_linear_i16(x, (int16_t *)s->scratch, (float *)(s->scratch + s->xq_bytes),
                                 l->w[i], l->ws[i], l->bias[i], out, T, N, K);
    return kvflow_matmul_rows_bf16(x, l->w[i], out, T, T, N, K);
}

/* x [T, C] float32 through every layer, in place, but for the last MLP output (in m).
 * cos, sin [T, D / 2]; slots [T]; tables [T, max_blocks]; lens [T]. 0, or the refusing
 * kernel's status (where: failed_layer, failed_op). */
int kvflow_layer_stack(kvflow_stack *s, float *x, const float *cos, const float *sin,
                       const int64_t *slots, const int32_t *tables, const int32_t *lens, int T,
                       int max_blocks, int window) {
    const int C = s->C, H = s->H, KVH = s->KVH, D = s->D, act = s->act_bf16;
    const void *pending = NULL; /* the MLP output the next norm adds to x */
    for (int i = 0; i < s->L; i++) {
        const kvflow_stack_layer *l = &s->layers[i];
        int status;
        kvflow_rms_norm(x, pending, l->norm1, s->h, T, T, C, l->eps, pending ? act : 0, act);
        if ((status = linear(s, l, QKV, s->h, s->qkv, T, (H + 2 * KVH) * D, C)))
            return failed(s, i, QKV, status);
        kvflow_rope_store(s->qkv, s->q, cos, sin, slots, l->k_cache, l->v_cache, T, H, KVH, D,
                          s->BS, act, s->cache_bf16, s->k_i8, s->v_i8, 0, s->k_pairs);
        if ((status = s->decode(s->q, l->k_cache, l->v_cache, tables, lens, s->o, act, T, H, KVH,
                                D, s->BS, max_blocks, l->scale, window)))
            return failed(s, i, ATTENTION, status);
        if ((status = linear(s, l, O, s->o, s->a, T, C, H * D))) return failed(s, i, O, status);
        kvflow_rms_norm(x, s->a, l->norm2, s->h, T, T, C, l->eps, act, act);
        if ((status = linear(s, l, GATE_UP, s->h, s->gu, T, 2 * s->inter, C)))
            return failed(s, i, GATE_UP, status);
        kvflow_silu_mul(s->gu, s->act, T, T, s->inter, act, act);
        if ((status = linear(s, l, DOWN, s->act, s->m, T, C, s->inter)))
            return failed(s, i, DOWN, status);
        pending = s->m;
    }
    return 0;
}

/* The two structs' sizes, which layer_stack.py's ctypes mirrors must match. */
void kvflow_layer_stack_sizes(size_t *out) {
    out[0] = sizeof(kvflow_stack_layer);
    out[1] = sizeof(kvflow_stack);
}
