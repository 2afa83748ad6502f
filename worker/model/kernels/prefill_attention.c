/* Prompt-chunk attention read in place from a paged, head-major KV cache (CPU).
 *
 * One chunk of T new rows of one sequence, at positions num_context .. num_context + T - 1,
 * each seeing the keys up to its own position (causal; the chunk's own K/V are stored in
 * the cache before the kernel runs). Where the decode kernel (paged_decode.c) takes one
 * query against a stream of keys, here many queries share each key: the work is a pair
 * of matrix products, so it is tiled as one. A tile is QT rows x the G query heads of one
 * KV head (R = G * QT query vectors, scaled once); the keys come in chunks of up to KC,
 * a chunk's K transposed to [D, KC] and its V widened to [KC, D] in float32 once for all
 * R vectors (and so read from the cache once per tile), then
 *   scores  S[R, KC]  = Q[R, D] K^T          (tiles of 6 vectors x 16 keys in registers)
 *   softmax online over the chunks: each vector's running max m and sum l, its output
 *           rescaled by exp(m_old - m_new) when the max moves (flash attention's update)
 *   values  O[R, D]  += P[R, KC] V[KC, D]    (tiles of 3 vectors x 32 values)
 * and O / l is written out. The loops have fixed trip counts inside the tiles so that the
 * compiler keeps the accumulators in vector registers (-O3 -march=native). The tiles are
 * 256-bit FMAs; with AVX-512 the same tiles twice as wide (6 vectors x 32 keys, 3 x 64
 * values, any 32 or 8 values left to the 256-bit tiles), the same sums in the same order:
 * one layer's prompt attention took 0.71-0.84x the time of the 256-bit tiles (8 prompts
 * of 256 tokens, 16 of 128, 4 of 256 behind 128 cached, one of 1,024; D 64, bfloat16
 * cache, 2 threads, both builds alternating on an Intel Xeon with AVX-512), 0.85x at D 80.
 *
 * Shapes (contiguous):
 *   q            [T, H, D] float32      out [T, H, D] float32
 *   k_cache      [NB, KVH, BS, D]       v_cache likewise: float32 or bfloat16
 *   block_table  [>= cdiv(num_context + T, BS)] int32 (the sequence's blocks in order)
 * Returns 0; 1 where the widened keys or a thread's scratch could not be allocated; 2
 * where the shapes are outside what the tiles hold (G > MAX_G, D not a multiple of 8 or
 * above MAX_D, BS above KC or not dividing it): the caller then takes another path.
 *
 * Threads: OpenMP over (KV head, tile) pairs, dynamically (a causal tile's work grows
 * with its position).
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVFLOW_VEC 1 /* the tiles in 256-bit FMAs */
#else
#define KVFLOW_VEC 0
#endif
#if defined(__AVX512F__)
#define KVFLOW_VEC512 1 /* and, with AVX-512, the full tiles in 512-bit ones */
#else
#define KVFLOW_VEC512 0
#endif

#define QT 8     /* rows of the chunk in a tile */
#define MAX_G 8  /* query heads per KV head a tile holds: R <= QT * MAX_G */
#define MAX_R (QT * MAX_G + 8) /* and the padding to SR */
#define KC 64    /* keys per chunk */
#define MAX_D 128
#define SR 6     /* score tile: vectors */
#define SK 16    /* score tile: keys */
#define PR 3     /* value tile: vectors */
#define PD 32    /* value tile: values */
#define SK512 32 /* AVX-512 score tile: keys (6 x 2 accumulators, as the 256-bit one) */
#define PD512 64 /* AVX-512 value tile: values (3 x 4 accumulators) */

/* The sequence's first `keys` keys of KV head h, widened to float32 once for every tile:
 * K transposed chunk by chunk into kt [ldk / KC][D][KC] (a chunk's 16 KB contiguous for
 * the score tiles' passes over d; keys past `keys` zeroed up to ldk: their scores are
 * masked, and a zero key keeps them finite), V into vf [keys][D]. Block by block: BS
 * divides KC, so a chunk of KC keys starts on a block. */
