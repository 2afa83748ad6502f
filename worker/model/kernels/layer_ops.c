/* The small per-token ops of a decoder layer, each one pass over its rows (CPU).
 *
 * In torch each of these is a chain of elementwise ops (RMSNorm: 7, rotary on q and k
 * plus the store of K/V into the cache by advanced indexing: ~20), each with its own
 * dispatch and a pass over the data; at decode batch sizes the data is a few hundred KB,
 * so the chain costs its dispatches, not its arithmetic. Here each is one call, and each
 * reads and writes the dtype of the linear layer beside it: with bfloat16 linear layers
 * the casts from and to the float32 residual stream are folded into the ops (a linear
 * layer's bfloat16 output widened to float32 carries no more than it did).
 *
 *   kvflow_rms_norm       out[t] = w * x[t] / sqrt(mean(x[t]^2) + eps); with delta (not
 *                         NULL) x[t] += delta[t] first, in place (vLLM's fused_add_rms_norm)
 *   kvflow_silu_mul       out[t] = silu(gate[t]) * up[t], gate and up the halves of a row
 *   kvflow_rope_store     the token's q, k and v in float32, q and k rotated ('rotate half'
 *                         layout); its k and v into its cache slot
 *
 * Shapes (rows contiguous):
 *   x [T, C] float32, w [C] float32, delta [T, C]; out [R, C], R >= T: rows T..R-1 are
 *   zeroed (the linear layers pad their rows to a few bucket sizes, see llama.Linear)
 *   gate_up [T, 2 I] (out [R, I])
 *   qkv [T, (H + 2 KVH) D]: q heads, then k heads, then v heads; out: q [T, H, D], then
 *   k [T, KVH, D], then v [T, KVH, D], float32, each contiguous (the attention kernel and
 *   the prefill path take them as they are); without kv_out, q only (a step whose rows
 *   all attend through the kernel reads K and V from the cache alone)
 *   cos, sin [T, D / 2] float32 (the token's position's angles)
 *   slots [T] int64 (block * BS + offset); k_cache, v_cache [NB, KVH, BS, D] (with
 *   k_pairs bfloat16 keys in pairs, [NB, KVH, D / 2, BS, 2]: paged_decode.c), or as an
 *   int8 cache (k_i8, v_i8: either or both, each the values per scale, 0 where not int8)
 *   [NB, KVH, BS, D + 4 * D / group] bytes: each group of a row's D values rounded to int8
 *   against the group's absolute maximum, then the groups' float32 scales (maximum / 127)
 * The `*_bf16` flags say which of the rows are bfloat16 (else float32); bfloat16 results
 * are rounded to nearest even, as torch rounds.
 *
 * Threads: OpenMP over tokens where there are enough of them to pay for waking the pool.
 */
#include <float.h>
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "entries.h"
#include "silu.h"

/* Fewer tokens than this run on the calling thread. torch's pool is still awake between
 * a step's kernels, so a parallel region is cheap: SiLU, the norm with its residual add
 * and the rotary with its store took 113 against 164 us for 64 tokens on 2 threads (85
 * against 110 at 32, the same at 16; AMD EPYC with avx512_bf16). */
#define PARALLEL_ROWS 32

/* Call fn(..., a, b) with the two dtype flags a and b as literals (0 or 1), so that each
 * of the four combinations is compiled with its loads and stores fixed. */
#define WITH_FLAGS(fn, a, b, ...)                \
    do {                                         \
        if (a && b)                              \
            fn(__VA_ARGS__, 1, 1);               \
        else if (a)                              \
            fn(__VA_ARGS__, 1, 0);               \
        else if (b)                              \
            fn(__VA_ARGS__, 0, 1);               \
        else                                     \
            fn(__VA_ARGS__, 0, 0);               \
    } while (0)

