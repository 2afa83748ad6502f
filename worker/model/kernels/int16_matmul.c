/* Float32 linear layers as 16-bit integer products on a CPU with AVX2 but no bfloat16.
 *
 * Without native bfloat16 (or integer dot products into 32 bits) a float32 matmul is
 * bound by the FMA units: 8 products per instruction. vpmaddwd multiplies 16 pairs of
 * int16 and adds neighbours into 8 int32 lanes: twice the products per instruction, and
 * exact. The operands are rounded to integers first, finer than bfloat16 rounds them:
 *
 *   wq [N / 8, K / 2, 8, 2] int16, wq[b][p][j][e] = round(W[8 b + j][2 p + e] / ws[8 b + j]),
 *      |wq| <= W_MAX, one float32 scale per output column (ws [N]);
 *   x rounded per call to int16 (|xq| <= X_MAX), one float32 scale per row and block of
 *      KB inputs (xs [M, ceil(K / KB)]): an outlier of a row widens the step of its own
 *      block only. xq is scratch the caller gives: [ceil(M / 4) * 4, K] int16.
 *
 * A block's products are summed in int32: KB * W_MAX * X_MAX < 2^31, so no sum
 * overflows, whatever the inputs. Each block's sums are then scaled by the row's block
 * scale and added in float32; the column scale multiplies the total once.
 *
 * Weights: per output column, 14 bits (relative step 2^-13 of the column's largest
 * weight); bfloat16 keeps 8 significant bits of each. Inputs: 13 bits per block of 64.
 *
 * Tiles of MR = 2 rows x NR = 6 column blocks (48 columns): 12 int32 accumulators; per
 * pair of inputs 2 broadcasts, 12 vpmaddwd with the weights as memory operands and 12
 * vpaddd. The full tile's loop is written in assembly: with intrinsics gcc spilled
 * accumulators to the stack (4 x 3: 66-69 GOP/s on one thread, 4 x 2 in intrinsics
 * 102-104, AMD EPYC Zen 3, the default model's four decoder shapes at 64 rows; float32
 * through oneDNN 63-67 GFLOP/s). That core runs 2 vpmaddwd a cycle alone, but only
 * ~1.5-1.6 vpmaddwd + vpaddd pairs, and a broadcast competes for the same vector pipes;
 * so the tile is as wide as the registers allow, to broadcast as few inputs as it can (1
 * per 6 vpmaddwd against 1 per 3 in the 4 x 3 tile before it), and a block's sums go to
 * the float32 totals from the registers they were made in (4 x 3 tiles stored them
 * first). The 4 x 3 tile ran at ~112-126 GOP/s a core; this one took 0.92x its time at
 * 32-2,048 rows (2 threads, 257-275 GOP/s: ~1.35 vpmaddwd a cycle a core, the rounding
 * of the inputs included), the same at 1-8.
 * Threads split the column panels; the rows go through in chunks of I16_MC so that a
 * chunk's inputs stay in L2 while every panel passes over them.
 *
 * Only a panel's first row tile reads its weights from memory (192 bytes a pair of
 * inputs for 12 vpmaddwd: far past a core's share of the memory's pace), the rest from
 * L2, so at a few dozen rows the weights' stream and the arithmetic ran one after the
 * other. The later row tiles ask for the next panel into L2 as they go (ask_share: one
 * prefetcht1 a pair in the loop below). Measured through this build on an AMD EPYC Zen 4
 * (x86-64-v3; not on a CPU whose own build it is), the decoder's 120 matmuls of random
 * weights (212 MB), 2 threads, medians of 9, both versions alternating in one process,
 * three runs: 0.80-0.84x the time at 8-16 rows, 0.88x at 24, 0.90-0.91x at 32, 0.94-0.96x
 * at 48-64, 0.97x at 128, 0.92x at 6, 0.97-1.01x at 1-4 (three lines a pair,
 * to cover the longer shares of few tiles: 1.07x at 4 rows and 1.05x at 64, the loop
 * then bound by its loads).
 *
 * Measured there with the 4 x 2 tile (2 threads, the four shapes of a decoder layer,
 * rounding of the inputs included): 0.44x / 0.47x / 0.52x / 0.61x / 0.71x the time of
 * float32 through oneDNN with packed weights at 1 / 8 / 16 / 64 / 512 rows (217 GOP/s at
 * 512 rows against 149 GFLOP/s); the error against float64 a fifth of bfloat16's
 * (relative 5e-4 against 2.7e-3 over random inputs with an outlier column).
 *
 * On a CPU with AVX-512 VNNI the kernel is int16_matmul_vnni.c's (the same rounding, here
 * and in int16.h, and the same sums; column blocks of 16): this file then builds only
 * the rounding of the inputs.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "int16.h"
#include "entries.h"
#include "share.h"
#include "silu.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* A block's step from the bits of its largest |x| (`top`): max |x| / X_MAX, at least
 * FLT_MIN (a block of zeros or denormals keeps a finite inverse); NaN where the block
 * holds a NaN or infinity, so that the row's outputs are NaN. */
