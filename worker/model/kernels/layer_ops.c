/* The small per-token ops of a decoder layer, each one pass over its rows (CPU).
 *
 * In torch each of these is a chain of elementwise ops (RMSNorm: 7, rotary on q and k
 * plus the store of K/V into the cache by advanced indexing: ~20), each with its own
 * dispatch and a pass over the data; at decode batch sizes the data is a few hundred KB,
 * so the chain costs its dispatches, not its arithmetic. Here each is one call.
 *
 *   kvflow_rms_norm          out[t] = w * x[t] / sqrt(mean(x[t]^2) + eps)
 *   kvflow_add_rms_norm      x[t] += delta[t], then out[t] as above (vLLM's fused_add_rms_norm)
 *   kvflow_silu_mul          out[t] = silu(gate[t]) * up[t], gate and up the halves of a row
 *   kvflow_rope_store_f32    rotary ('rotate half' layout) on the q and k of each token in
 *   kvflow_rope_store_bf16   place, then the token's k and v into its cache slot; the cache
 *                            float32 or bfloat16 (rounded to nearest even, as torch rounds)
 *
 * Shapes (contiguous, float32 unless said):
 *   x, out, delta    [T, C]          w [C]
 *   gate_up          [T, 2 I]        (out [T, I])
 *   qkv              [T, (H + 2 KVH) D]: q heads, then k heads, then v heads
 *   cos, sin         [T, D / 2]      (the token's position's angles)
 *   slots            [T] int64       (block * BS + offset)
 *   k_cache, v_cache [NB, KVH, BS, D]
 *
 * Threads: OpenMP over tokens where there are enough of them to pay for waking the pool.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_ROWS 256 /* fewer tokens than this run on the calling thread */

static inline void norm_row(const float *restrict x, const float *restrict w,
                            float *restrict out, int C, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int c = 0; c < C; c++) ss += x[c] * x[c];
    const float r = 1.0f / sqrtf(ss / (float)C + eps);
#pragma omp simd
    for (int c = 0; c < C; c++) out[c] = w[c] * (x[c] * r);
}

void kvflow_rms_norm(const float *x, const float *w, float *out, int T, int C, float eps) {
#pragma omp parallel for if (T >= PARALLEL_ROWS)
    for (int t = 0; t < T; t++)
        norm_row(x + (size_t)t * C, w, out + (size_t)t * C, C, eps);
}

void kvflow_add_rms_norm(float *x, const float *delta, const float *w, float *out, int T, int C,
                         float eps) {
#pragma omp parallel for if (T >= PARALLEL_ROWS)
    for (int t = 0; t < T; t++) {
        float *xr = x + (size_t)t * C;
        const float *dr = delta + (size_t)t * C;
#pragma omp simd
        for (int c = 0; c < C; c++) xr[c] += dr[c];
        norm_row(xr, w, out + (size_t)t * C, C, eps);
    }
}

void kvflow_silu_mul(const float *gate_up, float *out, int T, int I) {
#pragma omp parallel for if (T >= PARALLEL_ROWS)
    for (int t = 0; t < T; t++) {
        const float *g = gate_up + (size_t)t * 2 * I, *u = g + I;
        float *o = out + (size_t)t * I;
#pragma omp simd
        for (int i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* float32 -> bfloat16, round to nearest even (NaN stays a quiet NaN) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* x [heads, D] rotated in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) */
static inline void rotate(float *restrict x, const float *restrict cs, const float *restrict sn,
                          int heads, int D) {
    const int half = D / 2;
    for (int h = 0; h < heads; h++) {
        float *x1 = x + (size_t)h * D, *x2 = x1 + half;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * cs[i] - b * sn[i];
            x2[i] = b * cs[i] + a * sn[i];
        }
    }
}

static inline __attribute__((always_inline)) void
rope_store(float *qkv, const float *cos, const float *sin, const int64_t *slots, void *k_cache,
           void *v_cache, int T, int H, int KVH, int D, int BS, const int bf16) {
    const size_t row = (size_t)(H + 2 * KVH) * D;
#pragma omp parallel for if (T >= PARALLEL_ROWS)
    for (int t = 0; t < T; t++) {
        float *q = qkv + (size_t)t * row, *k = q + (size_t)H * D, *v = k + (size_t)KVH * D;
        const float *cs = cos + (size_t)t * (D / 2), *sn = sin + (size_t)t * (D / 2);
        rotate(q, cs, sn, H, D);
        rotate(k, cs, sn, KVH, D);
        const int64_t block = slots[t] / BS, off = slots[t] % BS;
        for (int h = 0; h < KVH; h++) {
            const size_t at = (((size_t)block * KVH + h) * BS + (size_t)off) * D;
            const float *kh = k + (size_t)h * D, *vh = v + (size_t)h * D;
            if (bf16) {
                uint16_t *kc = (uint16_t *)k_cache + at, *vc = (uint16_t *)v_cache + at;
                for (int d = 0; d < D; d++) {
                    kc[d] = to_bf16(kh[d]);
                    vc[d] = to_bf16(vh[d]);
                }
            } else {
                memcpy((float *)k_cache + at, kh, sizeof(float) * (size_t)D);
                memcpy((float *)v_cache + at, vh, sizeof(float) * (size_t)D);
            }
        }
    }
}

void kvflow_rope_store_f32(float *qkv, const float *cos, const float *sin, const int64_t *slots,
                           void *k_cache, void *v_cache, int T, int H, int KVH, int D, int BS) {
    rope_store(qkv, cos, sin, slots, k_cache, v_cache, T, H, KVH, D, BS, 0);
}

void kvflow_rope_store_bf16(float *qkv, const float *cos, const float *sin, const int64_t *slots,
                            void *k_cache, void *v_cache, int T, int H, int KVH, int D, int BS) {
    rope_store(qkv, cos, sin, slots, k_cache, v_cache, T, H, KVH, D, BS, 1);
}