/* Element i of a row of either dtype; bf16 is a literal wherever these are inlined. */
static inline __attribute__((always_inline)) float load(const void *row, int i, const int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

static inline __attribute__((always_inline)) void store(void *row, int i, float v,
                                                       const int bf16) {
    if (bf16)
        ((uint16_t *)row)[i] = to_bf16(v);
    else
        ((float *)row)[i] = v;
}

static inline size_t row_bytes(int n, int bf16) { return (size_t)n * (bf16 ? 2 : 4); }

/* Values per chunk of a row computed in float32 before they are rounded to bfloat16 as one
 * run (round_run): on the stack, in L1. */
#define CHUNK 512

/* n float32 values -> bfloat16, rounded as to_bf16 rounds them. Where the CPU has
 * avx512_bf16, 16 at a time by vcvtneps2bf16 (to nearest even, as to_bf16; NaN to the
 * quiet NaN of its top half, as to_bf16), which treats a denormal input as zero: a run of
 * 16 holding one takes to_bf16 for it. The scalar rounding's shifts, adds, NaN test and
 * packing were most of SiLU and multiply's time on an Intel Xeon with AMX (perf), the
 * expf beside them little. */
static inline __attribute__((always_inline)) void round_run(const float *restrict src,
                                                            uint16_t *restrict dst, int n) {
    int i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(src + i);
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(v));
        const __mmask16 tiny =
            _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(FLT_MIN), _CMP_LT_OQ) &
            _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ);
        for (int l = 0; tiny && l < 16; l++)
            if (tiny >> l & 1) dst[i + l] = to_bf16(src[i + l]);
    }
#endif
    for (; i < n; i++) dst[i] = to_bf16(src[i]);
}

static inline __attribute__((always_inline)) void
norm_row(const float *restrict x, const float *restrict w, void *restrict out, int C, float eps,
         const int out_bf16) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int c = 0; c < C; c++) ss += x[c] * x[c];
    const float r = 1.0f / sqrtf(ss / (float)C + eps);
#pragma omp simd
    for (int c = 0; c < C; c++) store(out, c, w[c] * (x[c] * r), out_bf16);
}

static inline __attribute__((always_inline)) void
add_norm(float *x, const void *delta, const float *w, void *out, int T, int C, float eps,
         const int delta_bf16, const int out_bf16) {
#pragma omp parallel for if (T >= PARALLEL_ROWS)
    for (int t = 0; t < T; t++) {
        float *xr = x + (size_t)t * C;
        if (delta != NULL) {
            const char *dr = (const char *)delta + (size_t)t * row_bytes(C, delta_bf16);
#pragma omp simd
            for (int c = 0; c < C; c++) xr[c] += load(dr, c, delta_bf16);
        }
        norm_row(xr, w, (char *)out + (size_t)t * row_bytes(C, out_bf16), C, eps, out_bf16);
    }
}

void kvflow_rms_norm(float *x, const void *delta, const float *w, void *out, int T, int R, int C,
                     float eps, int delta_bf16, int out_bf16) {
    WITH_FLAGS(add_norm, delta_bf16, out_bf16, x, delta, w, out, T, C, eps);
    memset((char *)out + (size_t)T * row_bytes(C, out_bf16), 0,
           (size_t)(R - T) * row_bytes(C, out_bf16));
}

static inline __attribute__((always_inline)) void
silu_mul(const void *gate_up, void *out, int T, int I, const int in_bf16, const int out_bf16) {
#pragma omp parallel for if (T >= PARALLEL_ROWS)
    for (int t = 0; t < T; t++) {
        const char *g = (const char *)gate_up + (size_t)t * row_bytes(2 * I, in_bf16);
        const char *u = g + row_bytes(I, in_bf16);
        char *o = (char *)out + (size_t)t * row_bytes(I, out_bf16);
        if (out_bf16) { /* float32 values a chunk at a time, then rounded as one run */
            float buf[CHUNK];
            for (int i0 = 0; i0 < I; i0 += CHUNK) {
                const int n = I - i0 < CHUNK ? I - i0 : CHUNK;
#pragma omp simd
                for (int i = 0; i < n; i++)
                    buf[i] = silu_times(load(g, i0 + i, in_bf16), load(u, i0 + i, in_bf16));
                round_run(buf, (uint16_t *)o + i0, n);
            }
            continue;
        }
#pragma omp simd
        for (int i = 0; i < I; i++) {
            store(o, i, silu_times(load(g, i, in_bf16), load(u, i, in_bf16)), out_bf16);
        }
    }
}

