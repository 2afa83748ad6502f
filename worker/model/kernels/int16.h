/* Shared by the two builds of the int16 matmul (int16_matmul.c: AVX2, 8 int32 lanes a
 * vector; int16_matmul_vnni.c: AVX-512 VNNI, 16): the bounds that keep a block's int32
 * sums exact and the rounding of the inputs, so both compute the same sums. */
#ifndef KVFLOW_INT16_H
#define KVFLOW_INT16_H
#include <stddef.h>
#include <stdint.h>

#define KB 64      /* inputs per block of int32 sums */
#define W_MAX 8191 /* |wq|: 14-bit weights */
#define X_MAX 4095 /* |xq|: 13-bit inputs; KB * W_MAX * X_MAX = 2,146,697,280 < 2^31 */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define I16_VNNI 1 /* int16_matmul_vnni.c's tiles are the build's */
#define I16_LANES 16
#else
#define I16_VNNI 0
#define I16_LANES 8 /* columns a weight block: int32 lanes a vector */
#endif
#if I16_VNNI
#define I16_NR 3 /* column blocks a tile, and a panel that one thread takes */
#else
#define I16_NR 6
#endif
#define I16_MC 64 /* rows per chunk: 64 x K int16 inputs (<= 192 KB at K = 1536) in L2 */

/* One build's tiles over a chunk's rows mc..mend-1 (mc a multiple of I16_MC) x the panel
 * of column blocks b..b+nr-1 (nr <= I16_NR), into out times the column scales (+ bias);
 * kvflow_linear_i16 (int16_matmul.c) splits the panels between threads. `next` (NULL:
 * none) is the thread's next panel, `ask` bytes, which a build may ask into the cache
 * meanwhile. */
void kvflow_i16_panel(const int16_t *xq, const float *xs, const int16_t *wq, const float *ws,
                      const float *bias, float *out, int K, int N, int nkb, int mc, int mend,
                      int b, int nr, const char *next, size_t ask);
#endif
