/* Prompt-chunk attention over keys in pairs, on vdpbf16ps (CPU with avx512_bf16).
 *
 * The work of prefill_attention.c (a chunk of T rows of one sequence, each seeing the keys
 * up to its own position, read in place from the cache, flash attention's online softmax
 * over chunks of keys), for a bfloat16 cache whose keys are stored in pairs, with both
 * matrix products on bfloat16 dot products summed in float32:
 *
 *   q        [T, H, D] float32            out [T, H, D] float32
 *   k_cache  [NB, KVH, D / 2, BS, 2] bf16 (dimensions 2p and 2p + 1 of a block's keys side
 *                                          by side: 16 keys of a pair are one vector)
 *   v_cache  [NB, KVH, BS, D] bf16
 *
 * The decode kernel took these rows one at a time (prefill attention "native"), each
 * reading its whole context again and scoring it with float32 FMAs: a prompt of 2,048
 * tokens spent about half its step there (AMD EPYC Zen 4). Here a tile is QT rows x the G
 * query heads of one KV head (R = QT * G vectors); q * scale is rounded to bfloat16 once a
 * tile (as bfloat16 SDPA rounds it), so that
 *   scores  S[R, KC] = Q K^T: per pair of dimensions, one load of 16 keys and one
 *           vdpbf16ps a vector with q's pair broadcast (tiles of 8 vectors x 32 keys)
 *   softmax online over chunks of KC keys, P rounded to bfloat16 (the sums l of the
 *           rounded values, so that P / l sums to 1 as used)
 *   values  O[R, D] += P V: a chunk's values interleaved once into pairs of keys (16
 *           dimensions of keys 2j and 2j + 1 a vector), then one vdpbf16ps a vector and
 *           16 dimensions with P's pair broadcast (tiles of 8 vectors x 32 dimensions).
 * Shapes: D a multiple of 32 up to 128, BS a multiple of 16, G <= 8; else 2 (the caller
 * takes another path). 1: a thread's scratch could not be allocated. 3: not built for
 * this CPU.
 *
 * Threads: OpenMP over (KV head, tile) pairs, dynamically (a causal tile's work grows
 * with its position).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define QT 8 /* chunk rows a tile */
#define MAX_G 8
#define MAX_R (QT * MAX_G)
#define MAX_D 128
#define KC 64 /* keys a chunk of the online softmax */
#define TV 8  /* vectors a score or value tile */

/* S[a][j0 + j] = q's vector r0 + a . key j0 + j, a < TV, j < 16 RUNS: per pair of
 * dimensions p, each run's 16 keys of p are 64 contiguous bytes (`pair_stride` elements
 * between pairs) and each vector's pair one broadcast. */
static inline __attribute__((always_inline)) void
score_tile(const uint16_t *qb, const int D, const uint16_t *run0, const uint16_t *run1,
           const int RUNS, const size_t pair_stride, float *s, const int j0) {
    __m512 acc0[TV], acc1[TV];
#pragma GCC unroll 8
    for (int a = 0; a < TV; a++) acc0[a] = acc1[a] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; p++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(run0 + (size_t)p * pair_stride);
        const __m512bh k1 =
            RUNS > 1 ? (__m512bh)_mm512_loadu_si512(run1 + (size_t)p * pair_stride) : k0;
#pragma GCC unroll 8
        for (int a = 0; a < TV; a++) {
            int pair;
            memcpy(&pair, qb + (size_t)a * D + 2 * p, sizeof pair);
            const __m512bh qa = (__m512bh)_mm512_set1_epi32(pair);
            acc0[a] = _mm512_dpbf16_ps(acc0[a], qa, k0);
            if (RUNS > 1) acc1[a] = _mm512_dpbf16_ps(acc1[a], qa, k1);
        }
    }
#pragma GCC unroll 8
    for (int a = 0; a < TV; a++) {
        _mm512_storeu_ps(s + (size_t)a * KC + j0, acc0[a]);
        if (RUNS > 1) _mm512_storeu_ps(s + (size_t)a * KC + j0 + 16, acc1[a]);
    }
}

