/* Float32 linear layers as 16-bit integer products on a CPU with AVX2 but no bfloat16.
 *
 * Without native bfloat16 (or integer dot products into 32 bits) a float32 matmul is
 * bound by the FMA units: 8 products per instruction. vpmaddwd multiplies 16 pairs of
 * int16 and adds neighbours into 8 int32 lanes: twice the products per instruction, and
 * exact. The operands are rounded to integers first, finer than bfloat16 rounds them:
 *
 *   wq [N / 8, K / 2, 8, 2] int16, wq[b][p][j][e] = round(W[8 b + j][2 p + e] / ws[8 b + j]),
 *      |wq| <= W_MAX, one float32 scale per output column (ws [N]);
 *   xq [M, K] int16, |xq| <= X_MAX, one float32 scale per row and block of KB inputs
 *      (xs [M, ceil(K / KB)]): an outlier of a row widens the step of its own block only.
 *
 * A block's products are summed in int32: KB * W_MAX * X_MAX < 2^31, so no sum
 * overflows, whatever the inputs. Each block's sums are then scaled by the row's block
 * scale and added in float32; the column scale multiplies the total once.
 *
 * Weights: per output column, 14 bits (relative step 2^-13 of the column's largest
 * weight); bfloat16 keeps 8 significant bits of each. Inputs: 13 bits per block of 64.
 *
 * Tiles of MR = 4 rows x NR = 2 column blocks (16 columns): 8 int32 accumulators; per
 * pair of inputs 4 broadcasts, 8 vpmaddwd with the weights as memory operands and 8
 * vpaddd. Wider tiles ran slower: with 12 accumulators gcc spills some of them to the
 * stack inside the loop (4 x 3: 66-69 GOP/s on one thread against 102-104 for 4 x 2,
 * AMD EPYC Zen 3, the default model's four decoder shapes at 64 rows; float32 through
 * oneDNN 63-67 GFLOP/s). Threads split the column panels; the rows go through in chunks
 * of MC so that a chunk's inputs stay in L2 while every panel passes over them.
 *
 * Measured there (2 threads, the four shapes of a decoder layer, rounding of the inputs
 * included): 0.44x / 0.47x / 0.52x / 0.61x / 0.71x the time of float32 through oneDNN
 * with packed weights at 1 / 8 / 16 / 64 / 512 rows (217 GOP/s at 512 rows against 149
 * GFLOP/s); the error against float64 a fifth of bfloat16's (relative 5e-4 against 2.7e-3
 * over random inputs with an outlier column).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define KB 64      /* inputs per block of int32 sums */
#define W_MAX 8191 /* |wq|: 14-bit weights */
#define X_MAX 4095 /* |xq|: 13-bit inputs; KB * W_MAX * X_MAX = 2,146,697,280 < 2^31 */

/* Per row and block of KB inputs: scale = max |x| / X_MAX, xq = round(x / scale). */
static void quantize_rows(const float *x, int16_t *xq, float *xs, int M, int K) {
    const int nkb = (K + KB - 1) / KB;
#pragma omp parallel for schedule(static) if (M * K > 32768)
    for (int m = 0; m < M; m++) {
        for (int kb = 0; kb < nkb; kb++) {
            const float *xr = x + (size_t)m * K + kb * KB;
            int16_t *qr = xq + (size_t)m * K + kb * KB;
            const int n = K - kb * KB < KB ? K - kb * KB : KB;
            float amax = 0.0f;
            for (int k = 0; k < n; k++) amax = fmaxf(amax, fabsf(xr[k]));
            const float scale = amax > 0.0f ? amax * (1.0f / X_MAX) : 1.0f;
            const float inv = 1.0f / scale;
            for (int k = 0; k < n; k++) qr[k] = (int16_t)lrintf(xr[k] * inv);
            xs[(size_t)m * nkb + kb] = scale;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define MR 4
#define NR 2
#define MC 64 /* rows per chunk: 64 x K int16 inputs (<= 192 KB at K = 1536) in L2 */

/* Rows m0..m0+mr-1 x column blocks b0..b0+nr-1 over all K (mr, nr literals where
 * inlined, so acc stays in registers). */
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
                    *(const int32_t *)(xq + (size_t)(m0 + m) * K + 2 * (size_t)p));
                for (int n = 0; n < nr; n++)
                    acc[m][n] = _mm256_add_epi32(acc[m][n], _mm256_madd_epi16(pair, w[n]));
            }
        }
        for (int m = 0; m < mr; m++) {
            const __m256 s = _mm256_set1_ps(xs[(size_t)(m0 + m) * nkb + kb]);
            for (int n = 0; n < nr; n++)
                _mm256_store_ps(total[m][n],
                                _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][n]), s,
                                                _mm256_load_ps(total[m][n])));
        }
    }
    for (int n = 0; n < nr; n++) {
        const __m256 c = _mm256_loadu_ps(ws + (size_t)(b0 + n) * 8);
        const __m256 add =
            bias ? _mm256_loadu_ps(bias + (size_t)(b0 + n) * 8) : _mm256_setzero_ps();
        for (int m = 0; m < mr; m++)
            _mm256_storeu_ps(out + (size_t)(m0 + m) * N + (size_t)(b0 + n) * 8,
                             _mm256_fmadd_ps(_mm256_load_ps(total[m][n]), c, add));
    }
}

#define TILE(MV, NV) tile(xq, xs, wq, ws, bias, out, K, N, nkb, m, b, MV, NV)
#define ROWS_CASE(MV)                                                                   \
    case MV:                                                                            \
        if (nr == 2) TILE(MV, 2);                                                       \
        else TILE(MV, 1);                                                               \
        break;

/* out [M, N] float32 = x [M, K] float32 @ W.T (+ bias [N], or NULL), W given as wq and ws
 * (above); xq [M, K] int16 and xs [M, ceil(K / KB)] float32 are scratch for x's rounding. */
int kvflow_linear_i16(const float *x, int16_t *xq, float *xs, const int16_t *wq,
                      const float *ws, const float *bias, float *out, int M, int N, int K) {
    if (M < 0 || N % 8 != 0 || K < 2 || K % 2 != 0) return 1;
    quantize_rows(x, xq, xs, M, K);
    const int nkb = (K + KB - 1) / KB, blocks = N / 8;
    const int panels = (blocks + NR - 1) / NR;
#pragma omp parallel
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int lo = (int)((long)panels * id / nt), hi = (int)((long)panels * (id + 1) / nt);
        for (int mc = 0; mc < M; mc += MC) {
            const int mend = mc + MC < M ? mc + MC : M;
            for (int pn = lo; pn < hi; pn++) {
                const int b = pn * NR, nr = blocks - b < NR ? blocks - b : NR;
                for (int m = mc; m < mend; m += MR) {
                    switch (mend - m < MR ? mend - m : MR) {
                        ROWS_CASE(4) ROWS_CASE(3) ROWS_CASE(2) ROWS_CASE(1)
                    }
                }
            }
        }
    }
    return 0;
}

/* Whether kvflow_linear_i16 is built for this CPU. */
int kvflow_linear_i16_built(void) { return 1; }
#else
int kvflow_linear_i16(const float *x, int16_t *xq, float *xs, const int16_t *wq,
                      const float *ws, const float *bias, float *out, int M, int N, int K) {
    (void)x, (void)xq, (void)xs, (void)wq, (void)ws, (void)bias, (void)out, (void)M, (void)N,
        (void)K;
    return 2; /* not built for this CPU (it needs AVX2 and FMA) */
}

int kvflow_linear_i16_built(void) { return 0; }
#endif