static inline float block_scale(uint32_t top) {
    float amax, scale;
    memcpy(&amax, &top, sizeof amax);
    if (top >= 0x7f800000u) {
        const uint32_t nan = 0x7fc00000u;
        memcpy(&scale, &nan, sizeof scale);
    } else {
        scale = fmaxf(amax * (1.0f / X_MAX), FLT_MIN);
    }
    return scale;
}

/* One row's block of n inputs (the last block of a row whose K is not a multiple of KB)
 * into its slots of dst (pair p at dst[4 p]). */
static void quantize_tail(const float *xr, uint32_t *dst, float *scale_out, int n) {
    uint32_t top = 0; /* the largest |x| by its bits: NaN and infinity above every finite */
    for (int k = 0; k < n; k++) {
        uint32_t bits;
        memcpy(&bits, xr + k, sizeof bits);
        bits &= 0x7fffffffu;
        top = bits > top ? bits : top;
    }
    const float scale = block_scale(top), inv = 1.0f / scale;
    for (int k = 0; k < n; k += 2) {
        const uint16_t lo = (uint16_t)(int16_t)lrintf(xr[k] * inv);
        const uint16_t hi = (uint16_t)(int16_t)lrintf(xr[k + 1] * inv);
        dst[(size_t)(k / 2) * 4] = lo | (uint32_t)hi << 16;
    }
    *scale_out = scale;
}

/* One row's full block of KB inputs -> its 32 pairs of int16 as 4 vectors of 8 (pair 8 j
 * + i in lane i of q[j]), rounded to nearest even as lrintf rounds; its step to
 * *scale_out. */
static inline void quantize_block(const float *xr, __m256i q[4], float *scale_out) {
    __m256 v[8];
    __m256i top = _mm256_setzero_si256();
    const __m256i abs_bits = _mm256_set1_epi32(0x7fffffff);
    for (int i = 0; i < 8; i++) {
        v[i] = _mm256_loadu_ps(xr + 8 * i);
        /* |x| compared by its bits (as unsigned): NaN and infinity above every finite */
        top = _mm256_max_epu32(top, _mm256_and_si256(_mm256_castps_si256(v[i]), abs_bits));
    }
    __m128i h = _mm_max_epu32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xb1));
    const float scale = block_scale((uint32_t)_mm_cvtsi128_si32(h));
    const __m256 inv = _mm256_set1_ps(1.0f / scale);
    for (int j = 0; j < 4; j++) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j], inv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j + 1], inv));
        /* packs interleaves 128-bit halves (a0-3 b0-3 a4-7 b4-7): put them back in order */
        q[j] = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);
    }
    *scale_out = scale;
}

/* silu(gate) * up for n inputs of a row (silu.h, as kvflow_silu_mul computes them). */
static inline __attribute__((always_inline)) void silu_block(const float *restrict g,
                                                            const float *restrict u,
                                                            float *restrict dst, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) dst[i] = silu_times(g[i], u[i]);
}

/* Per row and block of KB inputs: scale = max |x| / X_MAX, xq = round(x / scale). The
 * rounded rows are written four at a time, pair by pair, as the tiles read them:
 * xq [ceil(M / 4)][K / 2][4] pairs of int16 (the last group's slots past M zeros, or
 * unwritten in a block short of KB: never read, the edge tiles read their own rows
 * only), so a tile's broadcasts of a step lie in one 16-byte run. A group's full
 * blocks are rounded in vectors and its four rows' pairs interleaved by a transpose.
 * Row m of x starts at x + m * ldx. With `silu` (a literal where this is inlined) the
 * inputs are silu(gate) * up of rows [gate (K), up (K)], computed a block at a time on
 * the stack: the MLP's [M, K] product is never written out and read back (at 2,048 rows
 * and K = 1,536, 25 MB of a prompt step's memory traffic a layer). */