static void widen_head(const void *k_cache, const void *v_cache, const int bf16,
                       const int32_t *table, const int keys, const int h, const int KVH,
                       const int BS, const int D, const int ldk, float *kt, float *vf) {
    const size_t es = bf16 ? 2 : 4;
    for (int j = 0; j < keys; j += BS) {
        const size_t base = (((size_t)table[j / BS] * KVH + h) * BS) * D;
        const int n = keys - j < BS ? keys - j : BS;
        const char *kb = (const char *)k_cache + base * es;
        const char *vb = (const char *)v_cache + base * es;
        for (int t = 0; t < n; t++) {
            float *vrow = vf + (size_t)(j + t) * D;
            float *kc = kt + (size_t)((j + t) / KC) * D * KC + (j + t) % KC;
            if (bf16) {
                const uint16_t *kr = (const uint16_t *)kb + (size_t)t * D;
                const uint16_t *vr = (const uint16_t *)vb + (size_t)t * D;
                for (int d = 0; d < D; d++) vrow[d] = from_bf16(vr[d]);
                for (int d = 0; d < D; d++) kc[(size_t)d * KC] = from_bf16(kr[d]);
            } else {
                const float *kr = (const float *)kb + (size_t)t * D;
                memcpy(vrow, (const float *)vb + (size_t)t * D, (size_t)D * sizeof(float));
                for (int d = 0; d < D; d++) kc[(size_t)d * KC] = kr[d];
            }
        }
    }
    for (int j = keys; j < ldk; j++)
        for (int d = 0; d < D; d++) kt[((size_t)(j / KC) * D + d) * KC + j % KC] = 0.0f;
}

/* A thread's scratch for its tiles. */
struct tile_scratch {
    float qt[MAX_R * MAX_D], o[MAX_R * MAX_D], s[MAX_R * KC];
    float m[MAX_R], l[MAX_R], alpha[MAX_R];
    int last[MAX_R]; /* the last key position each vector sees */
};

/* S[r][j] = Q[r] . K[j] for r < R (a multiple of SR), j < nk rounded up to SK (SK512
 * with AVX-512; KC a multiple of it, and keys past `keys` zeroed to a whole chunk); kt a
 * chunk's K^T [D][KC]. */
static inline void scores(const float *qt, const float *kt, const int R,
                          const int nk, const int D, float *s) {
    for (int r = 0; r < R; r += SR) {
#if KVFLOW_VEC512
        for (int j0 = 0; j0 < nk; j0 += SK512) {
            __m512 acc[SR][2];
            for (int a = 0; a < SR; a++) acc[a][0] = acc[a][1] = _mm512_setzero_ps();
            for (int d = 0; d < D; d++) {
                const __m512 k0 = _mm512_loadu_ps(kt + (size_t)d * KC + j0);
                const __m512 k1 = _mm512_loadu_ps(kt + (size_t)d * KC + j0 + 16);
                for (int a = 0; a < SR; a++) {
                    const __m512 qv = _mm512_set1_ps(qt[(size_t)(r + a) * D + d]);
                    acc[a][0] = _mm512_fmadd_ps(qv, k0, acc[a][0]);
                    acc[a][1] = _mm512_fmadd_ps(qv, k1, acc[a][1]);
                }
            }
            for (int a = 0; a < SR; a++) {
                _mm512_storeu_ps(s + (size_t)(r + a) * KC + j0, acc[a][0]);
                _mm512_storeu_ps(s + (size_t)(r + a) * KC + j0 + 16, acc[a][1]);
            }
        }
#else
        for (int j0 = 0; j0 < nk; j0 += SK) {
#if KVFLOW_VEC
            /* 6 x 2 accumulators: 12 independent FMA chains, 2 key loads a d */
            __m256 acc[SR][2];
            for (int a = 0; a < SR; a++) acc[a][0] = acc[a][1] = _mm256_setzero_ps();
            for (int d = 0; d < D; d++) {
                const __m256 k0 = _mm256_loadu_ps(kt + (size_t)d * KC + j0);
                const __m256 k1 = _mm256_loadu_ps(kt + (size_t)d * KC + j0 + 8);
                for (int a = 0; a < SR; a++) {
                    const __m256 qv = _mm256_broadcast_ss(qt + (size_t)(r + a) * D + d);
                    acc[a][0] = _mm256_fmadd_ps(qv, k0, acc[a][0]);
                    acc[a][1] = _mm256_fmadd_ps(qv, k1, acc[a][1]);
                }
            }
            for (int a = 0; a < SR; a++) {
                _mm256_storeu_ps(s + (size_t)(r + a) * KC + j0, acc[a][0]);
                _mm256_storeu_ps(s + (size_t)(r + a) * KC + j0 + 8, acc[a][1]);
            }
#else
            for (int a = 0; a < SR; a++) {
                float *dst = s + (size_t)(r + a) * KC + j0;
                for (int jj = 0; jj < SK; jj++) dst[jj] = 0.0f;
                for (int d = 0; d < D; d++) {
                    const float qv = qt[(size_t)(r + a) * D + d];
                    for (int jj = 0; jj < SK; jj++) dst[jj] += qv * kt[(size_t)d * KC + j0 + jj];
                }
            }
#endif
        }
#endif
    }
}

