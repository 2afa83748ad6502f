/* Linear layers of up to a few hundred rows (decode steps) in bfloat16 (CPU).
 *
 * A decode step of a few sequences reads every weight once for a few rows of input: it is
 * the weights' stream, and oneDNN's packed matmul streamed them at 8-18 GB/s at 1-16 rows
 * where this machine reads memory at 28-29 GB/s (AMD EPYC Zen 4, 2 threads); from 16 to a
 * few hundred rows it is arithmetic, where oneDNN reached 60-85% of what this kernel does.
 * The weights are laid out for vdpbf16ps with the output columns in the vector lanes, so
 * a block of 16 columns is one contiguous stream and no sum across lanes is needed:
 *
 *   wp [N / 16, K / 2, 16, 2] bfloat16: wp[b][p][j][e] = W[16 b + j][2 p + e]
 *   x  [R, K] bfloat16 (rows M..R-1: padding, not read), out [R, N] bfloat16 (rows M..R-1
 *   zeroed, as the padded matmul they replace leaves them)
 *
 * The product goes in tiles of TR rows x TC blocks of 16 columns (TR * TC accumulators in
 * registers, 24 of the 32): for each pair of inputs k, k + 1, one 64-byte load from each
 * of the TC blocks, then per row one broadcast of the row's pair and TC vdpbf16ps, the
 * products summed in float32; the sums rounded to bfloat16 (nearest even, as torch
 * rounds) at the end. A panel of TC blocks (K * 192 bytes: 110 KB at K = 576) stays in L2
 * while every row tile passes over it. Each output is the same sum in the same order
 * whatever the tile, the row count or the thread: a row's result does not depend on what
 * else is in the batch. Threads: the column blocks split in contiguous shares, one each.
 * Built where the CPU has avx512_bf16. Where it also has AMX, oneDNN's bfloat16 kernels
 * run on the tiles and win from 8 rows on; this kernel keeps the steps of a few rows,
 * where the weights' stream is all there is (worker.hardware.rows_kernel_limit).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define TR 4 /* rows of a tile */
#define TC 6 /* blocks of 16 columns of a tile */

/* 16 float32 sums -> bfloat16, rounded as bf16.h's to_bf16 rounds (a NaN stays quiet) */
static inline __m256i round_bf16(const __m512 sums) {
    const __m512i u = _mm512_castps_si512(sums);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* The pair of bfloat16 inputs x[2 i], x[2 i + 1] as one 32-bit lane (memcpy: x need
 * not be 4-byte aligned; it compiles to the broadcast's own load). */
static inline int pair_at(const uint16_t *x, const size_t i) {
    int v;
    memcpy(&v, x + 2 * i, sizeof v);
    return v;
}

/* Rows r0 .. r0 + RT - 1 x blocks b .. b + CB - 1 (literals where inlined: the
 * accumulators stay in registers); P = K / 2 pairs a row. */
static inline __attribute__((always_inline)) void
tile(const uint16_t *restrict x, const uint16_t *restrict wp, uint16_t *restrict out,
     const int RT, const int CB, const int P, const int N, const int r0, const int b) {
    __m512 acc[TR][TC];
    const uint16_t *wb = wp + (size_t)b * P * 32;
    const uint16_t *xr = x + (size_t)r0 * P * 2;
    for (int r = 0; r < RT; r++)
        for (int c = 0; c < CB; c++) acc[r][c] = _mm512_setzero_ps();
    for (int p = 0; p < P; p++) {
        __m512bh w[TC];
        for (int c = 0; c < CB; c++)
            w[c] = (__m512bh)_mm512_loadu_si512(wb + ((size_t)c * P + p) * 32);
        for (int r = 0; r < RT; r++) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32(pair_at(xr, (size_t)r * P + p));
            for (int c = 0; c < CB; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pair, w[c]);
        }
    }
    for (int r = 0; r < RT; r++)
        for (int c = 0; c < CB; c++)
            _mm256_storeu_si256((__m256i *)(out + (size_t)(r0 + r) * N + (size_t)(b + c) * 16),
                                round_bf16(acc[r][c]));
}

#define TILE(RT, CB) tile(x, wp, out, RT, CB, P, N, r0, b)
#define BLOCKS(RT)                                                                      \
    switch (cb) {                                                                       \
    case 1: TILE(RT, 1); break;                                                         \
    case 2: TILE(RT, 2); break;                                                         \
    case 3: TILE(RT, 3); break;                                                         \
    case 4: TILE(RT, 4); break;                                                         \
    case 5: TILE(RT, 5); break;                                                         \
    default: TILE(RT, 6); break;                                                        \
    }

/* A tile of rt <= TR rows x cb <= TC blocks: full tiles, and the edges of the last ones */
static void any_tile(const uint16_t *x, const uint16_t *wp, uint16_t *out, const int rt,
                     const int cb, const int P, const int N, const int r0, const int b) {
    switch (rt) {
    case 1: BLOCKS(1) break;
    case 2: BLOCKS(2) break;
    case 3: BLOCKS(3) break;
    default: BLOCKS(4) break;
    }
}

int kvflow_matmul_rows_bf16(const uint16_t *x, const uint16_t *wp, uint16_t *out, int M, int R,
                            int N, int K) {
    if (M < 1 || N % 16 != 0 || K % 2 != 0 || R < M) return 1;
    const int blocks = N / 16, P = K / 2;
#pragma omp parallel
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int lo = (int)((long)blocks * id / nt), hi = (int)((long)blocks * (id + 1) / nt);
        for (int b = lo; b < hi; b += TC) {
            const int cb = hi - b < TC ? hi - b : TC;
            for (int r0 = 0; r0 < M; r0 += TR)
                any_tile(x, wp, out, M - r0 < TR ? M - r0 : TR, cb, P, N, r0, b);
        }
    }
    memset(out + (size_t)M * N, 0, sizeof(uint16_t) * (size_t)(R - M) * N);
    return 0;
}

/* Whether kvflow_matmul_rows_bf16 is built for this CPU. */
int kvflow_matmul_rows_built(void) { return 1; }
#else
int kvflow_matmul_rows_bf16(const uint16_t *x, const uint16_t *wp, uint16_t *out, int M, int R,
                            int N, int K) {
    (void)x, (void)wp, (void)out, (void)M, (void)R, (void)N, (void)K;
    return 2; /* not built for this CPU (no avx512_bf16) */
}

int kvflow_matmul_rows_built(void) { return 0; }
#endif