static inline __attribute__((always_inline)) void quantize_rows(const float *x, long ldx,
                                                               int16_t *xq, float *xs, int M,
                                                               int K, const int silu) {
    const int nkb = (K + KB - 1) / KB, P = K / 2, groups = (M + 3) / 4;
    uint32_t *xp = (uint32_t *)xq;
#pragma omp parallel for schedule(static) if ((long)M * K > 32768)
    for (int g = 0; g < groups; g++) {
        const int rows = M - 4 * g < 4 ? M - 4 * g : 4;
        uint32_t *dst = xp + (size_t)g * P * 4;
        float buf[KB];
        for (int kb = 0; kb < nkb; kb++) {
            const int n = K - kb * KB < KB ? K - kb * KB : KB;
            const float *src[4];
            for (int r = 0; r < rows; r++) {
                src[r] = x + (size_t)(4 * g + r) * ldx + kb * KB;
            }
            if (n < KB) {
                for (int r = 0; r < rows; r++) {
                    if (silu) silu_block(src[r], src[r] + K, buf, n);
                    quantize_tail(silu ? buf : src[r], dst + (size_t)kb * (KB / 2) * 4 + r,
                                  xs + (size_t)(4 * g + r) * nkb + kb, n);
                }
                continue;
            }
            __m256i q[4][4]; /* [row][j]: pairs 8 j .. 8 j + 7 of the block */
            for (int r = 0; r < 4; r++) {
                if (r < rows) {
                    if (silu) silu_block(src[r], src[r] + K, buf, KB);
                    quantize_block(silu ? buf : src[r], q[r],
                                   xs + (size_t)(4 * g + r) * nkb + kb);
                } else {
                    q[r][0] = q[r][1] = q[r][2] = q[r][3] = _mm256_setzero_si256();
                }
            }
            /* 4 rows x 8 pairs -> pair-major runs of 4 rows: a 4 x 4 transpose of uint32
             * in each 128-bit half (pairs i and i + 4), then the halves regrouped */
            uint32_t *out = dst + (size_t)kb * (KB / 2) * 4;
            for (int j = 0; j < 4; j++) {
                const __m256i t0 = _mm256_unpacklo_epi32(q[0][j], q[1][j]);
                const __m256i t1 = _mm256_unpackhi_epi32(q[0][j], q[1][j]);
                const __m256i t2 = _mm256_unpacklo_epi32(q[2][j], q[3][j]);
                const __m256i t3 = _mm256_unpackhi_epi32(q[2][j], q[3][j]);
                const __m256i u0 = _mm256_unpacklo_epi64(t0, t2); /* pairs 0 and 4 */
                const __m256i u1 = _mm256_unpackhi_epi64(t0, t2); /* 1 and 5 */
                const __m256i u2 = _mm256_unpacklo_epi64(t1, t3); /* 2 and 6 */
                const __m256i u3 = _mm256_unpackhi_epi64(t1, t3); /* 3 and 7 */
                __m256i *o = (__m256i *)(out + (size_t)j * 32);
                _mm256_storeu_si256(o, _mm256_permute2x128_si256(u0, u1, 0x20));
                _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(u2, u3, 0x20));
                _mm256_storeu_si256(o + 2, _mm256_permute2x128_si256(u0, u1, 0x31));
                _mm256_storeu_si256(o + 3, _mm256_permute2x128_si256(u2, u3, 0x31));
            }
        }
    }
}

#endif

#if defined(__AVX2__) && defined(__FMA__) && !I16_VNNI
#define MR 2 /* rows a tile: half a group of four in xq */
#define NR I16_NR

/* A block's int32 sums into the float32 totals, each row's by its block scale. */
static inline __attribute__((always_inline)) void
add_block(float total[MR][NR][8], const __m256i acc[MR][NR], const float *restrict xs, int nkb,
          int m0, int kb, const int mr, const int nr) {
    for (int m = 0; m < mr; m++) {
        const __m256 s = _mm256_set1_ps(xs[(size_t)(m0 + m) * nkb + kb]);
        for (int n = 0; n < nr; n++)
            _mm256_store_ps(total[m][n], _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][n]), s,
                                                         _mm256_load_ps(total[m][n])));
    }
}

/* The totals times the column scales (+ bias) into out. */
static inline __attribute__((always_inline)) void
store_tile(float total[MR][NR][8], const float *restrict ws, const float *restrict bias,
           float *restrict out, int N, int m0, int b0, const int mr, const int nr) {
    for (int n = 0; n < nr; n++) {
        const __m256 c = _mm256_loadu_ps(ws + (size_t)(b0 + n) * 8);
        const __m256 add =
            bias ? _mm256_loadu_ps(bias + (size_t)(b0 + n) * 8) : _mm256_setzero_ps();
        for (int m = 0; m < mr; m++)
            _mm256_storeu_ps(out + (size_t)(m0 + m) * N + (size_t)(b0 + n) * 8,
                             _mm256_fmadd_ps(_mm256_load_ps(total[m][n]), c, add));
    }
}

/* Rows m0..m0+mr-1 (m0 even) x column blocks b0..b0+nr-1 over all K (mr, nr literals
 * where inlined); the tiles short of 2 x 6 at the edges. */
static inline __attribute__((always_inline)) void
tile(const int16_t *restrict xq, const float *restrict xs, const int16_t *restrict wq,
     const float *restrict ws, const float *restrict bias, float *restrict out, int K, int N,
     int nkb, int m0, int b0, const int mr, const int nr) {
    float total[MR][NR][8] __attribute__((aligned(32)));
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) _mm256_store_ps(total[m][n], _mm256_setzero_ps());
    const size_t wstride = (size_t)K * 8; /* int16 per column block */
    for (int kb = 0; kb < nkb; kb++) {
        const int p0 = kb * (KB / 2), p1 = (K / 2 < p0 + KB / 2) ? K / 2 : p0 + KB / 2;
        __m256i acc[MR][NR];
        for (int m = 0; m < mr; m++)
            for (int n = 0; n < nr; n++) acc[m][n] = _mm256_setzero_si256();
        for (int p = p0; p < p1; p++) {
            __m256i w[NR];
            for (int n = 0; n < nr; n++)
                w[n] = _mm256_loadu_si256(
                    (const __m256i *)(wq + (size_t)(b0 + n) * wstride + (size_t)p * 16));
            for (int m = 0; m < mr; m++) {
                const __m256i pair = _mm256_set1_epi32(
                    ((const int32_t *)xq)[((size_t)(m0 / 4) * (K / 2) + p) * 4 + m0 % 4 + m]);
                for (int n = 0; n < nr; n++)
                    acc[m][n] = _mm256_add_epi32(acc[m][n], _mm256_madd_epi16(pair, w[n]));
            }
        }
        add_block(total, acc, xs, nkb, m0, kb, mr, nr);
    }
    store_tile(total, ws, bias, out, N, m0, b0, mr, nr);
}

/* What row tile t (of `tiles`) of a panel asks for as it goes: tile26's pair loop issues
 * one prefetcht1 a pair at *pf, then steps it by *pfs bytes. Only a panel's first row
 * tile reads it from memory; the tiles after it, which read it from L2, each ask for an
 * equal share of the `ask` bytes at `next` (the next panel's weights; NULL: none),
 * spread over their P pairs (a step of at most a line: where a share is longer, its first
 * P lines). Otherwise one line of the panel itself again and again (pfs 0), already
 * there. */
static inline void ask_share(const int16_t *wq, const char *next, size_t ask, long P, int t,
                             int tiles, const char **pf, long *pfs) {
    *pf = (const char *)wq;
    *pfs = 0;
    if (next == NULL || t == 0 || tiles < 2) return;
    size_t len;
    *pf = next_share(next, ask, t, tiles, &len);
    const long step = ((long)len + P - 1) / P;
    *pfs = step < 64 ? step : 64;
}

/* The full tile, 2 rows x 6 column blocks, in assembly: ymm0-5 row 0's accumulators,
 * ymm6-11 row 1's, ymm12-13 the broadcast pairs, ymm14-15 the products; a block's sums
 * are added to the totals (in memory, [2][6][8] float32) times the rows' block scales as
 * add_block adds them. The same sums in the same order as `tile`, so a row's result does
 * not depend on which tile it falls in. */