/* O[r0 + a][d0 .. d0 + 31] = O * alpha + P V over the chunk's `pairs` pairs of keys. */
static inline void value_tile(const uint16_t *p, const uint16_t *vp, const float *alpha,
                              const int pairs, const int D, const int d0, float *o) {
    __m512 acc[TV][2];
#pragma GCC unroll 8
    for (int a = 0; a < TV; a++) {
        const __m512 al = _mm512_set1_ps(alpha[a]);
        for (int c = 0; c < 2; c++)
            acc[a][c] = _mm512_mul_ps(al, _mm512_loadu_ps(o + (size_t)a * D + d0 + 16 * c));
    }
    for (int j = 0; j < pairs; j++) {
        const uint16_t *vj = vp + (size_t)j * 2 * D + 2 * (size_t)d0; /* [D / 16][16][2] */
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vj);
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vj + 32);
#pragma GCC unroll 8
        for (int a = 0; a < TV; a++) {
            int pair;
            memcpy(&pair, p + (size_t)a * KC + 2 * j, sizeof pair);
            const __m512bh pa = (__m512bh)_mm512_set1_epi32(pair);
            acc[a][0] = _mm512_dpbf16_ps(acc[a][0], pa, v0);
            acc[a][1] = _mm512_dpbf16_ps(acc[a][1], pa, v1);
        }
    }
    for (int a = 0; a < TV; a++)
        for (int c = 0; c < 2; c++) _mm512_storeu_ps(o + (size_t)a * D + d0 + 16 * c, acc[a][c]);
}

/* The chunk's values from key k0 on, `n` of them (the rest of its pairs zero), as pairs of
 * keys: vp[j][c][i][e] = V[k0 + 2 j + e][16 c + i] (one vector a pair and 16 dimensions). */