/* O[r] = O[r] * alpha[r] + sum_j P[r][j] V[j], for r < R (a multiple of PR), j < nk;
 * values PD512 at a time with AVX-512, then PD, then any 8 left (D a multiple of 8). */
static inline void values(const float *p, const float *vf, const float *alpha, const int R,
                          const int nk, const int D, float *o) {
    for (int r = 0; r < R; r += PR) {
        int d0 = 0;
#if KVFLOW_VEC512
        for (; d0 + PD512 <= D; d0 += PD512) { /* 3 x 4 accumulators, 4 value loads a key */
            __m512 acc[PR][PD512 / 16];
            for (int a = 0; a < PR; a++) {
                const __m512 al = _mm512_set1_ps(alpha[r + a]);
                for (int c = 0; c < PD512 / 16; c++)
                    acc[a][c] =
                        _mm512_mul_ps(al, _mm512_loadu_ps(o + (size_t)(r + a) * D + d0 + 16 * c));
            }
            for (int j = 0; j < nk; j++) {
                const float *v = vf + (size_t)j * D + d0;
                const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
                const __m512 v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);
                for (int a = 0; a < PR; a++) {
                    const __m512 pv = _mm512_set1_ps(p[(size_t)(r + a) * KC + j]);
                    acc[a][0] = _mm512_fmadd_ps(pv, v0, acc[a][0]);
                    acc[a][1] = _mm512_fmadd_ps(pv, v1, acc[a][1]);
                    acc[a][2] = _mm512_fmadd_ps(pv, v2, acc[a][2]);
                    acc[a][3] = _mm512_fmadd_ps(pv, v3, acc[a][3]);
                }
            }
            for (int a = 0; a < PR; a++)
                for (int c = 0; c < PD512 / 16; c++)
                    _mm512_storeu_ps(o + (size_t)(r + a) * D + d0 + 16 * c, acc[a][c]);
        }
#endif
        for (; d0 < D; d0 += PD) {
            const int w = D - d0 < PD ? (D - d0) / 8 : PD / 8; /* vectors of 8 values */
#if KVFLOW_VEC
            /* Two accumulator arrays: one indexed by the runtime width would live in memory
             * (gcc spilled the full tile's accumulators to the stack every key). */
            if (w == PD / 8) { /* 3 x 4 accumulators, 4 value loads a key */
                __m256 acc[PR][PD / 8];
                for (int a = 0; a < PR; a++) {
                    const __m256 al = _mm256_set1_ps(alpha[r + a]);
                    for (int c = 0; c < PD / 8; c++)
                        acc[a][c] = _mm256_mul_ps(
                            al, _mm256_loadu_ps(o + (size_t)(r + a) * D + d0 + 8 * c));
                }
                for (int j = 0; j < nk; j++) {
                    const float *v = vf + (size_t)j * D + d0;
                    const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
                    const __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
                    for (int a = 0; a < PR; a++) {
                        const __m256 pv = _mm256_broadcast_ss(p + (size_t)(r + a) * KC + j);
                        acc[a][0] = _mm256_fmadd_ps(pv, v0, acc[a][0]);
                        acc[a][1] = _mm256_fmadd_ps(pv, v1, acc[a][1]);
                        acc[a][2] = _mm256_fmadd_ps(pv, v2, acc[a][2]);
                        acc[a][3] = _mm256_fmadd_ps(pv, v3, acc[a][3]);
                    }
                }
                for (int a = 0; a < PR; a++)
                    for (int c = 0; c < PD / 8; c++)
                        _mm256_storeu_ps(o + (size_t)(r + a) * D + d0 + 8 * c, acc[a][c]);
            } else { /* the last 8, 16 or 24 values of a row: through memory, rare */
                for (int a = 0; a < PR; a++) {
                    float *dst = o + (size_t)(r + a) * D + d0;
                    const __m256 al = _mm256_set1_ps(alpha[r + a]);
                    for (int c = 0; c < w; c++)
                        _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(al, _mm256_loadu_ps(dst + 8 * c)));
                    for (int j = 0; j < nk; j++) {
                        const float *v = vf + (size_t)j * D + d0;
                        const __m256 pv = _mm256_broadcast_ss(p + (size_t)(r + a) * KC + j);
                        for (int c = 0; c < w; c++)
                            _mm256_storeu_ps(dst + 8 * c, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * c),
                                                                      _mm256_loadu_ps(dst + 8 * c)));
                    }
                }
            }
