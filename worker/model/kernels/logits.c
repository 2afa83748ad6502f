/* The logits of a narrow (bfloat16) output projection, made ready for re-scoring (CPU).
 *
 *   kvflow_widen_top   x [S, V] bfloat16 -> out [S, V] float32 (each value widened: exact),
 *                      and cols [S, width] int64: the columns of each row's `width` largest
 *                      values, best first (equal values: the lower column first); with
 *                      out NULL the columns alone (a greedy step that needs no whole row).
 *                      Rows are taken to hold no NaN (built with -ffast-math: an engine's
 *                      logits hold none)
 *   kvflow_argmax_rows x [S, V] float32 -> out [S] int64, torch.argmax's columns
 *
 * One pass over a row both widens it and takes the maxima of its blocks of BLOCK values;
 * the best `width` values lie in the `width` blocks with the highest maxima (a block left
 * out has no value above the lowest of the chosen blocks' maxima, and each chosen block
 * holds one at least that high), so only those blocks are searched again. torch did the
 * same in three passes over the row (widen, block maxima, topk over the chosen blocks'
 * values), each reading or writing the whole float32 row from memory: a [64, 49152] row
 * set is 12.6 MB, past the L2.
 *
 * Threads: OpenMP over rows.
 */
#include <float.h>
#include <stdint.h>

#include "bf16.h"

#define BLOCK 32
#define WIDTH_MAX 64

/* Insert (v, c) into the sorted run best[0..*n) of at most `cap` (descending by value,
 * ascending by column among equal values), dropping the last if full. */
static inline void keep_best(float *best_v, int64_t *best_c, int *n, int cap, float v,
                             int64_t c) {
    if (*n == cap && !(v > best_v[cap - 1] || (v == best_v[cap - 1] && c < best_c[cap - 1])))
        return;
    int i = *n < cap ? (*n)++ : cap - 1;
    while (i > 0 && (v > best_v[i - 1] || (v == best_v[i - 1] && c < best_c[i - 1]))) {
        best_v[i] = best_v[i - 1];
        best_c[i] = best_c[i - 1];
        i--;
    }
    best_v[i] = v;
    best_c[i] = c;
}

/* 0, or 1 where width is not 1 .. min(V, WIDTH_MAX). */
int kvflow_widen_top(const uint16_t *x, float *out, int S, int V, int width, int64_t *cols) {
    if (width < 1 || width > WIDTH_MAX || width > V) return 1;
    const int nb = (V + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
    for (int s = 0; s < S; s++) {
        const uint16_t *xr = x + (size_t)s * V;
        float *o = out == NULL ? NULL : out + (size_t)s * V;
        float top_v[WIDTH_MAX];
        int64_t top_b[WIDTH_MAX];
        int nt = 0;
        for (int b = 0; b < nb; b++) {
            const int lo = b * BLOCK, hi = lo + BLOCK < V ? lo + BLOCK : V;
            float mx = -FLT_MAX;
            if (o != NULL) {
#pragma omp simd reduction(max : mx)
                for (int i = lo; i < hi; i++) {
                    o[i] = from_bf16(xr[i]);
                    mx = o[i] > mx ? o[i] : mx;
                }
            } else {
#pragma omp simd reduction(max : mx)
                for (int i = lo; i < hi; i++) {
                    const float v = from_bf16(xr[i]);
                    mx = v > mx ? v : mx;
                }
            }
            keep_best(top_v, top_b, &nt, width, mx, b);
        }
        float best_v[WIDTH_MAX];
        int64_t *best_c = cols + (size_t)s * width;
        int nbest = 0;
        for (int j = 0; j < nt; j++) {
            const int lo = (int)top_b[j] * BLOCK, hi = lo + BLOCK < V ? lo + BLOCK : V;
            for (int i = lo; i < hi; i++)
                keep_best(best_v, best_c, &nbest, width, from_bf16(xr[i]), i);
        }
    }
    return 0;
}

/* out[s] = the first column of row s's largest value, x [S, V] float32 (torch.argmax
 * over the last dimension; a row of nothing above -FLT_MAX, -inf throughout, gives column
 * 0 as torch does). Not for rows holding NaN, which torch would pick: the library is
 * built to assume finite arithmetic, and an engine's logits hold none. Two passes
 * over a row, the second stopping at the maximum: the row (192 KB at V 49152) is in L2
 * by then. torch's two-level argmax (block maxima, then the best block) took three passes
 * through memory. */
void kvflow_argmax_rows(const float *x, int S, int V, int64_t *out) {
#pragma omp parallel for schedule(static)
    for (int s = 0; s < S; s++) {
        const float *xr = x + (size_t)s * V;
        float mx = -FLT_MAX;
#pragma omp simd reduction(max : mx)
        for (int i = 0; i < V; i++) mx = xr[i] > mx ? xr[i] : mx;
        int64_t at = 0;
        for (int c = 0; c < V; c += 64) { /* the first run of 64 holding it, then in it */
            const int end = c + 64 < V ? c + 64 : V;
            int hit = 0;
#pragma omp simd reduction(| : hit)
            for (int i = c; i < end; i++) hit |= xr[i] == mx;
            if (!hit) continue;
            for (at = c; at < end - 1 && xr[at] != mx; at++) {
            }
            break;
        }
        out[s] = at;
    }
}
