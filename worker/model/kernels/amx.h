/* AMX tiles for the kernels that use them (small_matmul.c's row kernel, paged_decode.c's
 * scores of keys in pairs): KVFLOW_AMX where the build is for a CPU with AMX, or where
 * KVFLOW_AMX_EMULATE stands the tile instructions in by plain C (below), so that a CPU
 * without AMX compiles and checks the same code paths (tests/model/builds.py builds it:
 * results within rounding of the real tiles', not bit for bit).
 *
 * kvflow_amx_ready: whether this process may use the tiles (small_matmul.c; Linux grants
 * them once asked, and the emulation always).
 */
#ifndef KVFLOW_AMX_H
#define KVFLOW_AMX_H
#include <stdint.h>

#if defined(__AMX_BF16__) || defined(KVFLOW_AMX_EMULATE)
#define KVFLOW_AMX 1
int kvflow_amx_ready(void);

/* A tile configuration (palette 1): rows and bytes a row of each of the 8 tiles. */
struct kvflow_tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64)));
#endif

#if defined(KVFLOW_AMX_EMULATE) && !defined(__AMX_BF16__)
#include <immintrin.h> /* first: its tile functions, which the names below then stand for */
#include <stdlib.h>
#include <string.h>

/* The 8 tiles of this thread, as the hardware keeps them: a configuration (none until
 * loaded, none again after a release) and up to 16 rows of 64 bytes each. One state for
 * the whole library (defined in small_matmul.c), so that a kernel overwriting another's
 * tiles goes wrong here as it would on the CPU. What the hardware refuses (a tile not
 * configured, shapes that do not fit) aborts, where the CPU would fault. */
struct kvflow_tiles {
    int configured, rows[8], colsb[8];
    unsigned char data[8][16][64];
};
extern __thread struct kvflow_tiles kvflow_tile_regs;

static inline void kvflow_emu_check(int ok) {
    if (!ok) abort();
}
static inline void kvflow_emu_loadconfig(const void *config) {
    const struct kvflow_tile_config *c = (const struct kvflow_tile_config *)config;
    kvflow_emu_check(c->palette == 1 && c->start_row == 0);
    for (int t = 0; t < 8; t++) {
        kvflow_emu_check(c->rows[t] <= 16 && c->colsb[t] <= 64 && c->colsb[t] % 4 == 0);
        kvflow_tile_regs.rows[t] = c->rows[t];
        kvflow_tile_regs.colsb[t] = c->colsb[t];
    }
    memset(kvflow_tile_regs.data, 0, sizeof kvflow_tile_regs.data);
    kvflow_tile_regs.configured = 1;
}
static inline void kvflow_emu_release(void) { memset(&kvflow_tile_regs, 0, sizeof kvflow_tile_regs); }
static inline void kvflow_emu_used(int t) {
    kvflow_emu_check(kvflow_tile_regs.configured && t >= 0 && t < 8 &&
                     kvflow_tile_regs.rows[t] > 0 && kvflow_tile_regs.colsb[t] > 0);
}
static inline void kvflow_emu_zero(int t) {
    kvflow_emu_used(t);
    memset(kvflow_tile_regs.data[t], 0, 16 * 64);
}
/* the configured rows and bytes from memory, the rest of the tile zeroed */
static inline void kvflow_emu_loadd(int t, const void *base, long stride) {
    kvflow_emu_used(t);
    memset(kvflow_tile_regs.data[t], 0, 16 * 64);
    for (int r = 0; r < kvflow_tile_regs.rows[t]; r++)
        memcpy(kvflow_tile_regs.data[t][r], (const char *)base + r * stride,
               (size_t)kvflow_tile_regs.colsb[t]);
}
static inline void kvflow_emu_stored(int t, void *base, long stride) {
    kvflow_emu_used(t);
    for (int r = 0; r < kvflow_tile_regs.rows[t]; r++)
        memcpy((char *)base + r * stride, kvflow_tile_regs.data[t][r],
               (size_t)kvflow_tile_regs.colsb[t]);
}
static inline float kvflow_emu_bf16(const unsigned char *p) {
    uint32_t u = (uint32_t)(p[0] | (p[1] << 8)) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
/* C[m][n] += sum over k of A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1], in float32 (the
 * hardware's order of the adds is its own: results agree to a few ulp), with the shapes
 * TDPBF16PS requires: C's rows A's, C's bytes a row B's, A's pairs a row B's rows */
static inline void kvflow_emu_dpbf16ps(int c, int a, int b) {
    struct kvflow_tiles *t = &kvflow_tile_regs;
    kvflow_emu_used(c);
    kvflow_emu_used(a);
    kvflow_emu_used(b);
    kvflow_emu_check(t->rows[c] == t->rows[a] && t->colsb[c] == t->colsb[b] &&
                     t->colsb[a] / 4 == t->rows[b]);
    const int M = t->rows[c], N = t->colsb[c] / 4, K = t->colsb[a] / 4;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float acc;
            memcpy(&acc, t->data[c][m] + 4 * n, sizeof acc);
            for (int k = 0; k < K; k++) {
                const unsigned char *x = t->data[a][m] + 4 * k, *y = t->data[b][k] + 4 * n;
                acc += kvflow_emu_bf16(x) * kvflow_emu_bf16(y) +
                       kvflow_emu_bf16(x + 2) * kvflow_emu_bf16(y + 2);
            }
            memcpy(t->data[c][m] + 4 * n, &acc, sizeof acc);
        }
}
#undef _tile_zero /* intrinsics gcc defines as macros */
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) kvflow_emu_loadconfig(config)
#define _tile_release() kvflow_emu_release()
#define _tile_zero(t) kvflow_emu_zero(t)
#define _tile_loadd(t, base, stride) kvflow_emu_loadd(t, base, stride)
#define _tile_stored(t, base, stride) kvflow_emu_stored(t, base, stride)
#define _tile_dpbf16ps(c, a, b) kvflow_emu_dpbf16ps(c, a, b)
#elif defined(__AMX_BF16__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
/* gcc's _tile_loadd (12 here) is an asm that names the address it reads from but not the
 * memory there, so the compiler may drop or defer stores to a buffer that only a tile load
 * reads: the decode kernel's score pass took q's tiles from a stack array never written
 * and scored NaN on an Intel Xeon with AMX, where the emulation (plain C) was right. A
 * compiler barrier before each load orders every store before it; the same before a
 * configuration's load, whose asm claims to read only its first 8 of 64 bytes. */
static inline __attribute__((always_inline)) void kvflow_tile_loadconfig(const void *config) {
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(config);
}
#define _tile_loadconfig(config) kvflow_tile_loadconfig(config)
#undef _tile_loadd
#define _tile_loadd(t, base, stride)                                                          \
    do {                                                                                      \
        __asm__ volatile("" ::: "memory");                                                    \
        _tile_loadd_internal(t, base, stride);                                                \
    } while (0)
#endif

#endif