#else
            for (int a = 0; a < PR; a++) {
                float *dst = o + (size_t)(r + a) * D + d0;
                for (int dd = 0; dd < 8 * w; dd++) dst[dd] *= alpha[r + a];
                for (int j = 0; j < nk; j++) {
                    const float pv = p[(size_t)(r + a) * KC + j];
                    for (int dd = 0; dd < 8 * w; dd++) dst[dd] += pv * vf[(size_t)j * D + d0 + dd];
                }
            }
#endif
        }
    }
}

static int prefill(const float *q, const void *k_cache, const void *v_cache, const int bf16,
                   const int32_t *table, const int T, const int num_context, const int H,
                   const int KVH, const int D, const int BS, float *out, const float scale) {
    const int G = H / KVH;
    if (G > MAX_G || G * KVH != H || D % 8 || D > MAX_D || BS > KC || KC % BS) return 2;
    const int keys = num_context + T;
    const int ldk = ((keys + KC - 1) / KC) * KC;
    /* every KV head's keys widened once: K^T [KVH][ldk / KC][D][KC], V [KVH][ldk][D] */
    float *kt_all = malloc(sizeof(float) * (size_t)KVH * D * ldk * 2);
    if (kt_all == NULL) return 1;
    float *vf_all = kt_all + (size_t)KVH * D * ldk;
    const int tiles = (T + QT - 1) / QT;
    int failed = 0;
#pragma omp parallel
    {
        /* a thread's tile scratch, ~80 KB at the largest: on the heap, not the OpenMP
         * thread's stack (which OMP_STACKSIZE may make smaller than that) */
        struct tile_scratch *w = malloc(sizeof *w);
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int h = 0; h < KVH; h++)
            widen_head(k_cache, v_cache, bf16, table, keys, h, KVH, BS, D, ldk,
                       kt_all + (size_t)h * D * ldk, vf_all + (size_t)h * ldk * D);
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < KVH * tiles; item++) {
            if (w == NULL) continue;
            float *qt = w->qt, *o = w->o, *s = w->s, *m = w->m, *l = w->l, *alpha = w->alpha;
            int *last = w->last;
            /* the last tiles (the longest, causal) first: dynamic scheduling then evens
             * the threads' ends */
            const int tile = tiles - 1 - item / KVH, h = item % KVH, r0 = tile * QT;
            const float *kt = kt_all + (size_t)h * D * ldk;
            const float *vf = vf_all + (size_t)h * ldk * D;
            const int rows = T - r0 < QT ? T - r0 : QT;
            /* padded to whole score tiles (SR, a multiple of PR) */
            const int R = ((G * rows + SR - 1) / SR) * SR;
            /* vector v = g * rows + t: query head h * G + g of row r0 + t */
            for (int v = 0; v < R; v++) {
                float *dst = qt + (size_t)v * D;
                m[v] = -FLT_MAX; /* not -inf: -ffast-math assumes finite values */
                l[v] = 0.0f;
                memset(o + (size_t)v * D, 0, (size_t)D * sizeof(float));
                if (v >= G * rows) { /* padding: a zero query over key 0 only */
                    memset(dst, 0, (size_t)D * sizeof(float));
                    last[v] = 0;
                    continue;
                }
                const int g = v / rows, t = v % rows;
                const float *src = q + ((size_t)(r0 + t) * H + (size_t)h * G + g) * D;
                for (int d = 0; d < D; d++) dst[d] = src[d] * scale;
                last[v] = num_context + r0 + t;
            }
            const int seen = num_context + r0 + rows; /* the tile's last row sees them all */
            for (int key0 = 0; key0 < seen; key0 += KC) {
                const int nk = seen - key0 < KC ? seen - key0 : KC;
                scores(qt, kt + (size_t)key0 * D, R, nk, D, s);
                for (int v = 0; v < R; v++) {
                    float *sv = s + (size_t)v * KC;
                    /* keys past this vector's own position (or the chunk) take no weight */
                    const int see = last[v] - key0 + 1 < nk ? last[v] - key0 + 1 : nk;
                    if (see <= 0) {
                        alpha[v] = 1.0f;
                        for (int j = 0; j < nk; j++) sv[j] = 0.0f;
                        continue;
                    }
                    float mx = m[v];
                    for (int j = 0; j < see; j++) mx = sv[j] > mx ? sv[j] : mx;
                    alpha[v] = expf(m[v] - mx); /* 0 on the first chunk */
                    float sum = 0.0f;
                    for (int j = 0; j < see; j++) {
                        sv[j] = expf(sv[j] - mx);
                        sum += sv[j];
                    }
                    for (int j = see; j < nk; j++) sv[j] = 0.0f;
                    l[v] = l[v] * alpha[v] + sum;
                    m[v] = mx;
                }
                values(s, vf + (size_t)key0 * D, alpha, R, nk, D, o);
            }
            for (int v = 0; v < G * rows; v++) {
                const int g = v / rows, t = v % rows;
                float *dst = out + ((size_t)(r0 + t) * H + (size_t)h * G + g) * D;
                const float inv = 1.0f / l[v];
                for (int d = 0; d < D; d++) dst[d] = o[(size_t)v * D + d] * inv;
            }
        }
        free(w);
    }
    free(kt_all);
    return failed;
}

int kvflow_prefill_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                 const int32_t *table, int T, int num_context, int H, int KVH,
                                 int D, int BS, float *out, float scale) {
    return prefill(q, k_cache, v_cache, 0, table, T, num_context, H, KVH, D, BS, out, scale);
}

int kvflow_prefill_attention_bf16(const float *q, const uint16_t *k_cache,
                                  const uint16_t *v_cache, const int32_t *table, int T,
                                  int num_context, int H, int KVH, int D, int BS, float *out,
                                  float scale) {
    return prefill(q, k_cache, v_cache, 1, table, T, num_context, H, KVH, D, BS, out, scale);
}
