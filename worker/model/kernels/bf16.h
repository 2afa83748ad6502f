/* bfloat16 <-> float32 for the kernel library's C files (a bf16 value is the top half of
 * a float32). Included by each; the library's build key hashes this file with them. */
#ifndef KVFLOW_BF16_H
#define KVFLOW_BF16_H
#include <stdint.h>
#include <string.h>

/* float32 -> bfloat16, round to nearest even as torch rounds (NaN stays a quiet NaN) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif
