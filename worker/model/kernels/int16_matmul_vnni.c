/* The int16 matmul of int16_matmul.c built for a CPU with AVX-512 VNNI and no bfloat16.
 *
 * There a float32 FMA does 16 products (zmm), two a cycle; vpdpwssd multiplies 32 pairs of
 * int16 and adds them into 16 int32 lanes in one instruction, also two a cycle: twice the
 * products, from weights of half the bytes. The operands are rounded as in
 * int16_matmul.c (the same inputs, int16.h) and the int32 sums of a block are exact, so
 * this build's outputs are the AVX2 build's, bit for bit; only the weights' layout is
 * wider:
 *
 *   wq [N / 16, K / 2, 16, 2] int16, wq[b][p][j][e] = round(W[16 b + j][2 p + e] / ws[16 b + j]).
 *
 * Tiles of MR = 8 rows x NR = 3 column blocks (48 columns): 24 int32 accumulators, the 3
 * weight vectors of a pair and its broadcast input in 28 of the 32 registers; per pair of
 * inputs 3 loads of weights and 8 broadcasts (two 16-byte runs of xq) for 24 vpdpwssd,
 * so a column panel's weights are read once per 8 rows. Threads split the column panels;
 * the rows go through in chunks of I16_MC, as in the AVX2 build (kvflow_linear_i16).
 */
#include <stdint.h>

#include "int16.h"

#if I16_VNNI
#include <immintrin.h>

#define MR 8 /* rows a tile: two groups of four in xq */
#define NR I16_NR
#define LANES I16_LANES

/* A block's int32 sums (acc, in memory) into the float32 totals, each row's by its block
 * scale. */
static inline __attribute__((always_inline)) void
add_block(float total[MR][NR][LANES], const int32_t acc[MR][NR][LANES],
          const float *restrict xs, int nkb, int m0, int kb, const int mr, const int nr) {
    for (int m = 0; m < mr; m++) {
        const __m512 s = _mm512_set1_ps(xs[(size_t)(m0 + m) * nkb + kb]);
        for (int n = 0; n < nr; n++)
            _mm512_store_ps(total[m][n],
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(acc[m][n])), s,
                                            _mm512_load_ps(total[m][n])));
    }
}

/* The totals times the column scales (+ bias) into out. */
static inline __attribute__((always_inline)) void
store_tile(float total[MR][NR][LANES], const float *restrict ws, const float *restrict bias,
           float *restrict out, int N, int m0, int b0, const int mr, const int nr) {
    for (int n = 0; n < nr; n++) {
        const __m512 c = _mm512_loadu_ps(ws + (size_t)(b0 + n) * LANES);
        const __m512 add =
            bias ? _mm512_loadu_ps(bias + (size_t)(b0 + n) * LANES) : _mm512_setzero_ps();
        for (int m = 0; m < mr; m++)
            _mm512_storeu_ps(out + (size_t)(m0 + m) * N + (size_t)(b0 + n) * LANES,
                             _mm512_fmadd_ps(_mm512_load_ps(total[m][n]), c, add));
    }
}

/* One block's pair loop of a tile of 3 column blocks in assembly: row m's accumulators in
 * zmm(3m)..zmm(3m+2) (written with intrinsics, gcc copied every accumulator to the stack
 * at each product), zmm28-30 a pair's weights, zmm31 a row's broadcast input; the sums
 * stored to acc [MR][NR][LANES] at the end. ROWS: the rows' steps, R0 to R(mr - 1). */
#define ROW(X, A, B, C)                                                                  \
    "vpbroadcastd " X ", %%zmm31\n\t"                                                    \
    "vpdpwssd %%zmm28, %%zmm31, %%zmm" A "\n\t"                                          \
    "vpdpwssd %%zmm29, %%zmm31, %%zmm" B "\n\t"                                          \
    "vpdpwssd %%zmm30, %%zmm31, %%zmm" C "\n\t"
#define R0 ROW("(%[x])", "0", "1", "2")
#define R1 ROW("4(%[x])", "3", "4", "5")
#define R2 ROW("8(%[x])", "6", "7", "8")
#define R3 ROW("12(%[x])", "9", "10", "11")
#define R4 ROW("(%[x],%[xg])", "12", "13", "14") /* the second group of four rows */
#define R5 ROW("4(%[x],%[xg])", "15", "16", "17")
#define R6 ROW("8(%[x],%[xg])", "18", "19", "20")
#define R7 ROW("12(%[x],%[xg])", "21", "22", "23")
#define Z4(a, b, c, d)                                                                   \
    "vpxord %%zmm" a ", %%zmm" a ", %%zmm" a "\n\t"                                      \
    "vpxord %%zmm" b ", %%zmm" b ", %%zmm" b "\n\t"                                      \
    "vpxord %%zmm" c ", %%zmm" c ", %%zmm" c "\n\t"                                      \
    "vpxord %%zmm" d ", %%zmm" d ", %%zmm" d "\n\t"
#define S4(a, b, c, d)                                                                   \
    "vmovdqa32 %%zmm" a ", " a "*64(%[acc])\n\t"                                         \
    "vmovdqa32 %%zmm" b ", " b "*64(%[acc])\n\t"                                         \
    "vmovdqa32 %%zmm" c ", " c "*64(%[acc])\n\t"                                         \
    "vmovdqa32 %%zmm" d ", " d "*64(%[acc])\n\t"
#define PAIRS(ROWS)                                                                      \
    __asm__ volatile(                                                                    \
        Z4("0", "1", "2", "3") Z4("4", "5", "6", "7") Z4("8", "9", "10", "11")           \
        Z4("12", "13", "14", "15") Z4("16", "17", "18", "19") Z4("20", "21", "22", "23") \
        "1:\n\t"                                                                         \
        "vmovdqu64 (%[w]), %%zmm28\n\t"                                                  \
        "vmovdqu64 (%[w],%[wb]), %%zmm29\n\t"                                            \
        "vmovdqu64 (%[w],%[wb],2), %%zmm30\n\t"                                          \
        ROWS                                                                             \
        "add $16, %[x]\n\t"                                                              \
        "add $64, %[w]\n\t"                                                              \
        "cmp %[xend], %[x]\n\t"                                                          \
        "jne 1b\n\t"                                                                     \
        S4("0", "1", "2", "3") S4("4", "5", "6", "7") S4("8", "9", "10", "11")           \
        S4("12", "13", "14", "15") S4("16", "17", "18", "19") S4("20", "21", "22", "23") \
        : [x] "+r"(x0), [w] "+r"(w0)                                                     \
        : [xend] "r"(xend), [wb] "r"(wbytes), [xg] "r"(xg), [acc] "r"(acc)               \
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", \
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", \
          "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm28", "xmm29", "xmm30",        \
          "xmm31", "memory", "cc")

/* Rows m0..m0+mr-1 (m0 a multiple of 8) x column blocks b0..b0+nr-1 over all K, into out
 * times the column scales (+ bias); mr and nr literals where inlined. Tiles of 3 column
 * blocks run their pair loop in assembly; narrower ones (a weight of N % 48 != 0) in
 * intrinsics, the same sums in the same order, so a row's result does not depend on
 * which tile it falls in. */
static inline __attribute__((always_inline)) void
tile(const int32_t *restrict xp, const float *restrict xs, const int16_t *restrict wq,
     const float *restrict ws, const float *restrict bias, float *restrict out, int K, int N,
     int nkb, int m0, int b0, const int mr, const int nr) {
    float total[MR][NR][LANES] __attribute__((aligned(64)));
    int32_t acc[MR][NR][LANES] __attribute__((aligned(64)));
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) _mm512_store_ps(total[m][n], _mm512_setzero_ps());
    const int P = K / 2;
    const size_t wstride = (size_t)P * 2 * LANES;                  /* int16 per column block */
    const long wbytes = (long)wstride * 2, xg = (long)P * 4 * 4; /* bytes: a block; a group */
    for (int kb = 0; kb < nkb; kb++) {
        const int p0 = kb * (KB / 2), p1 = (P < p0 + KB / 2) ? P : p0 + KB / 2;
        if (nr == NR) {
            const int16_t *w0 = wq + (size_t)b0 * wstride + (size_t)p0 * 2 * LANES;
            const int32_t *x0 = xp + ((size_t)(m0 / 4) * P + p0) * 4;
            const int32_t *xend = x0 + (size_t)(p1 - p0) * 4;
            switch (mr) {
            case 8: PAIRS(R0 R1 R2 R3 R4 R5 R6 R7); break;
            case 7: PAIRS(R0 R1 R2 R3 R4 R5 R6); break;
            case 6: PAIRS(R0 R1 R2 R3 R4 R5); break;
            case 5: PAIRS(R0 R1 R2 R3 R4); break;
            case 4: PAIRS(R0 R1 R2 R3); break;
            case 3: PAIRS(R0 R1 R2); break;
            case 2: PAIRS(R0 R1); break;
            default: PAIRS(R0); break;
            }
        } else {
            __m512i a[MR][NR];
            for (int m = 0; m < mr; m++)
                for (int n = 0; n < nr; n++) a[m][n] = _mm512_setzero_si512();
            for (int p = p0; p < p1; p++) {
                __m512i w[NR];
                for (int n = 0; n < nr; n++)
                    w[n] = _mm512_loadu_si512(wq + (size_t)(b0 + n) * wstride +
                                              (size_t)p * 2 * LANES);
                for (int m = 0; m < mr; m++) {
                    const __m512i pair =
                        _mm512_set1_epi32(xp[((size_t)((m0 + m) / 4) * P + p) * 4 + m % 4]);
                    for (int n = 0; n < nr; n++)
                        a[m][n] = _mm512_dpwssd_epi32(a[m][n], pair, w[n]);
                }
            }
            for (int m = 0; m < mr; m++)
                for (int n = 0; n < nr; n++) _mm512_store_si512(acc[m][n], a[m][n]);
        }
        add_block(total, acc, xs, nkb, m0, kb, mr, nr);
    }
    store_tile(total, ws, bias, out, N, m0, b0, mr, nr);
}

#define TILE(MV, NV) tile(xp, xs, wq, ws, bias, out, K, N, nkb, m, b, MV, NV)
#define ROWS_CASE(MV)                                                                   \
    case MV:                                                                            \
        if (nr == 3) TILE(MV, 3);                                                       \
        else if (nr == 2) TILE(MV, 2);                                                  \
        else TILE(MV, 1);                                                               \
        break;

void kvflow_i16_panel(const int16_t *xq, const float *xs, const int16_t *wq, const float *ws,
                      const float *bias, float *out, int K, int N, int nkb, int mc, int mend,
                      int b, int nr, const char *next, size_t ask) {
    /* Not asked for here: on the Intel Xeons whose build this is, the next panel asked
     * for by the later row tiles changed nothing at 8-128 rows (ops/bench/RESULTS.md) */
    (void)next, (void)ask;
    const int32_t *xp = (const int32_t *)xq; /* pairs of int16 */
    for (int m = mc; m < mend; m += MR) {
        switch (mend - m < MR ? mend - m : MR) {
            ROWS_CASE(8) ROWS_CASE(7) ROWS_CASE(6) ROWS_CASE(5)
            ROWS_CASE(4) ROWS_CASE(3) ROWS_CASE(2) ROWS_CASE(1)
        }
    }
}
#endif
