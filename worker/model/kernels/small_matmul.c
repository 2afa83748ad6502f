/* Linear layers of a few rows (decode steps of few sequences) in bfloat16 (CPU).
 *
 * A decode step of a few sequences reads every weight once for a few rows of input: it is
 * the weights' stream, and oneDNN's packed matmul streamed them at 8-18 GB/s at 1-16 rows
 * where this machine reads memory at 28-29 GB/s (AMD EPYC Zen 4, 2 threads). Here the
 * weights are laid out for vdpbf16ps with the output columns in the vector lanes, so a
 * block of 16 columns is one contiguous stream and no sum across lanes is needed:
 *
 *   wp [N / 16, K / 2, 16, 2] bfloat16: wp[b][p][j][e] = W[16 b + j][2 p + e]
 *   x  [R, K] bfloat16 (rows M..R-1: padding, not read), out [R, N] bfloat16 (rows M..R-1
 *   zeroed, as the padded matmul they replace leaves them), M <= 16
 *
 * For each block of 16 columns and each pair of inputs k, k + 1: one 64-byte load of the
 * weights, then per row one vdpbf16ps of the row's pair (broadcast) against it, products
 * summed in float32 into that row's 16 columns; the sums rounded to bfloat16 (nearest
 * even, as torch rounds) at the end. Threads: the column blocks split in two contiguous
 * halves, each a sequential read. Built where the CPU has avx512_bf16 and no AMX: there
 * oneDNN's bfloat16 kernels run on AMX tiles, not measured against this one.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#include <immintrin.h>

#define MAX_ROWS 16

/* One block of 16 columns for M rows (a literal where inlined: acc stays in registers). */
static inline __attribute__((always_inline)) void
column_block(const uint32_t *restrict x2, const uint16_t *restrict wb, uint16_t *restrict out,
             const int M, int K, int N, int n0) {
    __m512 acc[MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int p = 0; p < K / 2; p++) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(wb + (size_t)p * 32);
        for (int m = 0; m < M; m++) {
            const __m512i pair = _mm512_set1_epi32((int)x2[(size_t)m * (K / 2) + p]);
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)pair, w);
        }
    }
    for (int m = 0; m < M; m++) {
        float v[16];
        _mm512_storeu_ps(v, acc[m]);
        uint16_t *o = out + (size_t)m * N + n0;
        for (int j = 0; j < 16; j++) o[j] = to_bf16(v[j]);
    }
}

#define ROWS_CASE(MV)                                                                   \
    case MV:                                                                            \
        for (int b = lo; b < hi; b++)                                                   \
            column_block(x2, wp + (size_t)b * K * 16, out, MV, K, N, b * 16);           \
        break;

int kvflow_matmul_rows_bf16(const uint16_t *x, const uint16_t *wp, uint16_t *out, int M, int R,
                            int N, int K) {
    if (M < 1 || M > MAX_ROWS || N % 16 != 0 || K % 2 != 0 || R < M) return 1;
    const uint32_t *x2 = (const uint32_t *)x; /* the rows as pairs of bfloat16 */
    const int blocks = N / 16;
#pragma omp parallel
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int lo = (int)((long)blocks * id / nt), hi = (int)((long)blocks * (id + 1) / nt);
        switch (M) {
            ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
            ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
            ROWS_CASE(13) ROWS_CASE(14) ROWS_CASE(15) ROWS_CASE(16)
        }
    }
    memset(out + (size_t)M * N, 0, sizeof(uint16_t) * (size_t)(R - M) * N);
    return 0;
}

/* The most rows kvflow_matmul_rows_bf16 takes (0: not built for this CPU). */
int kvflow_matmul_rows_max(void) { return MAX_ROWS; }
#else
int kvflow_matmul_rows_bf16(const uint16_t *x, const uint16_t *wp, uint16_t *out, int M, int R,
                            int N, int K) {
    (void)x, (void)wp, (void)out, (void)M, (void)R, (void)N, (void)K;
    return 2; /* not built for this CPU (no avx512_bf16, or AMX) */
}

int kvflow_matmul_rows_max(void) { return 0; }
#endif