static inline __attribute__((always_inline)) void
tile26(const int16_t *restrict xq, const float *restrict xs, const int16_t *restrict wq,
       const float *restrict ws, const float *restrict bias, float *restrict out, int K, int N,
       int nkb, int m0, int b0, const char *pf, long pfs) {
    float total[MR][NR][8] __attribute__((aligned(32)));
    memset(total, 0, sizeof(total));
    const size_t wstride = (size_t)K * 8;
    const long ws2 = (long)wstride * 2; /* bytes per column block */
    for (int kb = 0; kb < nkb; kb++) {
        const int p0 = kb * (KB / 2), p1 = (K / 2 < p0 + KB / 2) ? K / 2 : p0 + KB / 2;
        const int16_t *w0 = wq + (size_t)b0 * wstride + (size_t)p0 * 16;
        const int16_t *v0 = w0 + 3 * wstride; /* column blocks 3-5 */
        const int32_t *x0 = (const int32_t *)xq + ((size_t)(m0 / 4) * (K / 2) + p0) * 4 + m0 % 4;
        const int32_t *xend = x0 + (size_t)(p1 - p0) * 4;
        __asm__ volatile(
            "vpxor %%xmm0, %%xmm0, %%xmm0\n\t"
            "vpxor %%xmm1, %%xmm1, %%xmm1\n\t"
            "vpxor %%xmm2, %%xmm2, %%xmm2\n\t"
            "vpxor %%xmm3, %%xmm3, %%xmm3\n\t"
            "vpxor %%xmm4, %%xmm4, %%xmm4\n\t"
            "vpxor %%xmm5, %%xmm5, %%xmm5\n\t"
            "vpxor %%xmm6, %%xmm6, %%xmm6\n\t"
            "vpxor %%xmm7, %%xmm7, %%xmm7\n\t"
            "vpxor %%xmm8, %%xmm8, %%xmm8\n\t"
            "vpxor %%xmm9, %%xmm9, %%xmm9\n\t"
            "vpxor %%xmm10, %%xmm10, %%xmm10\n\t"
            "vpxor %%xmm11, %%xmm11, %%xmm11\n\t"
            "1:\n\t"
            "prefetcht1 (%[pf])\n\t"
            "add %[pfs], %[pf]\n\t"
            "vpbroadcastd (%[x]), %%ymm12\n\t"
            "vpbroadcastd 4(%[x]), %%ymm13\n\t"
            "vpmaddwd (%[w]), %%ymm12, %%ymm14\n\t"
            "vpaddd %%ymm14, %%ymm0, %%ymm0\n\t"
            "vpmaddwd (%[w],%[ws]), %%ymm12, %%ymm15\n\t"
            "vpaddd %%ymm15, %%ymm1, %%ymm1\n\t"
            "vpmaddwd (%[w],%[ws],2), %%ymm12, %%ymm14\n\t"
            "vpaddd %%ymm14, %%ymm2, %%ymm2\n\t"
            "vpmaddwd (%[v]), %%ymm12, %%ymm15\n\t"
            "vpaddd %%ymm15, %%ymm3, %%ymm3\n\t"
            "vpmaddwd (%[v],%[ws]), %%ymm12, %%ymm14\n\t"
            "vpaddd %%ymm14, %%ymm4, %%ymm4\n\t"
            "vpmaddwd (%[v],%[ws],2), %%ymm12, %%ymm15\n\t"
            "vpaddd %%ymm15, %%ymm5, %%ymm5\n\t"
            "vpmaddwd (%[w]), %%ymm13, %%ymm14\n\t"
            "vpaddd %%ymm14, %%ymm6, %%ymm6\n\t"
            "vpmaddwd (%[w],%[ws]), %%ymm13, %%ymm15\n\t"
            "vpaddd %%ymm15, %%ymm7, %%ymm7\n\t"
            "vpmaddwd (%[w],%[ws],2), %%ymm13, %%ymm14\n\t"
            "vpaddd %%ymm14, %%ymm8, %%ymm8\n\t"
            "vpmaddwd (%[v]), %%ymm13, %%ymm15\n\t"
            "vpaddd %%ymm15, %%ymm9, %%ymm9\n\t"
            "vpmaddwd (%[v],%[ws]), %%ymm13, %%ymm14\n\t"
            "vpaddd %%ymm14, %%ymm10, %%ymm10\n\t"
            "vpmaddwd (%[v],%[ws],2), %%ymm13, %%ymm15\n\t"
            "vpaddd %%ymm15, %%ymm11, %%ymm11\n\t"
            "add $16, %[x]\n\t"
            "add $32, %[w]\n\t"
            "add $32, %[v]\n\t"
            "cmp %[xend], %[x]\n\t"
            "jne 1b\n\t"
            "vbroadcastss (%[s0]), %%ymm12\n\t"
            "vbroadcastss (%[s1]), %%ymm13\n\t"
            "vcvtdq2ps %%ymm0, %%ymm0\n\t"
            "vfmadd213ps 0(%[total]), %%ymm12, %%ymm0\n\t"
            "vmovaps %%ymm0, 0(%[total])\n\t"
            "vcvtdq2ps %%ymm1, %%ymm1\n\t"
            "vfmadd213ps 32(%[total]), %%ymm12, %%ymm1\n\t"
            "vmovaps %%ymm1, 32(%[total])\n\t"
            "vcvtdq2ps %%ymm2, %%ymm2\n\t"
            "vfmadd213ps 64(%[total]), %%ymm12, %%ymm2\n\t"
            "vmovaps %%ymm2, 64(%[total])\n\t"
            "vcvtdq2ps %%ymm3, %%ymm3\n\t"
            "vfmadd213ps 96(%[total]), %%ymm12, %%ymm3\n\t"
            "vmovaps %%ymm3, 96(%[total])\n\t"
            "vcvtdq2ps %%ymm4, %%ymm4\n\t"
            "vfmadd213ps 128(%[total]), %%ymm12, %%ymm4\n\t"
            "vmovaps %%ymm4, 128(%[total])\n\t"
            "vcvtdq2ps %%ymm5, %%ymm5\n\t"
            "vfmadd213ps 160(%[total]), %%ymm12, %%ymm5\n\t"
            "vmovaps %%ymm5, 160(%[total])\n\t"
            "vcvtdq2ps %%ymm6, %%ymm6\n\t"
            "vfmadd213ps 192(%[total]), %%ymm13, %%ymm6\n\t"
            "vmovaps %%ymm6, 192(%[total])\n\t"
            "vcvtdq2ps %%ymm7, %%ymm7\n\t"
            "vfmadd213ps 224(%[total]), %%ymm13, %%ymm7\n\t"
            "vmovaps %%ymm7, 224(%[total])\n\t"
            "vcvtdq2ps %%ymm8, %%ymm8\n\t"
            "vfmadd213ps 256(%[total]), %%ymm13, %%ymm8\n\t"
            "vmovaps %%ymm8, 256(%[total])\n\t"
            "vcvtdq2ps %%ymm9, %%ymm9\n\t"
            "vfmadd213ps 288(%[total]), %%ymm13, %%ymm9\n\t"
            "vmovaps %%ymm9, 288(%[total])\n\t"
            "vcvtdq2ps %%ymm10, %%ymm10\n\t"
            "vfmadd213ps 320(%[total]), %%ymm13, %%ymm10\n\t"
            "vmovaps %%ymm10, 320(%[total])\n\t"
            "vcvtdq2ps %%ymm11, %%ymm11\n\t"
            "vfmadd213ps 352(%[total]), %%ymm13, %%ymm11\n\t"
            "vmovaps %%ymm11, 352(%[total])\n\t"
            : [x] "+r"(x0), [w] "+r"(w0), [v] "+r"(v0), [pf] "+r"(pf)
            : [xend] "r"(xend), [ws] "r"(ws2), [total] "r"(total), [pfs] "r"(pfs),
              [s0] "r"(xs + (size_t)m0 * nkb + kb), [s1] "r"(xs + (size_t)(m0 + 1) * nkb + kb)
            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
              "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc");
    }
    store_tile(total, ws, bias, out, N, m0, b0, MR, NR);
}