static void interleave_values(const uint16_t *v_cache, const int32_t *table, const int k0,
                              const int n, const int h, const int KVH, const int BS,
                              const int D, uint16_t *vp) {
    static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                        37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                        11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_loadu_si512(lo_idx);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int j = 0; j < (n + 1) / 2; j++) {
        const uint16_t *row[2];
        for (int e = 0; e < 2; e++) {
            const int key = k0 + 2 * j + e;
            row[e] = 2 * j + e < n ? v_cache + (((size_t)table[key / BS] * KVH + h) * BS +
                                                (size_t)(key % BS)) * D
                                   : NULL;
        }
        for (int d = 0; d < D; d += 32) {
            const __m512i a = _mm512_loadu_si512(row[0] + d);
            const __m512i b = row[1] ? _mm512_loadu_si512(row[1] + d) : _mm512_setzero_si512();
            uint16_t *out = vp + (size_t)j * D * 2 + (size_t)d * 2;
            _mm512_storeu_si512(out, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

/* A thread's scratch for its tiles (~90 KB: on the heap, not an OpenMP thread's stack,
 * which OMP_STACKSIZE may make small). */
struct scratch {
    uint16_t qb[MAX_R * MAX_D]; /* q * scale in bfloat16, vector r = t G + g */
    float s[MAX_R * KC];        /* a chunk's scores, then their exponentials */
    uint16_t p[MAX_R * KC];     /* the softmax's weights in bfloat16 */
    uint16_t vp[KC * MAX_D];    /* the chunk's values in pairs of keys */
    float o[MAX_R * MAX_D];     /* the running outputs */
    float m[MAX_R], l[MAX_R], alpha[MAX_R];
};

/* One tile: rows t0 .. t0 + rows - 1 of the chunk, query heads h G .. h G + G - 1. */
static void tile(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                 const int32_t *table, const int t0, const int rows, const int num_context,
                 const int H, const int KVH, const int D, const int BS, const int h, const int G,
                 const float scale, float *out, struct scratch *w) {
    const int R = ((rows * G + TV - 1) / TV) * TV; /* vectors, padded to whole tiles */
    uint16_t *qb = w->qb, *p = w->p, *vp = w->vp;
    float *s = w->s, *o = w->o, *m = w->m, *l = w->l, *alpha = w->alpha;
    /* vector r = t G + g: row t0 + t, query head h G + g */
    for (int r = 0; r < R; r++) {
        const int t = r / G, g = r % G;
        const float *qr = q + ((size_t)(t0 + t) * H + (size_t)h * G + g) * D;
        for (int d = 0; d < D; d++) qb[(size_t)r * D + d] = t < rows ? to_bf16(qr[d] * scale) : 0;
        m[r] = -FLT_MAX;
        l[r] = 0.0f;
    }
    memset(o, 0, sizeof(float) * (size_t)R * D);
    const int last = num_context + t0 + rows - 1; /* the tile's last row's position */
    const size_t pair_stride = (size_t)BS * 2;
    for (int k0 = 0; k0 <= last; k0 += KC) {
        const int nk = last + 1 - k0 < KC ? last + 1 - k0 : KC;
        /* scores, 32 keys (two runs of 16) a tile */
        for (int j0 = 0; j0 < nk; j0 += 32) {
            const int runs = nk - j0 > 16 ? 2 : 1;
            const uint16_t *run[2] = {NULL, NULL};
            for (int u = 0; u < runs; u++) {
                const int key = k0 + j0 + 16 * u;
                run[u] = k_cache + (((size_t)table[key / BS] * KVH + h) * (size_t)(D / 2) * BS +
                                    (size_t)(key % BS)) * 2;
            }
            for (int r0 = 0; r0 < R; r0 += TV) {
                const uint16_t *qr = qb + (size_t)r0 * D;
                float *sr = s + (size_t)r0 * KC;
                if (runs == 2) score_tile(qr, D, run[0], run[1], 2, pair_stride, sr, j0);
                else score_tile(qr, D, run[0], NULL, 1, pair_stride, sr, j0);
            }
        }
        /* online softmax: a row sees keys up to its own position */
        for (int r = 0; r < R; r++) {
            const int t = r / G;
            const int seen = t < rows ? num_context + t0 + t + 1 - k0 : 0;
            const int vis = seen < nk ? seen : nk;
            float *sr = s + (size_t)r * KC;
            uint16_t *pr = p + (size_t)r * KC;
            if (vis <= 0) {
                alpha[r] = 1.0f;
                memset(pr, 0, sizeof(uint16_t) * KC);
                continue;
            }
            for (int j = vis; j < KC; j++) sr[j] = -FLT_MAX; /* exp: 0 */
            __m512 top = _mm512_set1_ps(m[r]);
            for (int c = 0; c < KC / 16; c++) top = _mm512_max_ps(top, _mm512_loadu_ps(sr + 16 * c));
            const float mx = _mm512_reduce_max_ps(top);
            /* a row's first chunk: nothing to rescale (and no underflow for expf's slow
             * path to take) */
            alpha[r] = m[r] == -FLT_MAX ? 0.0f : expf(m[r] - mx);
            m[r] = mx;
            for (int j = 0; j < KC; j++) sr[j] = expf(sr[j] - mx);
            __m512 sums = _mm512_setzero_ps();
            for (int c = 0; c < KC / 16; c++) { /* rounded to nearest even, as to_bf16 */
                const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sr + 16 * c));
                _mm256_storeu_si256((__m256i *)(pr + 16 * c), b);
                sums = _mm512_add_ps(
                    sums, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
            }
            const float sum = _mm512_reduce_add_ps(sums);
            l[r] = l[r] * alpha[r] + sum;
        }
        interleave_values(v_cache, table, k0, nk, h, KVH, BS, D, vp);
        for (int r0 = 0; r0 < R; r0 += TV)
            for (int d0 = 0; d0 < D; d0 += 32)
                value_tile(p + (size_t)r0 * KC, vp, alpha + r0, (nk + 1) / 2, D, d0,
                           o + (size_t)r0 * D);
    }
    for (int r = 0; r < rows * G; r++) {
        const int t = r / G, g = r % G;
        float *dst = out + ((size_t)(t0 + t) * H + (size_t)h * G + g) * D;
        const float inv = 1.0f / l[r];
        for (int d = 0; d < D; d++) dst[d] = o[(size_t)r * D + d] * inv;
    }
}

int kvflow_prefill_attention_bf16p(const float *q, const void *k_cache, const void *v_cache,
                                   const int32_t *block_table, int T, int num_context, int H,
                                   int KVH, int D, int BS, float *out, float scale) {
    const int G = KVH > 0 ? H / KVH : 0;
    if (G < 1 || G > MAX_G || G * KVH != H || D % 32 || D > MAX_D || BS % 16) return 2;
    const int tiles = (T + QT - 1) / QT;
    int failed = 0;
#pragma omp parallel
    {
        struct scratch *w = aligned_alloc(64, (sizeof(struct scratch) + 63) / 64 * 64);
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < KVH * tiles; task++) {
            /* the last tiles (the most keys) first */
            const int t = tiles - 1 - task / KVH, h = task % KVH;
            const int rows = T - t * QT < QT ? T - t * QT : QT;
            if (w != NULL)
                tile(q, k_cache, v_cache, block_table, t * QT, rows, num_context, H, KVH, D, BS,
                     h, G, scale, out, w);
        }
        free(w);
    }
    return failed;
}

int kvflow_prefill_pairs_built(void) { return 1; }
#else
int kvflow_prefill_attention_bf16p(const float *q, const void *k_cache, const void *v_cache,
                                   const int32_t *block_table, int T, int num_context, int H,
                                   int KVH, int D, int BS, float *out, float scale) {
    (void)q, (void)k_cache, (void)v_cache, (void)block_table, (void)T, (void)num_context;
    (void)H, (void)KVH, (void)D, (void)BS, (void)out, (void)scale;
    return 3; /* not built for this CPU (no avx512_bf16) */
}

int kvflow_prefill_pairs_built(void) { return 0; }
#endif