void kvflow_silu_mul(const void *gate_up, void *out, int T, int R, int I, int in_bf16,
                     int out_bf16) {
    WITH_FLAGS(silu_mul, in_bf16, out_bf16, gate_up, out, T, I);
    memset((char *)out + (size_t)T * row_bytes(I, out_bf16), 0,
           (size_t)(R - T) * row_bytes(I, out_bf16));
}

/* n values x into int8 q [n]: q = round(x * 127 / max |x|), and the scale max |x| / 127
 * (0 for zeros) into *scale. Plain IEEE arithmetic here, not the library's -ffast-math
 * (which divides by 127 as a multiplication by its rounded reciprocal): for finite values
 * the rows are torch's `quantize_rows`, byte for byte (a NaN is passed over here where
 * torch carries it into the scale). */
__attribute__((optimize("no-fast-math"))) static inline void
store_i8(int8_t *restrict q, char *restrict scale, const float *restrict x, const int n) {
    float amax = 0.0f;
    int d = 0;
#if defined(__AVX512F__)
    /* 16 values at a time where n allows, the same arithmetic: a maximum is exact in any
     * order (|x| first: a NaN is passed over, as fmaxf does), x * inv one IEEE product,
     * the clamps as fmaxf / fminf (a NaN product becomes -127), and the conversion rounds
     * to nearest even as lrintf does. A bfloat16-int8 cache stores every value row so:
     * the scalar loops took ~1 ms of a batch-64 decode step (Intel Xeon with AMX). */
    __m512 m16 = _mm512_setzero_ps();
    for (; n % 16 == 0 && d < n; d += 16)
        m16 = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + d)), m16);
    amax = _mm512_reduce_max_ps(m16);
#endif
    for (; d < n; d++) amax = fmaxf(amax, fabsf(x[d]));
    const float sc = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    d = 0;
#if defined(__AVX512F__)
    for (; n % 16 == 0 && d < n; d += 16) {
        __m512 t = _mm512_mul_ps(_mm512_loadu_ps(x + d), _mm512_set1_ps(inv));
        t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
        _mm_storeu_si128((__m128i *)(q + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(t)));
    }
#endif
    for (; d < n; d++) q[d] = (int8_t)lrintf(fminf(fmaxf(x[d] * inv, -127.0f), 127.0f));
    memcpy(scale, &sc, sizeof sc);
}

/* x [D] rounded into an int8 row dst: the D values, `group` at a time, then a float32
 * scale per group. Its own function, not inlined into the fast-math rotary loop, so that
 * store_i8 inlines here under the same no-fast-math. */
__attribute__((optimize("no-fast-math"), noinline)) static void
store_i8_row(char *restrict dst, const float *restrict x, int D, int group) {
    for (int g = 0; g < D / group; g++)
        store_i8((int8_t *)dst + group * g, dst + D + sizeof(float) * g, x + group * g, group);
}

/* Row `row` of a cache: x [D] rounded into an int8 row of groups of `i8` values or, with
 * i8 0, stored as bfloat16 or float32 (cache_bf16). */
static inline __attribute__((always_inline)) void
store_row(void *cache, size_t row, const float *restrict x, int D, int i8, const int cache_bf16) {
    if (i8) {
        const size_t bytes = (size_t)D + sizeof(float) * (size_t)(D / i8);
        store_i8_row((char *)cache + row * bytes, x, D, i8);
        return;
    }
    char *c = (char *)cache + row * D * (cache_bf16 ? 2 : 4);
    for (int d = 0; d < D; d++) store(c, d, x[d], cache_bf16);
}

