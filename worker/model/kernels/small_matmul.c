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
 * rounds) at the end. A panel of TC blocks (K * 128 bytes: 74 KB at K = 576) stays in L2
 * while every row tile passes over it. Each output is the same sum in the same order
 * whatever the tile, the row count or the thread: a row's result does not depend on what
 * else is in the batch. Threads: the column blocks split in contiguous shares, one each.
 * Built where the CPU has avx512_bf16.
 *
 * Only a panel's first row tile reads it from memory, and at 64 / TR bytes of weights a
 * vdpbf16ps it asks for more than a core's share of the memory's pace: left to the
 * hardware prefetchers, a step of 16-32 rows took about the time of the weights' stream
 * plus that of the arithmetic, one after the other. So the later row tiles of a panel
 * ask for the next panel into L2 as they go, each an equal share of it spread over its
 * pairs (where there are at least two whole row tiles: at fewer rows a step is the
 * weights' stream either way, and there panels of TC_FEW blocks ran the stream as fast
 * as the earlier 6 did, where 4 took 1.01-1.09x the time). The default model's 121 row
 * weights (the decoder's and the output projection's narrow copy, 269 MB, from memory),
 * 2 threads, AMD EPYC Zen 4, against tiles of 4 rows x 6 blocks without the requests
 * (medians of 9, both builds alternating in one process, two or three runs): 0.92-0.97x
 * the time at 12 rows, 0.81-0.94x at 16, 0.83x at 24, 0.90-0.93x at 32, 0.91x at 48,
 * 0.92-0.99x at 64, 0.97x at 96, 0.98-1.01x at 1-4. The sums, and so the outputs, are
 * the same bit for bit.
 *
 * Where the CPU also has AMX (and Linux grants this process the tiles), the same
 * layout feeds the tiles instead: a block's 16 pairs of inputs k .. k + 31 are one B tile
 * as they stand ([16 pairs, 16 columns, 2], 64 bytes a row), so the product goes in tiles
 * of up to 32 rows x 2 blocks (four float32 C tiles, two A tiles of x's rows, two B tiles),
 * K in steps of 32 (K a multiple of 32; else the vector tiles above). A block pair's
 * panel streams from memory once and stays in L1 while the row slabs pass over it; each
 * output is again one sum in one order whatever the rows. The default model's decoder
 * layers (30 distinct weights a shape, streaming), 2 threads, Intel Xeon with AMX,
 * against oneDNN's packed matmul (which uses the tiles too), alternating: 0.57-0.62x the
 * time at 1-32 rows (the weights read at 20-25 GB/s), 0.70-0.76x at 37-100, 0.77x at 128.
 */
#define _GNU_SOURCE /* syscall */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "entries.h"
#include "share.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define TR 6 /* rows of a tile */
#define TC 4 /* blocks of 16 columns of a tile */
#define TC_FEW 6 /* blocks of a tile where a step has at most FEW rows */
#define FEW 4

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
 * accumulators stay in registers); P = K / 2 pairs a row. The `ask` bytes from `next`
 * (NULL: none) are asked into L2 meanwhile, spread evenly over the pairs. */
