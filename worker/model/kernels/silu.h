/* silu(gate) * up for one value, as every kernel of the library computes it (layer_ops.c's
 * SiLU and multiply, and int16_matmul.c's, which rounds the product as it computes it):
 * one expression, so the two paths agree bit for bit. exp(-gate) is bounded below float32's
 * overflow: with -ffast-math the division is a reciprocal and a refinement step, which an
 * infinite denominator turns into NaN (gates below about -88.7); past the bound silu(gate)
 * is -0 to float32. */
#ifndef KVFLOW_SILU_H
#define KVFLOW_SILU_H
#include <math.h>

static inline __attribute__((always_inline)) float silu_times(float gate, float up) {
    return gate / (1.0f + expf(fminf(-gate, 88.0f))) * up;
}
#endif