/* heads [heads, D] of a row of either dtype -> dst [heads, D] float32, rotated:
 * (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) */
static inline __attribute__((always_inline)) void
rotate(const void *src, float *restrict dst, const float *restrict cs, const float *restrict sn,
       int heads, int D, const int in_bf16) {
    const int half = D / 2;
    for (int h = 0; h < heads; h++) {
        const int base = h * D;
        float *d1 = dst + base, *d2 = d1 + half;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            const float a = load(src, base + i, in_bf16), b = load(src, base + half + i, in_bf16);
            d1[i] = a * cs[i] - b * sn[i];
            d2[i] = b * cs[i] + a * sn[i];
        }
    }
}

static inline __attribute__((always_inline)) void
rope_store(const void *qkv, float *out, const float *cos, const float *sin, const int64_t *slots,
           void *k_cache, void *v_cache, int T, int H, int KVH, int D, int BS, int k_i8,
           int v_i8, int kv_out, int k_pairs, const int in_bf16, const int cache_bf16) {
    const int width = (H + 2 * KVH) * D;
    float *q_out = out, *k_out = q_out + (size_t)T * H * D, *v_out = k_out + (size_t)T * KVH * D;
#pragma omp parallel for if (T >= PARALLEL_ROWS)
    for (int t = 0; t < T; t++) {
        const char *row = (const char *)qkv + (size_t)t * row_bytes(width, in_bf16);
        float kv_row[2 * KVH * D]; /* k and v of a row nobody reads past the store */
        float *q = q_out + (size_t)t * H * D;
        float *k = kv_out ? k_out + (size_t)t * KVH * D : kv_row;
        float *v = kv_out ? v_out + (size_t)t * KVH * D : kv_row + KVH * D;
        const float *cs = cos + (size_t)t * (D / 2), *sn = sin + (size_t)t * (D / 2);
        rotate(row, q, cs, sn, H, D, in_bf16);
        rotate(row + row_bytes(H * D, in_bf16), k, cs, sn, KVH, D, in_bf16);
        const char *vsrc = row + row_bytes((H + KVH) * D, in_bf16);
        for (int i = 0; i < KVH * D; i++) v[i] = load(vsrc, i, in_bf16);
        const int64_t block = slots[t] / BS, off = slots[t] % BS;
        for (int h = 0; h < KVH; h++) {
            const size_t row = ((size_t)block * KVH + h) * BS + (size_t)off;
            if (k_pairs) { /* bfloat16 keys in pairs: dims 2p, 2p + 1 at [block, h, p, off] */
                uint16_t *kp = (uint16_t *)k_cache + ((size_t)block * KVH + h) * (size_t)BS * D;
                for (int p = 0; p < D / 2; p++) {
                    kp[((size_t)p * BS + (size_t)off) * 2] = to_bf16(k[h * D + 2 * p]);
                    kp[((size_t)p * BS + (size_t)off) * 2 + 1] = to_bf16(k[h * D + 2 * p + 1]);
                }
            } else {
                store_row(k_cache, row, k + h * D, D, k_i8, cache_bf16);
            }
            store_row(v_cache, row, v + h * D, D, v_i8, cache_bf16);
        }
    }
}

void kvflow_rope_store(const void *qkv, float *out, const float *cos, const float *sin,
                       const int64_t *slots, void *k_cache, void *v_cache, int T, int H, int KVH,
                       int D, int BS, int in_bf16, int cache_bf16, int k_i8, int v_i8,
                       int kv_out, int k_pairs) {
    WITH_FLAGS(rope_store, in_bf16, cache_bf16, qkv, out, cos, sin, slots, k_cache, v_cache, T, H,
               KVH, D, BS, k_i8, v_i8, kv_out, k_pairs);
}