#define TILE(MV, NV) tile(xq, xs, wq, ws, bias, out, K, N, nkb, m, b, MV, NV)
#define ROWS_CASE(MV)                                                                   \
    case MV:                                                                            \
        if (MV == 2 && nr == 6) tile26(xq, xs, wq, ws, bias, out, K, N, nkb, m, b, pf, pfs); \
        else if (nr == 6) TILE(MV, 6);                                                  \
        else if (nr == 5) TILE(MV, 5);                                                  \
        else if (nr == 4) TILE(MV, 4);                                                  \
        else if (nr == 3) TILE(MV, 3);                                                  \
        else if (nr == 2) TILE(MV, 2);                                                  \
        else TILE(MV, 1);                                                               \
        break;

void kvflow_i16_panel(const int16_t *xq, const float *xs, const int16_t *wq, const float *ws,
                      const float *bias, float *out, int K, int N, int nkb, int mc, int mend,
                      int b, int nr, const char *next, size_t ask) {
    const int tiles = (mend - mc + MR - 1) / MR;
    for (int m = mc; m < mend; m += MR) {
        const char *pf;
        long pfs;
        ask_share(wq, next, ask, K / 2, (m - mc) / MR, tiles, &pf, &pfs);
        switch (mend - m < MR ? mend - m : MR) {
            ROWS_CASE(2) ROWS_CASE(1)
        }
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* out [M, N] float32 = x [M, K] float32 @ W.T (+ bias [N], or NULL), W given as wq and ws
 * (above); xq [ceil(M / 4) * 4, K] int16 and xs [M, ceil(K / KB)] float32 are scratch for
 * x's rounding. Threads split the column panels; the rows go through in chunks of
 * I16_MC, each chunk's tiles from the build's kvflow_i16_panel. */
static void linear_tiles(const int16_t *xq, const float *xs, const int16_t *wq, const float *ws,
                         const float *bias, float *out, int M, int N, int K) {
    const int nkb = (K + KB - 1) / KB, blocks = N / I16_LANES;
    const int panels = (blocks + I16_NR - 1) / I16_NR;
#pragma omp parallel
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int lo = (int)((long)panels * id / nt), hi = (int)((long)panels * (id + 1) / nt);
        for (int mc = 0; mc < M; mc += I16_MC) {
            const int mend = mc + I16_MC < M ? mc + I16_MC : M;
            for (int pn = lo; pn < hi; pn++) {
                const int b = pn * I16_NR, nr = blocks - b < I16_NR ? blocks - b : I16_NR;
                /* the next panel of this thread's share: its blocks follow on */
                const int left = blocks - b - nr;
                const int nb = pn + 1 < hi ? (left < I16_NR ? left : I16_NR) : 0;
                const char *next = (const char *)(wq + (size_t)(b + nr) * K * I16_LANES);
                const size_t ask = (size_t)nb * K * I16_LANES * sizeof(int16_t);
                kvflow_i16_panel(xq, xs, wq, ws, bias, out, K, N, nkb, mc, mend, b, nr,
                                 nb ? next : NULL, ask);
            }
        }
    }
}

int kvflow_linear_i16(const float *x, int16_t *xq, float *xs, const int16_t *wq,
                      const float *ws, const float *bias, float *out, int M, int N, int K) {
    if (M < 0 || N % I16_LANES != 0 || K < 2 || K % 2 != 0) return 1;
    quantize_rows(x, K, xq, xs, M, K, 0);
    linear_tiles(xq, xs, wq, ws, bias, out, M, N, K);
    return 0;
}

/* The same with x = silu(gate) * up of gate_up [M, 2 K] (gate, then up): the MLP's down
 * projection straight from the gate and up projection's output (quantize_rows says why). */
int kvflow_linear_i16_silu(const float *gate_up, int16_t *xq, float *xs, const int16_t *wq,
                           const float *ws, const float *bias, float *out, int M, int N, int K) {
    if (M < 0 || N % I16_LANES != 0 || K < 2 || K % 2 != 0) return 1;
    quantize_rows(gate_up, 2L * K, xq, xs, M, K, 1);
    linear_tiles(xq, xs, wq, ws, bias, out, M, N, K);
    return 0;
}

/* The columns of a weight's block in the layout this build reads (0: not built). */
int kvflow_linear_i16_lanes(void) { return I16_LANES; }
#else
int kvflow_linear_i16(const float *x, int16_t *xq, float *xs, const int16_t *wq,
                      const float *ws, const float *bias, float *out, int M, int N, int K) {
    (void)x, (void)xq, (void)xs, (void)wq, (void)ws, (void)bias, (void)out, (void)M, (void)N,
        (void)K;
    return 2; /* not built for this CPU (it needs AVX2 and FMA) */
}

int kvflow_linear_i16_silu(const float *gate_up, int16_t *xq, float *xs, const int16_t *wq,
                           const float *ws, const float *bias, float *out, int M, int N, int K) {
    return kvflow_linear_i16(gate_up, xq, xs, wq, ws, bias, out, M, N, K);
}

int kvflow_linear_i16_lanes(void) { return 0; }
#endif