static inline __attribute__((always_inline)) void
tile(const uint16_t *restrict x, const uint16_t *restrict wp, uint16_t *restrict out,
     const int RT, const int CB, const int P, const int N, const int r0, const int b,
     const char *next, const size_t ask) {
    __m512 acc[TR][TC_FEW];
    const uint16_t *wb = wp + (size_t)b * P * 32;
    const uint16_t *xr = x + (size_t)r0 * P * 2;
    size_t asked = 0;
    for (int r = 0; r < RT; r++)
        for (int c = 0; c < CB; c++) acc[r][c] = _mm512_setzero_ps();
    for (int p = 0; p < P; p++) {
        if (next != NULL)
            for (const size_t until = ask * (size_t)(p + 1) / (size_t)P; asked < until;
                 asked += 64)
                __builtin_prefetch(next + asked, 0, 2);
        __m512bh w[TC_FEW];
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

#define TILE(RT, CB) tile(x, wp, out, RT, CB, P, N, r0, b, next, ask)
#define BLOCKS(RT)                                                                      \
    switch (cb) {                                                                       \
    case 1: TILE(RT, 1); break;                                                         \
    case 2: TILE(RT, 2); break;                                                         \
    case 3: TILE(RT, 3); break;                                                         \
    default: TILE(RT, 4); break;                                                        \
    }
#define BLOCKS_FEW(RT)                                                                  \
    switch (cb) {                                                                       \
    case 1: TILE(RT, 1); break;                                                         \
    case 2: TILE(RT, 2); break;                                                         \
    case 3: TILE(RT, 3); break;                                                         \
    case 4: TILE(RT, 4); break;                                                         \
    case 5: TILE(RT, 5); break;                                                         \
    default: TILE(RT, 6); break;                                                        \
    }

/* A tile of rt <= TR rows x cb <= TC blocks (TC_FEW where rt <= FEW): full tiles, and the
 * edges of the last ones */
static void any_tile(const uint16_t *x, const uint16_t *wp, uint16_t *out, const int rt,
                     const int cb, const int P, const int N, const int r0, const int b,
                     const char *next, const size_t ask) {
    switch (rt) {
    case 1: BLOCKS_FEW(1) break;
    case 2: BLOCKS_FEW(2) break;
    case 3: BLOCKS_FEW(3) break;
    case 4: BLOCKS_FEW(4) break;
    case 5: BLOCKS(5) break;
    default: BLOCKS(6) break;
    }
}

#if defined(KVFLOW_AMX)
/* The tile registers for a slab of r0 + r1 rows (r0 <= 16, r1 <= 16, r1 > 0 only with
 * r0 == 16): C tiles 0, 1 (rows 0..r0-1 x blocks b, b + 1, float32) and 2, 3 (rows 16..),
 * A tiles 4 (rows 0..r0-1 x 32 inputs) and 5 (rows 16..), B tiles 6, 7 (blocks b, b + 1 x
 * 16 pairs). Tiles of no rows stay unconfigured (and unused). */
static void configure(int r0, int r1) {
    struct kvflow_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

/* A slab's C tiles (float32, stored to c [32, 32]) rounded into out's rows m0 .. m0 + rows
 * - 1, columns of block b (and b + 1 where two). */
static inline void round_slab(const float *c, uint16_t *out, int rows, int two, int N, int m0,
                              int b) {
    for (int r = 0; r < rows; r++) {
        uint16_t *o = out + (size_t)(m0 + r) * N + (size_t)b * 16;
        _mm256_storeu_si256((__m256i *)o, round_bf16(_mm512_loadu_ps(c + r * 32)));
        if (two)
            _mm256_storeu_si256((__m256i *)(o + 16),
                                round_bf16(_mm512_loadu_ps(c + r * 32 + 16)));
    }
}

/* kvflow_matmul_rows_bf16 on the tiles (K a multiple of 32): each thread takes a
 * contiguous share of the block pairs (the last block alone where their count is odd). */
static void amx_rows(const uint16_t *x, const uint16_t *wp, uint16_t *out, int M, int N, int K) {
    const int blocks = N / 16, P = K / 2, units = (blocks + 1) / 2;
#pragma omp parallel
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int lo = (int)((long)units * id / nt), hi = (int)((long)units * (id + 1) / nt);
        float c[32 * 32] __attribute__((aligned(64)));
        int configured = -1; /* the slab shape the tiles hold (r0 * 32 + r1) */
        for (int u = lo; u < hi; u++) {
            const int b = 2 * u, two = b + 1 < blocks;
            const uint16_t *w0 = wp + (size_t)b * P * 32, *w1 = w0 + (size_t)P * 32;
            for (int m0 = 0; m0 < M; m0 += 32) {
                const int r0 = M - m0 < 16 ? M - m0 : 16;
                const int r1 = M - m0 <= 16 ? 0 : (M - m0 - 16 < 16 ? M - m0 - 16 : 16);
                if (r0 * 32 + r1 != configured) configure(r0, r1);
                configured = r0 * 32 + r1;
                const uint16_t *xa = x + (size_t)m0 * K, *xb = xa + (size_t)16 * K;
                _tile_zero(0);
                if (two) _tile_zero(1);
                if (r1) _tile_zero(2);
                if (r1 && two) _tile_zero(3);
                for (int p = 0; p < P; p += 16) { /* inputs 2 p .. 2 p + 31 */
                    _tile_loadd(4, xa + 2 * p, K * 2);
                    _tile_loadd(6, w0 + (size_t)p * 32, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two) {
                        _tile_loadd(7, w1 + (size_t)p * 32, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (r1) {
                        _tile_loadd(5, xb + 2 * p, K * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, c, 128);
                if (two) _tile_stored(1, c + 16, 128);
                if (r1) _tile_stored(2, c + 16 * 32, 128);
                if (r1 && two) _tile_stored(3, c + 16 * 32 + 16, 128);
                round_slab(c, out, r0 + r1, two, N, m0, b);
            }
        }
        if (configured >= 0) _tile_release();
    }
}
#endif

/* The product on the vector tiles: each thread takes a contiguous share of the blocks. */
static void vector_rows(const uint16_t *x, const uint16_t *wp, uint16_t *out, int M, int N,
                        int K) {
    const int blocks = N / 16, P = K / 2;
#pragma omp parallel
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int lo = (int)((long)blocks * id / nt), hi = (int)((long)blocks * (id + 1) / nt);
        /* the row tiles after a panel's first ask for the next panel (its blocks follow
         * on: one stream), where there are two whole tiles or more */
        const int tiles = (M + TR - 1) / TR, ahead = M >= 2 * TR;
        const int tc = M <= FEW ? TC_FEW : TC; /* a step of few rows: wider panels */
        for (int b = lo; b < hi; b += tc) {
            const int cb = hi - b < tc ? hi - b : tc;
            const int nb = hi - b - cb < tc ? hi - b - cb : tc; /* the next panel's blocks */
            const char *panel = (const char *)(wp + (size_t)(b + cb) * P * 32);
            const size_t bytes = (size_t)nb * P * 64;
            for (int r0 = 0, t = 0; r0 < M; r0 += TR, t++) {
                const char *next = NULL;
                size_t ask = 0;
                if (ahead && t > 0 && nb > 0) /* tile t asks for share t - 1 */
                    next = next_share(panel, bytes, t, tiles, &ask);
                any_tile(x, wp, out, M - r0 < TR ? M - r0 : TR, cb, P, N, r0, b, next, ask);
            }
        }
    }
}

int kvflow_matmul_rows_bf16(const uint16_t *x, const uint16_t *wp, uint16_t *out, int M, int R,
                            int N, int K) {
    if (M < 1 || N % 16 != 0 || K % 2 != 0 || R < M) return 1;
#if defined(KVFLOW_AMX)
    if (K % 32 == 0 && kvflow_amx_ready())
        amx_rows(x, wp, out, M, N, K);
    else
#endif
        vector_rows(x, wp, out, M, N, K);
    memset(out + (size_t)M * N, 0, sizeof(uint16_t) * (size_t)(R - M) * N);
    return 0;
}

/* Whether kvflow_matmul_rows_bf16 is built for this CPU. */
int kvflow_matmul_rows_built(void) { return 1; }

/* Whether it computes on AMX tiles (where K is a multiple of 32): built for a CPU with AMX,
 * and the tiles granted to this process. */
int kvflow_matmul_rows_amx(void) {
#if defined(KVFLOW_AMX)
    return kvflow_amx_ready();
#else
    return 0;
#endif
}
#else
int kvflow_matmul_rows_bf16(const uint16_t *x, const uint16_t *wp, uint16_t *out, int M, int R,
                            int N, int K) {
    (void)x, (void)wp, (void)out, (void)M, (void)R, (void)N, (void)K;
    return 2; /* not built for this CPU (no avx512_bf16) */
}

int kvflow_matmul_rows_built(void) { return 0; }

int kvflow_matmul_rows_amx(void) { return 0; }
#endif

#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands a process the AMX tile data only once it asks (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a tile instruction before that dies of
 * SIGILL. -1: not asked yet; then 1 granted, 0 refused (the vector tiles are used). Atomic:
 * callers from two threads (ctypes lets go of the GIL) may both ask, harmlessly. */
static int amx_granted = -1;

int kvflow_amx_ready(void) {
    int granted = __atomic_load_n(&amx_granted, __ATOMIC_ACQUIRE);
    if (granted < 0) {
        granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
        __atomic_store_n(&amx_granted, granted, __ATOMIC_RELEASE);
    }
    return granted;
}
#elif defined(KVFLOW_AMX)
int kvflow_amx_ready(void) { return 1; } /* the tiles emulated (amx.h) */
__thread struct kvflow_tiles kvflow_tile_regs;
#endif
