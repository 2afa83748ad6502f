/* A panel's later row tiles ask for the next panel into L2 as they go (small_matmul.c's
 * row kernel, int16_matmul.c's AVX2 build): only a panel's first row tile reads it from
 * memory, so the others, which read it from L2, split the next panel's stream between
 * them in equal shares. One rule for both, so that they split it alike. */
#ifndef KVFLOW_SHARE_H
#define KVFLOW_SHARE_H
#include <stddef.h>

/* Where row tile t (1 <= t < tiles) starts its share of the `bytes` at `next`: share
 * t - 1 of tiles - 1, its length in *len. */
static inline const char *next_share(const char *next, size_t bytes, int t, int tiles,
                                     size_t *len) {
    const size_t from = bytes * (size_t)(t - 1) / (size_t)(tiles - 1);
    *len = bytes * (size_t)t / (size_t)(tiles - 1) - from;
    return next + from;
}
#endif
