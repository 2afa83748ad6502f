/* Decode attention read in place from a paged, head-major KV cache (CPU).
 *
 * One query token per sequence. For each (sequence, KV head) pair the G = H / KVH query
 * heads sharing that KV head are scored against the sequence's keys block by block,
 * straight out of the cache: no gathered copy of the context. Two passes per pair: scores
 * (all keys), then the softmax-weighted sum of the values, so K and V are each read once.
 *
 * Shapes (contiguous):
 *   q            [n, H, D] float32    out [n, H, D] float32 (or bfloat16: out_bf16)
 *   k_cache      [NB, KVH, BS, D]     v_cache likewise: float32 (kvflow_paged_decode_f32)
 *                                     or bfloat16 (kvflow_paged_decode_bf16)
 *   block_tables [n, max_blocks] int32 (a sequence's cache blocks in order)
 *   context_lens [n] int32            (keys visible to the query, its own included)
 * With out_bf16 the output is bfloat16 (rounded to nearest even, as torch rounds): the
 * input of a bfloat16 output projection, written where the projection reads it rather
 * than cast there by another pass (the cast took 1.9-2.4 ms of a batch-64 decode step,
 * 55 us a layer, its float32 input cold after the kernel's own reads).
 * window > 0 limits the keys to the last `window` positions (sliding-window attention).
 * A row is any query that sees the keys up to its own: a decode token over its context,
 * or a prompt chunk's row (its table repeated per row, its length its position + 1; the
 * chunk's own K/V are stored before the kernel runs).
 * A bfloat16 cache is widened to float32 as it is read (a bf16 value is the top half of
 * a float32): scores, softmax and sums stay float32. An int8 cache
 * (kvflow_paged_decode_i8) holds rows of D int8 values and then their float32 scales
 * (value = scale * q): the keys one scale per 16 values (k_cache [NB, KVH, BS,
 * D + D / 4] int8; D + 4 where D is not a multiple of 16), the values one per row
 * (v_cache [.., D + 4]), dequantized as they are read. The two caches may also differ:
 * bfloat16 keys over int8 values (kvflow_paged_decode_bf16_i8, k_cache [NB, KVH, BS, D],
 * v_cache [.., D + 4]), each read as its kind, its rows of its own size. Bfloat16 keys may
 * be stored in pairs (kvflow_paged_decode_bf16p, _bf16p_i8: k_cache [NB, KVH, D / 2, BS,
 * 2], dimensions 2p and 2p + 1 of a block's keys side by side; values as above), scored
 * 16 keys a vector without sums across lanes (score_pairs). Where the CPU
 * has avx512_bf16 and is not an Intel core with AMX or AVX-512 FP16 (and D is a multiple
 * of 32), the keys are not widened: the scores take q, cut into two bfloat16 halves,
 * against the stored keys with vdpbf16ps, products summed in float32 (score16_bf16;
 * KVFLOW_DOT_BF16).
 *
 * With AVX-512 (built with -march=native on such a CPU) and D a multiple of 16, the score
 * pass takes 16 keys of a block at a time (their dot products summed by one transpose
 * tree, sum16) and the value pass keeps its G x D accumulators in registers. With AVX2
 * and FMA only (no AVX-512) and D a multiple of 8, the same with 8 keys (sum8), and the
 * value pass keeps 64 values of one query head's accumulator in registers over a block
 * run. There a bfloat16 cache (D a multiple of 16) is widened in registers, each 16
 * values as their 8 even and 8 odd ones (a shift and a mask, no shuffle, no widened copy
 * stored): q is split the same way once per pair, and the value pass accumulates in that
 * order and puts it back once at the end (score4_eo, accumulate_eo). Other shapes and
 * CPUs take the plain loops, which the compiler vectorises per key (one dependent chain
 * of FMAs and a horizontal sum per key: ~3x slower on an AMD EPYC with AVX2 only).
 *
 * Threads: OpenMP over sequences (their KV heads in turn), or (sequence, KV head) pairs
 * where the sequences are too few to share out. The library links libgomp.so.1 by
 * soname, so inside torch's process it shares torch's OpenMP runtime and thread count.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "entries.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define KVFLOW_AVX2 1
#endif

/* Scores from a bfloat16 cache by vdpbf16ps (score16_bf16) only where the CPU has
 * avx512_bf16 and is not an Intel core: KVFLOW_INTEL_CORE, which the build defines from
 * the CPU's vendor (native.vendor_defines), or AMX or AVX-512 FP16 in the compiler's
 * flags (Intel's cores since Sapphire Rapids; AMD's Zen 4 and Zen 5 have neither; a VM
 * may hide AMX, as one Intel Xeon of this machine kind did, but not FP16). There
 * vdpbf16ps issues at about half the rate of float32 FMAs (16 independent chains: 1.06
 * against 1.82 per ns on an Intel Xeon with AMX), and keys widened to float32 for FMAs, q
 * used as it is, took
 * 0.85-0.87x the kernel's time with AMX and 0.85-0.90x without it (64 sequences of
 * 216-295 tokens, 30 layers' caches, blocks scattered or in order, 2 threads, both builds
 * alternating; 0.80x with the caches hot, 0.92x on one thread). On AMD EPYC Zen 4 and Zen
 * 5 the vdpbf16ps scores were the faster (see score16_bf16). */
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__) && !defined(__AVX512FP16__) &&     \
    !defined(KVFLOW_INTEL_CORE)
#define KVFLOW_DOT_BF16 1
#endif

#define MAX_GROUP 64
#define EO_MAX 2048 /* G * D of the query heads split even / odd, on the stack (AVX2) */
#define MAX_VECTOR_ACC 24 /* value accumulators kept in registers (of 32 AVX-512 ones) */

/* What a cache holds (the entry point's, read at run time): float32, bfloat16, or
 * int8 rows of D values followed by their float32 scales: one for the whole row (KV_I8,
 * values), or one per I8_KEY_GROUP values (KV_I8G, keys; one per row where D is not a
 * multiple of it). Keys rounded per row cost next-token agreement, values do not: see
 * worker.hardware.choose_kv_dtype. */
#define KV_F32 0
#define KV_BF16 1
#define KV_I8 2
#define KV_I8G 3 /* keys only: the value pass reads int8 rows of one scale */
#define KV_BF16P 4 /* keys only: bfloat16, a (block, head) run stored as [D / 2, BS, 2] */
#define I8_KEY_GROUP 16 /* native.I8_KEY_GROUP, checked against kvflow_i8_key_group */

/* Values per scale in an int8 row of D values. */
static inline __attribute__((always_inline)) int i8_group(const int kind, const int D) {
    return kind == KV_I8G && D % I8_KEY_GROUP == 0 ? I8_KEY_GROUP : D;
}

/* Bytes of one cached row of D values. */
static inline __attribute__((always_inline)) size_t row_bytes(const int kind, const int D) {
    if (kind == KV_I8 || kind == KV_I8G)
        return (size_t)D + sizeof(float) * (size_t)(D / i8_group(kind, D));
    return (size_t)D * (kind == KV_BF16 || kind == KV_BF16P ? 2 : 4);
}

/* Bytes from .. to of `next` (NULL: none) asked into L2, a line at a time. */
static inline __attribute__((always_inline)) void ask_lines(const char *next, size_t from,
                                                            size_t to) {
    for (size_t off = from; next != NULL && off < to; off += 64)
        __builtin_prefetch(next + off, 0, 1);
}

/* A run of `rows` cached rows as float32 [rows, D]: the run itself for a float32 cache; for
 * a bfloat16 one, widened into `wide` (a bf16 value is the top half of a float32); for an
 * int8 one, dequantized into `wide`. Widening a whole run once, rather than each value for
 * each of the G query heads that read it, keeps the inner loops plain float32 FMAs. kind
 * is tested once a run, not once a value.
 *
 * `next` (NULL: none) is a run to be read later, of rows of `next_row` bytes (the keys'
 * or the values': the two caches' rows may differ), asked into the cache meanwhile, the
 * same share of it as of this run is read: for a bfloat16 run one line per line
 * widened, so that the prefetches spread over the work
 * rather than queue up at once (they stalled the core once the miss queue was full).
 * Prefetched into L2, not L1 (prefetcht2): on an AMD EPYC (Zen 4) with 2 threads, 64
 * sequences of 240-300 tokens, the kernel took 0.86-1.0 ms per layer against 1.24-1.34
 * with prefetcht0 and the whole run asked for at once. */
static inline __attribute__((always_inline)) const float *
as_f32(const char *restrict run, int rows, const int D, float *restrict wide, const int kind,
       const char *next, size_t next_row) {
    const int n = rows * D;
    if (kind == KV_F32) {
        ask_lines(next, 0, (size_t)rows * next_row);
        return (const float *)run;
    }
    if (kind == KV_I8 || kind == KV_I8G) { /* [rows, row_bytes] -> [rows, D] float32 */
        const size_t i8_row = row_bytes(kind, D);
        const int gs = i8_group(kind, D); /* each group of gs values times its scale */
        for (int j = 0; j < rows; j++) {
            const char *row = run + (size_t)j * i8_row;
            ask_lines(next, (size_t)j * next_row, (size_t)(j + 1) * next_row);
            const int8_t *src = (const int8_t *)row;
            float *dst = wide + (size_t)j * D;
#if defined(__AVX512F__)
            if (gs == 16) { /* a group is one vector (the compiler's own took 128-bit steps) */
                for (int c = 0; c < D / 16; c++) {
                    float sc;
                    memcpy(&sc, row + D + sizeof(float) * (size_t)c, sizeof sc);
                    const __m128i raw = _mm_loadu_si128((const __m128i *)(src + 16 * c));
                    const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
                    _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(x, _mm512_set1_ps(sc)));
                }
                continue;
            }
#endif
            for (int g0 = 0; g0 < D; g0 += gs) {
                float sc;
                memcpy(&sc, row + D + sizeof(float) * (size_t)(g0 / gs), sizeof sc);
#pragma omp simd
                for (int d = g0; d < g0 + gs; d++) dst[d] = sc * (float)src[d];
            }
        }
        return wide;
    }
    const uint16_t *src = (const uint16_t *)run;
    uint32_t *dst = (uint32_t *)wide;
    for (int c = 0; c < n; c += 32) { /* 32 bf16 values: one cache line */
        if (next != NULL) __builtin_prefetch(next + (size_t)c * next_row / D, 0, 1);
        const int end = c + 32 < n ? c + 32 : n;
#pragma omp simd
        for (int i = c; i < end; i++) dst[i] = (uint32_t)src[i] << 16;
    }
    return wide;
}

#if defined(__AVX512F__)
/* Values c*16 .. c*16+15 of a bfloat16 or int8 cached row as float32 (an int8 row's scale
 * not applied: the caller folds it into the weights). */
static inline __attribute__((always_inline)) __m512 widen16(const char *row, int c,
                                                            const int kind) {
    if (kind == KV_I8)
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * c))));
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(row + 32 * c));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* Lane j of the result: the sum of v[j]'s 16 lanes. A transpose-and-add tree, 15 adds and
 * 30 shuffles for 16 sums, where summing each vector alone takes ~8 dependent operations:
 * the dot products of the score pass then cost little more than their FMAs. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 v[16]) {
    __m512 r[8], s[4];
    /* [a0+a2 b0+b2 a1+a3 b1+b3] per 128-bit lane: pairs of keys */
    for (int i = 0; i < 8; i++)
        r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    /* keys 4i..4i+3, each summed within every 128-bit lane */
    for (int i = 0; i < 4; i++) {
        const __m512d c = _mm512_castps_pd(r[2 * i]), d = _mm512_castps_pd(r[2 * i + 1]);
        s[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    /* the four 128-bit lanes of each s[i] added: keys 0..15 in order */
    const int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], even),
                                    _mm512_shuffle_f32x4(s[0], s[1], odd));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], even),
                                    _mm512_shuffle_f32x4(s[2], s[3], odd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, even), _mm512_shuffle_f32x4(u0, u1, odd));
}

/* 16 dot products times `scale` into dst [16], and the running maxima *mx (per lane,
 * reduced once after the pass) raised to theirs. */
static inline __attribute__((always_inline)) void keep16(float *restrict dst, __m512 *restrict mx,
                                                         __m512 dots, float scale) {
    const __m512 s16 = _mm512_mul_ps(dots, _mm512_set1_ps(scale));
    _mm512_storeu_ps(dst, s16);
    *mx = _mm512_max_ps(*mx, s16);
}

/* Scores of 16 consecutive keys kb [16, D] against one query row q [D] (D a multiple
 * of 16): [16] dot products. */
static inline __attribute__((always_inline)) __m512 score16(const float *restrict q,
                                                            const float *restrict kb,
                                                            const int D) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) {
        const float *kr = kb + (size_t)j * D;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(kr));
        for (int d = 16; d < D; d += 16)
            a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(kr + d), a);
        acc[j] = a;
    }
    return sum16(acc);
}

#if defined(KVFLOW_DOT_BF16)
#define QB_MAX 4096 /* G * D of the query heads in bfloat16 halves, on the stack */

/* score16 straight from a bfloat16 cache: q [D] cut once per pair into two bfloat16
 * halves, q_hi (q rounded) and q_lo (what rounding dropped, rounded: 16 of float32's 24
 * significand bits in all), kb [16, D] as stored; vdpbf16ps sums the products with each
 * half in float32 (exact products; D a multiple of 32). No widening of the keys: one
 * layer of 64 sequences of 240-300 tokens (30 layers' caches) took 0.87-0.94x the time
 * with q_hi alone (AMD EPYC Zen 4, 2 threads, alternating builds). q_lo costs as many
 * vdpbf16ps again (the kernel 1.03-1.05x the time on an AMD EPYC Zen 5, prompt rows 1.1x)
 * and keeps the scores within ~1e-5 of float32 q's: with q_hi alone outputs moved by up
 * to ~0.2% of their largest value, and next-token agreement with float32 over 1,024
 * positions fell to 1013-1014 (decode and prompt rows through this kernel) where the two
 * halves give 1016. */
static inline __attribute__((always_inline)) __m512 score16_bf16(const uint16_t *restrict q_hi,
                                                                 const uint16_t *restrict q_lo,
                                                                 const uint16_t *restrict kb,
                                                                 const int D) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) {
        const uint16_t *kr = kb + (size_t)j * D;
        __m512 a = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 32) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512(kr + d);
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q_hi + d), k);
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q_lo + d), k);
        }
        acc[j] = a;
    }
    return sum16(acc);
}
#endif
#endif

#if defined(KVFLOW_AVX2)
/* Lane j of the result: the sum of v[j]'s 8 lanes (AVX2's sum16): two rounds of
 * horizontal adds leave each 128-bit lane holding four keys' partial sums, and the two
 * lanes added give keys 0..7 in order. */
static inline __attribute__((always_inline)) __m256 sum8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* Scores of 8 consecutive keys kb [8, D] against one query row q [D] (D a multiple of
 * 8): [8] dot products, eight independent FMA chains rather than one per key. */
static inline __attribute__((always_inline)) __m256 score8(const float *restrict q,
                                                           const float *restrict kb,
                                                           const int D) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) {
        const float *kr = kb + (size_t)j * D;
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(kr));
        for (int d = 8; d < D; d += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kr + d), a);
        acc[j] = a;
    }
    return sum8(acc);
}

static inline __attribute__((always_inline)) float max4(__m128 m) {
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline __attribute__((always_inline)) float max8(__m256 v) {
    return max4(_mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

/* Pass 2 over one run of `stop` value rows vb [stop, D] for query head g: acc_g [D] +=
 * sum_j p[j] * vb[j]. Eight vectors (64 values) of acc_g at a time stay in registers
 * across the run (sixteen AVX2 registers cannot hold all G x D of them, as AVX-512's
 * path does), so each value row costs loads and FMAs, no stores. */
static inline __attribute__((always_inline)) void
accumulate8(float *restrict acc_g, const float *restrict p, const float *restrict vb, int stop,
            const int D) {
    for (int c0 = 0; c0 < D; c0 += 64) {
        const int C = (D - c0) / 8 < 8 ? (D - c0) / 8 : 8;
        __m256 av[8];
        for (int c = 0; c < C; c++) av[c] = _mm256_loadu_ps(acc_g + c0 + 8 * c);
        for (int j = 0; j < stop; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            const float *vr = vb + (size_t)j * D + c0;
            for (int c = 0; c < C; c++)
                av[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * c), av[c]);
        }
        for (int c = 0; c < C; c++) _mm256_storeu_ps(acc_g + c0 + 8 * c, av[c]);
    }
}

/* A bfloat16 row's values 16c .. 16c + 15 as float32 without a shuffle: *e the even ones
 * (16c, 16c + 2, ..), *o the odd ones. A bf16 value is the top half of a float32, and two
 * of them share each 32-bit lane, the even one low. Widening whole runs into a float32
 * copy first (as_f32) took a quarter of the kernel's time with the caches hot; with this
 * and the two functions below, one layer of 64 sequences of 216-295 tokens over 30
 * layers' caches took 0.76-0.82x the time with blocks scattered, 0.89-0.90x in order,
 * 0.60-0.74x with the caches hot, 0.81x on one thread (the AVX2 build on an AMD EPYC Zen 4,
 * 2 threads, both builds alternating). */
static inline __attribute__((always_inline)) void widen_eo(const uint16_t *row, int c, __m256 *e,
                                                           __m256 *o) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)(row + 16 * c));
    *e = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *o = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* Scores of 4 consecutive bfloat16 keys kb [4, D] against GN (<= 3) query rows split the
 * same way (qe, qo: [GN, D / 16, 8], their even and odd values): s[g] the 4 dot products
 * of row g. 4 keys x 3 rows are 12 accumulators, the widened key and 2 spare of 16
 * registers; the query values come in as the FMAs' memory operands. */
static inline __attribute__((always_inline)) void score4_eo(const uint16_t *restrict kb,
                                                            const float *restrict qe,
                                                            const float *restrict qo, const int GN,
                                                            const int D, __m128 s[3]) {
    __m256 a[3][4];
    for (int g = 0; g < GN; g++)
        for (int k = 0; k < 4; k++) a[g][k] = _mm256_setzero_ps();
    for (int c = 0; c < D / 16; c++)
        for (int k = 0; k < 4; k++) {
            __m256 e, o;
            widen_eo(kb + (size_t)k * D, c, &e, &o);
            for (int g = 0; g < GN; g++) {
                const size_t at = ((size_t)g * (D / 16) + c) * 8;
                a[g][k] = _mm256_fmadd_ps(e, _mm256_loadu_ps(qe + at), a[g][k]);
                a[g][k] = _mm256_fmadd_ps(o, _mm256_loadu_ps(qo + at), a[g][k]);
            }
        }
    for (int g = 0; g < GN; g++) { /* lanes k and k + 4 of the two hadds' sum: key k */
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]),
                                        _mm256_hadd_ps(a[g][2], a[g][3]));
        s[g] = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    }
}

/* Pass 2 over one run of `stop` bfloat16 value rows vb [stop, D] for GN (<= 3) query
 * heads: acc [GN, D] (each 16 values stored as their 8 even then their 8 odd ones) +=
 * p[g * m + j] * vb[j]. Each row is widened in registers once for the GN heads, 32 values
 * at a time (12 accumulators). */
static inline __attribute__((always_inline)) void
accumulate_eo(float *restrict acc, const float *restrict p, size_t m,
              const uint16_t *restrict vb, int stop, const int GN, const int D, const char *next,
              size_t next_row) {
    for (int c0 = 0; c0 < D / 16; c0 += 2) {
        const int CN = D / 16 - c0 < 2 ? D / 16 - c0 : 2;
        __m256 a[3][4];
        for (int g = 0; g < GN; g++)
            for (int c = 0; c < 2 * CN; c++)
                a[g][c] = _mm256_loadu_ps(acc + (size_t)g * D + 16 * c0 + 8 * c);
        for (int j = 0; j < stop; j++) {
            const uint16_t *vr = vb + (size_t)j * D;
            if (c0 == 0) ask_lines(next, (size_t)j * next_row, (size_t)(j + 1) * next_row);
            for (int c = 0; c < CN; c++) {
                __m256 e, o;
                widen_eo(vr, c0 + c, &e, &o);
                for (int g = 0; g < GN; g++) {
                    const __m256 pg = _mm256_broadcast_ss(p + (size_t)g * m + j);
                    a[g][2 * c] = _mm256_fmadd_ps(pg, e, a[g][2 * c]);
                    a[g][2 * c + 1] = _mm256_fmadd_ps(pg, o, a[g][2 * c + 1]);
                }
            }
        }
        for (int g = 0; g < GN; g++)
            for (int c = 0; c < 2 * CN; c++)
                _mm256_storeu_ps(acc + (size_t)g * D + 16 * c0 + 8 * c, a[g][c]);
    }
}
#endif

#if defined(__AVX512F__)
/* One head's dot products of the 16 keys c .. c + 15 of a block, times `scale`, kept for
 * the lanes of keys off .. off + stop - 1 (a run that starts or ends mid-block masks the
 * rest): stored at dg[key - off], and *mx (per lane) raised to them. */
static inline __attribute__((always_inline)) void keep_run16(float *restrict dg,
                                                             __m512 *restrict mx, __m512 dots,
                                                             float scale, int c, int off,
                                                             int stop) {
    const int lo = c < off ? off - c : 0;
    const int end = off + stop - c < 16 ? off + stop - c : 16; /* lanes lo .. end - 1 */
    const __mmask16 keep = (__mmask16)(((1u << end) - 1u) & ~((1u << lo) - 1u));
    const __m512 s = _mm512_mul_ps(dots, _mm512_set1_ps(scale));
    *mx = _mm512_mask_max_ps(*mx, keep, *mx, s);
    if (lo == 0 && end == 16) {
        _mm512_storeu_ps(dg + (c - off), s);
        return;
    }
    float tmp[16];
    _mm512_storeu_ps(tmp, s);
    for (int l = lo; l < end; l++) dg[c + l - off] = tmp[l];
}
#endif

/* Scores of keys off .. off + stop - 1 of one (block, head) run of a bfloat16 cache
 * stored in pairs (KV_BF16P): blk [D / 2, BS, 2], dimensions 2p and 2p + 1 of key b at
 * blk[(p * BS + b) * 2 + 0, 1]. The G query rows qh [G, D] against 16 keys at a time: one
 * load a pair of dimensions, widened once (a shift and a mask: the even dimension is the
 * low half of each 32-bit lane) for the G heads, each head's dimension broadcast into
 * FMAs whose 16 lanes are the 16 keys' running dot products. No sums across lanes (the
 * rows' layout spends a transpose tree on every 16 keys, sum16) and no widened copy
 * stored. dst_g = scores + g * m + (position of key off); *mx (per lane) or mx[g]
 * (scalar) raised to the scores. The kernel alone, bfloat16 keys over int8 values, 64
 * sequences of 216-295 tokens, 30 layers' caches, blocks scattered: 0.87-0.89x the rows'
 * time (score16 on keys widened into `wide`), 0.78-0.81x with the caches hot (Intel Xeon
 * with AMX, 2 threads, both layouts alternating in one process). With the accumulators
 * indexed by a run-time parity they lived on the stack: 0.97-1.0x. */
static inline __attribute__((always_inline)) void
score_pairs(const float *restrict qh, const uint16_t *restrict blk, int off, int stop, int BS,
            const int G, const int D, float scale, float *restrict dst, size_t m,
            float *restrict mx, const char *next, size_t next_row
#if defined(__AVX512F__)
            ,
            __m512 *restrict mx16
#endif
) {
#if defined(__AVX512F__)
    if (BS % 16 == 0 && G <= 8) {
        /* G <= 4: four accumulators a head (even / odd dimension, even / odd pair), 12
         * chains of FMAs at G 3; up to 8 heads two (32 registers); more, the loop below */
        enum { NA_MAX = 4 };
        const int NA = G <= 4 ? 4 : 2;
        const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
        for (int c = off / 16 * 16; c < off + stop; c += 16) {
            /* the next run's share for these 16 keys, a line per pair of dimensions
             * scored (asked all at once they stall the core on a full miss queue) */
            const char *ask = next == NULL ? NULL : next + (size_t)c * next_row;
            const size_t span = (size_t)16 * next_row;
            __m512 a[8][NA_MAX];
            for (int g = 0; g < G; g++)
                for (int k = 0; k < NA; k++) a[g][k] = _mm512_setzero_ps();
            /* pairs p and p + 1 a round, into accumulators 0-1 and 2-3 (or 0-1 alike): with
             * the indices fixed the accumulators stay in registers */
            for (int p = 0; p < D / 2; p += 2) {
                for (int u = 0; u < 2 && p + u < D / 2; u++) {
                    const int pu = p + u, k = NA == 4 ? 2 * u : 0;
                    if (ask != NULL && (size_t)pu * 64 < span) __builtin_prefetch(ask + 64 * pu, 0, 1);
                    const __m512i x =
                        _mm512_loadu_si512((const void *)(blk + ((size_t)pu * BS + c) * 2));
                    const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
                    const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
                    for (int g = 0; g < G; g++) {
                        const float *qg = qh + (size_t)g * D + 2 * pu;
                        a[g][k] = _mm512_fmadd_ps(e, _mm512_set1_ps(qg[0]), a[g][k]);
                        a[g][k + 1] = _mm512_fmadd_ps(o, _mm512_set1_ps(qg[1]), a[g][k + 1]);
                    }
                }
            }
            if (ask != NULL) ask_lines(ask, (size_t)(D / 2) * 64, span); /* the rest, if any */
            for (int g = 0; g < G; g++) {
                __m512 s = _mm512_add_ps(a[g][0], a[g][1]);
                if (NA == 4) s = _mm512_add_ps(s, _mm512_add_ps(a[g][2], a[g][3]));
                keep_run16(dst + (size_t)g * m, mx16 + g, s, scale, c, off, stop);
            }
        }
        return;
    }
#endif
    ask_lines(next, 0, (size_t)BS * next_row);
    for (int b = off; b < off + stop; b++)
        for (int g = 0; g < G; g++) {
            const float *qg = qh + (size_t)g * D;
            float s = 0.0f;
            for (int p = 0; p < D / 2; p++) {
                const uint16_t *kp = blk + ((size_t)p * BS + b) * 2;
                s += qg[2 * p] * from_bf16(kp[0]) + qg[2 * p + 1] * from_bf16(kp[1]);
            }
            s *= scale;
            dst[(size_t)g * m + (b - off)] = s;
            mx[g] = s > mx[g] ? s : mx[g];
        }
}

/* Scores of keys in pairs on AMX tiles (score_pairs_amx): where the build is for a CPU
 * with AMX and KVFLOW_AMX_SCORES is 1, or the tiles are emulated (amx.h: the tests).
 * Off by default: on an Intel Xeon with AMX (2 threads, 64 sequences of 200-300 tokens,
 * 30 layers' caches) it took 1.09x the vector pass's time at 16 to 64 rows (kernel_ab.py
 * --ops decode with a copy of these sources, the 0 below made 1, as its --head); its
 * products use 2G of a tile's 16 rows. */
#ifndef KVFLOW_AMX_SCORES
#define KVFLOW_AMX_SCORES 0
#endif
#if defined(KVFLOW_AMX) && defined(__AVX512F__) &&                                       \
    (KVFLOW_AMX_SCORES || (defined(KVFLOW_AMX_EMULATE) && !defined(__AMX_BF16__)))
#define AMX_SCORES 1

/* The tiles of the score pass, for G query heads of D (64 or 128) values: C tile 0 [2G,
 * 16] float32; A tiles 1 .. D / 32, q's rows [2G, 32] bfloat16 (G rows of q rounded, G
 * of what rounding dropped) for dimensions 32 j .. 32 j + 31; B tiles 5 and 6 in turn,
 * [16 pairs of dimensions, 16 keys, 2] bfloat16 as a block of keys in pairs holds them. */
static void configure_scores(int G, int D) {
    struct kvflow_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t <= D / 32; t++) {
        cfg.rows[t] = (uint8_t)(2 * G);
        cfg.colsb[t] = 64;
    }
    for (int t = 5; t <= 6; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* q [G, D] float32 into the A tiles: each value as two bfloat16 halves, rounded and what
 * rounding dropped (16 of float32's 24 significand bits, as score16_bf16 takes it). */
static inline __attribute__((always_inline)) void load_q_tiles(const float *restrict qh,
                                                               const int G, const int D) {
    uint16_t qa[4][16][32] __attribute__((aligned(64)));
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) {
            const uint16_t hi = to_bf16(qh[(size_t)g * D + d]);
            qa[d / 32][g][d % 32] = hi;
            qa[d / 32][G + g][d % 32] = to_bf16(qh[(size_t)g * D + d] - from_bf16(hi));
        }
    _tile_loadd(1, qa[0], 64);
    _tile_loadd(2, qa[1], 64);
    if (D == 128) {
        _tile_loadd(3, qa[2], 64);
        _tile_loadd(4, qa[3], 64);
    }
}

/* score_pairs on the tiles (q in the A tiles: load_q_tiles): 16 keys' products with q's
 * two halves for the G heads in one C tile, pair rows 16 j .. 16 j + 15 of the block
 * (BS * 4 bytes apart) a B tile as they lie; then row g plus row G + g, scaled, the
 * scores of head g. The AVX-512 path spends ~6 FMAs and a widening a pair of dimensions
 * and 16 keys on what the tiles do in one dot product instruction per 32 dimensions. */
static inline __attribute__((always_inline)) void
score_pairs_amx(const uint16_t *restrict blk, int off, int stop, int BS, const int G, const int D,
                float scale, float *restrict dst, size_t m, const char *next, size_t next_row,
                __m512 *restrict mx16) {
    float c[16 * 16] __attribute__((aligned(64)));
    const long stride = (long)BS * 4;
    for (int c0 = off / 16 * 16; c0 < off + stop; c0 += 16) {
        /* the next run's share for these 16 keys, asked a part after each tile product
         * (all at once they stall the core on a full miss queue: score_pairs) */
        const char *ask = next == NULL ? NULL : next + (size_t)c0 * next_row;
        const size_t span = (size_t)16 * next_row, part = span / (size_t)(D / 32);
        const uint16_t *b0 = blk + (size_t)c0 * 2;
        _tile_zero(0);
        _tile_loadd(5, b0, stride);
        _tile_dpbf16ps(0, 1, 5);
        ask_lines(ask, 0, part);
        _tile_loadd(6, b0 + (size_t)16 * BS * 2, stride);
        _tile_dpbf16ps(0, 2, 6);
        ask_lines(ask, part, D == 128 ? 2 * part : span);
        if (D == 128) {
            _tile_loadd(5, b0 + (size_t)32 * BS * 2, stride);
            _tile_dpbf16ps(0, 3, 5);
            ask_lines(ask, 2 * part, 3 * part);
            _tile_loadd(6, b0 + (size_t)48 * BS * 2, stride);
            _tile_dpbf16ps(0, 4, 6);
            ask_lines(ask, 3 * part, span);
        }
        _tile_stored(0, c, 64);
        for (int g = 0; g < G; g++) /* the two halves' dot products added */
            keep_run16(dst + (size_t)g * m, mx16 + g,
                       _mm512_add_ps(_mm512_load_ps(c + 16 * g), _mm512_load_ps(c + 16 * (G + g))),
                       scale, c0, off, stop);
    }
}
#endif

/* Head h's rows for positions t.. of one sequence, up to the end of t's block or len:
 * a pointer to them in the cache and, in *stop, how many. */
static inline const char *block_run(const void *cache, size_t row, const int32_t *table, int t,
                                    int len, int h, int KVH, int BS, int *stop) {
    const int off = t % BS;
    *stop = (len - t < BS - off) ? len - t : BS - off;
    return (const char *)cache + (((size_t)table[t / BS] * KVH + h) * BS + off) * row;
}

/* The first key a row of `len` keys sees: 0, or len - window under a sliding window. */
static inline int first_key(int len, int window) {
    return (window > 0 && len > window) ? len - window : 0;
}

/* Prefetch distance in blocks: a sequence's blocks lie anywhere in the cache, where the
 * hardware prefetcher does not follow, so the kernel asks for the run this many blocks
 * ahead while it computes the current one. 1 to 3 measured alike, 4 no better, where
 * the scores were widened rows or vdpbf16ps (AMD EPYC Zen 3 and Zen 5). With keys in
 * pairs (AVX-512), whose score pass takes less time a run, 4 took 0.94-0.99x the
 * kernel's time over rows and pairs alike (6 and 8 0.96x; AMD EPYC Zen 4, 2 threads, 64
 * sequences of 216-295 tokens, 30 layers' caches, blocks scattered, both builds
 * alternating, over two hours; 0.98x with the caches in L3). A plain read of 2 KB runs
 * at random places, the kernel's pattern, ran at 24 GB/s asked for 2 runs ahead, 30 at
 * 4 and 31 read in order (same CPU, 2 threads). Unmeasured with 4 on the Zen 5 (whose
 * rows were no faster at 4 before pairs) and the Intel Xeons. */
#if defined(__AVX512F__)
#define AHEAD 4
#else
#define AHEAD 2
#endif

/* Head h's run of the block holding position t, or NULL if t >= len. */
static inline const char *run_at(const void *cache, size_t row, const int32_t *table, int t,
                                 int len, int h, int KVH, int BS) {
    if (t >= len) return NULL;
    return (const char *)cache + (((size_t)table[t / BS] * KVH + h) * BS) * row;
}

/* One (sequence, KV head) pair. G and D are parameters of an always-inlined function,
 * called with literals below (the shape functions): with them known at compile time the
 * dot products and the value updates unroll into whole-vector FMAs. The two caches' kinds
 * are read at run time, tested once a run or a block: each entry point's kinds as
 * literals too (a parallel region of its own) took the same time (`kernel_ab.py --ops
 * decode`: 1.01x / 1.005x at 16 / 64 rows, AMD EPYC Zen 3) for twice the build's.
 * scores: [G, m] scratch, acc: [G, D], wide: [BS, D] (a bf16 or int8 block run widened). */
static inline __attribute__((always_inline)) void
attend_pair(const float *restrict qh, float *restrict o, const void *restrict k_cache,
            const void *restrict v_cache, const int32_t *restrict table, int first, int len,
            int h, int KVH, const int G, const int D, const int kind_k, const int kind_v, int BS, float scale,
            float *restrict scores, float *restrict acc, float *restrict wide,
            const char *const then[AHEAD], const int amx) {
    const size_t row_k = row_bytes(kind_k, D), row_v = row_bytes(kind_v, D);
    const int m = len - first;
    if (m <= 0) {
        memset(o, 0, sizeof(float) * (size_t)G * D);
        return;
    }
    float mx[MAX_GROUP], sum[MAX_GROUP];
    for (int g = 0; g < G; g++) mx[g] = -FLT_MAX;
#if defined(__AVX512F__)
    __m512 mx16[MAX_GROUP]; /* keep16's maxima per lane, for 16 keys at a time */
    for (int g = 0; g < G; g++) mx16[g] = _mm512_set1_ps(-FLT_MAX);
#endif
#if defined(KVFLOW_DOT_BF16)
    uint16_t qb[QB_MAX] __attribute__((aligned(64))), ql[QB_MAX] __attribute__((aligned(64)));
    const int dot_bf16 = kind_k == KV_BF16 && D % 32 == 0 && G * D <= QB_MAX;
    for (int i = 0; dot_bf16 && i < G * D; i++) {
        qb[i] = to_bf16(qh[i]);
        ql[i] = to_bf16(qh[i] - from_bf16(qb[i]));
    }
#endif
#if defined(KVFLOW_AVX2)
    float qe[EO_MAX / 2] __attribute__((aligned(32)));
    float qo[EO_MAX / 2] __attribute__((aligned(32)));
    const int eo = kind_k == KV_BF16 && D % 16 == 0 && G * D <= EO_MAX;
    for (int i = 0; eo && i < G * D / 2; i++) {
        qe[i] = qh[(i / 8) * 16 + 2 * (i % 8)];
        qo[i] = qh[(i / 8) * 16 + 2 * (i % 8) + 1];
    }
    const int eo_v = kind_v == KV_BF16 && D % 16 == 0 && G * D <= EO_MAX; /* values alike */
    __m128 mx4[MAX_GROUP];
    for (int g = 0; g < G; g++) mx4[g] = _mm_set1_ps(-FLT_MAX);
#endif
    /* A pair of fewer than AHEAD blocks starts its look-ahead in the next run: the first
     * `skip` steps past its last block land on the first value run (pass 1) or the next
     * pair's first key run (pass 2), not beyond them. */
    const int nv = (len - 1) / BS + 1 - first / BS, skip = AHEAD > nv ? AHEAD - nv : 0;
#if defined(AMX_SCORES)
    if (amx) load_q_tiles(qh, G, D);
#else
    (void)amx;
#endif
    /* pass 1: scores, running max per query head */
    for (int t = first, stop; t < len; t += stop) {
        const char *run = block_run(k_cache, row_k, table, t, len, h, KVH, BS, &stop);
        /* AHEAD blocks on: a key run, or past the last one the value runs from the start */
        const int ahead = (t / BS + AHEAD) * BS, past = ahead - ((len - 1) / BS + 1) * BS;
        const char *next =
            past < 0 ? run_at(k_cache, row_k, table, ahead, len, h, KVH, BS)
                     : run_at(v_cache, row_v, table, (first / BS + past / BS - skip) * BS, len, h,
                              KVH, BS);
        const size_t next_row = past < 0 ? row_k : row_v; /* the rows of the run `next` */
        if (kind_k == KV_BF16P) {
            const int off = t % BS;
#if defined(AMX_SCORES)
            if (amx) {
                score_pairs_amx((const uint16_t *)(run - (size_t)off * row_k), off, stop, BS, G,
                                D, scale, scores + (t - first), (size_t)m, next, next_row, mx16);
                continue;
            }
#endif
            score_pairs(qh, (const uint16_t *)(run - (size_t)off * row_k), off, stop, BS, G, D,
                        scale, scores + (t - first), (size_t)m, mx, next, next_row
#if defined(__AVX512F__)
                        ,
                        mx16
#endif
            );
            continue;
        }
        int j = 0;
#if defined(KVFLOW_DOT_BF16)
        if (dot_bf16) {
            /* The run AHEAD blocks on asked for 16 rows at a time as this one's are
             * scored, rather than all at once: 0.89-0.92x the kernel's time (AMD EPYC
             * Zen 5, 2 threads, 64 sequences of 240-300 tokens, 30 layers' caches, blocks
             * in order or scattered; alternating builds), the same results. */
            const uint16_t *kr16 = (const uint16_t *)run;
            for (; j + 16 <= stop; j += 16) {
                ask_lines(next, j * next_row, (j + 16) * next_row);
                for (int g = 0; g < G; g++) {
                    keep16(scores + (size_t)g * m + (t - first + j), mx16 + g,
                           score16_bf16(qb + (size_t)g * D, ql + (size_t)g * D,
                                        kr16 + (size_t)j * D, D),
                           scale);
                }
            }
            ask_lines(next, j * next_row, (size_t)BS * next_row); /* the rest of a block run */
            for (; j < stop; j++) { /* the run's last keys: the same two halves */
                for (int g = 0; g < G; g++) {
                    const uint16_t *qg = qb + (size_t)g * D, *qr = ql + (size_t)g * D;
                    const uint16_t *kr = kr16 + (size_t)j * D;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int d = 0; d < D; d++)
                        s += (from_bf16(qg[d]) + from_bf16(qr[d])) * from_bf16(kr[d]);
                    s *= scale;
                    scores[(size_t)g * m + (t - first + j)] = s;
                    mx[g] = s > mx[g] ? s : mx[g];
                }
            }
            continue;
        }
#endif
#if defined(KVFLOW_AVX2)
        if (eo) {
            const uint16_t *kr16 = (const uint16_t *)run;
            for (; j + 4 <= stop; j += 4) {
                ask_lines(next, j * next_row, (j + 4) * next_row);
                for (int g0 = 0; g0 < G; g0 += 3) {
                    const int gn = G - g0 < 3 ? G - g0 : 3;
                    __m128 s4[3];
                    score4_eo(kr16 + (size_t)j * D, qe + (size_t)g0 * D / 2,
                              qo + (size_t)g0 * D / 2, gn, D, s4);
                    for (int g = 0; g < gn; g++) {
                        const __m128 sc = _mm_mul_ps(s4[g], _mm_set1_ps(scale));
                        _mm_storeu_ps(scores + (size_t)(g0 + g) * m + (t - first + j), sc);
                        mx4[g0 + g] = _mm_max_ps(mx4[g0 + g], sc);
                    }
                }
            }
            ask_lines(next, j * next_row, (size_t)BS * next_row);
            if (j == stop) continue;
            next = NULL; /* asked for: the last 1-3 keys of a partial run go the plain way */
        }
#endif
        const float *kb = as_f32(run, stop, D, wide, kind_k, next, next_row);
#if defined(__AVX512F__)
        if (D % 16 == 0) {
            for (; j + 16 <= stop; j += 16) {
                for (int g = 0; g < G; g++) {
                    keep16(scores + (size_t)g * m + (t - first + j), mx16 + g,
                           score16(qh + (size_t)g * D, kb + (size_t)j * D, D), scale);
                }
            }
        }
#elif defined(KVFLOW_AVX2)
        if (D % 8 == 0) {
            for (; j + 8 <= stop; j += 8) {
                for (int g = 0; g < G; g++) {
                    const __m256 s8 = _mm256_mul_ps(
                        score8(qh + (size_t)g * D, kb + (size_t)j * D, D), _mm256_set1_ps(scale));
                    _mm256_storeu_ps(scores + (size_t)g * m + (t - first + j), s8);
                    const float top = max8(s8);
                    mx[g] = top > mx[g] ? top : mx[g];
                }
            }
        }
#endif
        for (; j < stop; j++) {
            const float *kr = kb + (size_t)j * D;
            for (int g = 0; g < G; g++) {
                const float *qg = qh + (size_t)g * D;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < D; d++) s += qg[d] * kr[d];
                s *= scale;
                scores[(size_t)g * m + (t - first + j)] = s;
                mx[g] = s > mx[g] ? s : mx[g];
            }
        }
    }
#if defined(__AVX512F__)
    for (int g = 0; g < G; g++) {
        const float top = _mm512_reduce_max_ps(mx16[g]);
        mx[g] = top > mx[g] ? top : mx[g];
    }
#endif
#if defined(KVFLOW_AVX2)
    for (int g = 0; eo && g < G; g++) {
        const float top = max4(mx4[g]);
        mx[g] = top > mx[g] ? top : mx[g];
    }
#endif
    /* softmax numerators and their sums */
    for (int g = 0; g < G; g++) {
        float *sg = scores + (size_t)g * m;
        const float mg = mx[g];
        float z = 0.0f;
#pragma omp simd reduction(+ : z)
        for (int j = 0; j < m; j++) {
            sg[j] = expf(sg[j] - mg);
            z += sg[j];
        }
        sum[g] = z;
    }
    /* pass 2: weighted sum of the values. With AVX-512 and few enough of them, the G x D
     * accumulators stay in vector registers for the whole pass (av); G and D are
     * literals here, so the test folds away. */
#if defined(__AVX512F__)
    const int C = D / 16, in_regs = D % 16 == 0 && G * (D / 16) <= MAX_VECTOR_ACC;
    __m512 av[MAX_VECTOR_ACC];
    for (int i = 0; in_regs && i < G * C; i++) av[i] = _mm512_setzero_ps();
#else
    const int in_regs = 0;
#endif
    if (!in_regs) memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int t = first, stop; t < len; t += stop) {
        const char *run = block_run(v_cache, row_v, table, t, len, h, KVH, BS, &stop);
        /* AHEAD blocks on: a value run, or past the last one the next pair's key runs */
        const int past = t / BS + AHEAD - ((len - 1) / BS + 1);
        const char *next = past < 0 ? run_at(v_cache, row_v, table, (t / BS + AHEAD) * BS, len, h,
                                             KVH, BS)
                                    : then[past - skip];
        const size_t next_row = past < 0 ? row_v : row_k; /* the rows of the run `next` */
#if defined(__AVX512F__)
        if ((kind_v == KV_BF16 || kind_v == KV_I8) && in_regs) {
            /* A bfloat16 or int8 run widened in registers, 16 values at a time, each
             * vector used by the G query heads (an int8 row's scale folds into the G
             * probabilities that weigh it): no widened copy stored and loaded again. One
             * layer of 64 sequences of 256 tokens, bfloat16: 0.93-0.95x the kernel's time
             * (Intel Xeon with AMX, 2 threads, both builds alternating), the same results. */
            __m512 pv[MAX_VECTOR_ACC]; /* G <= MAX_VECTOR_ACC where in_regs */
            for (int j = 0; j < stop; j++) {
                const char *vr = run + (size_t)j * row_v;
                ask_lines(next, (size_t)j * next_row, (size_t)(j + 1) * next_row); /* as read */
                float sc = 1.0f;
                if (kind_v == KV_I8) memcpy(&sc, vr + D, sizeof sc);
                for (int g = 0; g < G; g++)
                    pv[g] = _mm512_set1_ps(sc * scores[(size_t)g * m + (t - first + j)]);
                for (int c = 0; c < C; c++) {
                    const __m512 v = widen16(vr, c, kind_v);
                    for (int g = 0; g < G; g++)
                        av[g * C + c] = _mm512_fmadd_ps(pv[g], v, av[g * C + c]);
                }
            }
            continue;
        }
#endif
#if defined(KVFLOW_AVX2)
        if (eo_v) {
            for (int g0 = 0; g0 < G; g0 += 3)
                accumulate_eo(acc + (size_t)g0 * D, scores + (size_t)g0 * m + (t - first),
                              (size_t)m, (const uint16_t *)run, stop, G - g0 < 3 ? G - g0 : 3, D,
                              g0 == 0 ? next : NULL, next_row);
            continue;
        }
#endif
        const float *vb = as_f32(run, stop, D, wide, kind_v, next, next_row);
#if defined(KVFLOW_AVX2)
        if (D % 8 == 0) {
            for (int g = 0; g < G; g++)
                accumulate8(acc + (size_t)g * D, scores + (size_t)g * m + (t - first), vb, stop,
                            D);
            continue;
        }
#endif
        for (int j = 0; j < stop; j++) {
            const float *vr = vb + (size_t)j * D;
            for (int g = 0; g < G; g++) {
                const float p = scores[(size_t)g * m + (t - first + j)];
#if defined(__AVX512F__)
                if (in_regs) {
                    for (int c = 0; c < C; c++)
                        av[g * C + c] = _mm512_fmadd_ps(_mm512_set1_ps(p),
                                                        _mm512_loadu_ps(vr + 16 * c), av[g * C + c]);
                    continue;
                }
#endif
                float *a = acc + (size_t)g * D;
#pragma omp simd
                for (int d = 0; d < D; d++) a[d] += p * vr[d];
            }
        }
    }
#if defined(__AVX512F__)
    for (int g = 0; in_regs && g < G; g++)
        for (int c = 0; c < C; c++)
            _mm512_storeu_ps(acc + (size_t)g * D + 16 * c, av[g * C + c]);
#endif
#if defined(KVFLOW_AVX2)
    for (int c = 0; eo_v && c < G * D / 16; c++) { /* 8 even, 8 odd -> 16 in order */
        const __m256 e = _mm256_loadu_ps(acc + 16 * c), od = _mm256_loadu_ps(acc + 16 * c + 8);
        const __m256 lo = _mm256_unpacklo_ps(e, od), hi = _mm256_unpackhi_ps(e, od);
        _mm256_storeu_ps(acc + 16 * c, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(acc + 16 * c + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
#endif
    for (int g = 0; g < G; g++) {
        const float inv = 1.0f / sum[g];
#pragma omp simd
        for (int d = 0; d < D; d++) o[(size_t)g * D + d] = acc[(size_t)g * D + d] * inv;
    }
}

/* A pair's arguments to attend_pair but its shape (G, D). */
struct pair {
    const float *qh;
    float *o;
    const void *k_cache, *v_cache;
    const int32_t *table;
    int first, len, h, KVH, kind_k, kind_v, BS;
    float scale;
    float *scores, *acc, *wide;
    const char *const *then;
    int amx; /* the score pass on AMX tiles (configured by the caller's thread) */
};

/* The pair's work with the head size D and the group size G as literals where they are
 * common (D 64 or 128; G 1 to 8: MHA and the usual GQA groups), so the compiler unrolls
 * the loops over G and keeps the G query rows and accumulators in vector registers; any
 * other shape takes the same code with runtime sizes (pair_any). Each shape is a function
 * of its own: inlined into the parallel region, the shapes made one function of 238 KB
 * that took 45 s of the library's 48 s build (AMD EPYC Zen 3; 9 s now), gcc's passes over
 * a function growing faster than its size. Kernel time against the inlined shapes: within
 * the noise on the Zen 3, 1.02-1.05x from 32 rows on the AMD EPYC Zen 4 (kernel_ab.py
 * --ops decode; the outputs the same bit for bit there), a build of 4.4 s against 17.3. */
static inline __attribute__((always_inline)) void attend(const struct pair *p, const int G,
                                                         const int D) {
    attend_pair(p->qh, p->o, p->k_cache, p->v_cache, p->table, p->first, p->len, p->h, p->KVH,
                G, D, p->kind_k, p->kind_v, p->BS, p->scale, p->scores, p->acc, p->wide,
                p->then, p->amx);
}
#define PAIR_FN(GV, DV)                                                    \
    static __attribute__((noinline)) void pair_##GV##_##DV(const struct pair *p) { \
        attend(p, GV, DV);                                                 \
    }
PAIR_FN(1, 64)
PAIR_FN(2, 64)
PAIR_FN(3, 64)
PAIR_FN(4, 64)
PAIR_FN(5, 64)
PAIR_FN(6, 64)
PAIR_FN(7, 64)
PAIR_FN(8, 64)
PAIR_FN(1, 128)
PAIR_FN(2, 128)
PAIR_FN(3, 128)
PAIR_FN(4, 128)
PAIR_FN(5, 128)
PAIR_FN(6, 128)
PAIR_FN(7, 128)
PAIR_FN(8, 128)

static __attribute__((noinline)) void pair_any(const struct pair *p, int G, int D) {
    attend(p, G, D);
}

typedef void (*pair_fn)(const struct pair *);
static const pair_fn PAIR_SHAPES[2][8] = {
    {pair_1_64, pair_2_64, pair_3_64, pair_4_64, pair_5_64, pair_6_64, pair_7_64, pair_8_64},
    {pair_1_128, pair_2_128, pair_3_128, pair_4_128, pair_5_128, pair_6_128, pair_7_128,
     pair_8_128},
};

static inline __attribute__((always_inline)) int
paged_decode(const float *q, const void *k_cache, const void *v_cache,
             const int32_t *block_tables, const int32_t *context_lens, void *out, int out_bf16,
             int n, int H, int KVH, int D, int BS, int max_blocks, float scale, int window,
             const int kind_k, const int kind_v) {
    const int G = H / KVH;
    if (G > MAX_GROUP || G * KVH != H) return 2;
    if (kind_v == KV_I8G) return 3; /* values are int8 rows of one scale, never grouped */
    if (kind_k == KV_BF16P && D % 2) return 4; /* keys in pairs: an even head size */
    int max_len = 1;
    for (int i = 0; i < n; i++)
        if (context_lens[i] > max_len) max_len = context_lens[i];
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)G * (size_t)max_len);
        float *acc = malloc(sizeof(float) * (size_t)G * (size_t)D);
        float *wide = malloc(sizeof(float) * (size_t)BS * (size_t)D);
        float *res = malloc(sizeof(float) * (size_t)G * (size_t)D); /* a pair's float32 out */
        const int ok = scores != NULL && acc != NULL && wide != NULL && res != NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        const int threads = omp_get_num_threads();
#if defined(AMX_SCORES)
        /* keys in pairs, blocks of a multiple of 16 keys, D 64 or 128, 2G rows a tile. The
         * tiles stay this thread's until the region ends: nothing that uses them too (the
         * row kernel, oneDNN) may run inside it. */
        const int amx = ok && kind_k == KV_BF16P && BS % 16 == 0 && (D == 64 || D == 128) &&
                        G <= 8 && kvflow_amx_ready();
        if (amx) configure_scores(G, D);
#else
        const int amx = 0;
#endif
        /* Whole sequences to a thread, its KV heads one after another, where there are
         * enough of them to share out (else (sequence, KV head) pairs). A block holds its
         * KV heads' runs side by side ([NB, KVH, BS, D]): the hardware's prefetchers,
         * having read head h's run, also bring in some of head h + 1's, which the same
         * core then finds in its cache rather than another core fetching it again. One
         * layer of 64 sequences of 216-295 tokens, bfloat16, 30 layers' caches, 2 threads:
         * 0.87-0.89x the time with pairs handed out in turn, blocks in order or scattered
         * (Intel Xeon with AMX, both builds alternating). */
        const int by_seq = n >= 4 * threads, tasks = by_seq ? n : n * KVH;
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tasks; task++) {
            const int i = by_seq ? task : task / KVH;
            const int h0 = by_seq ? 0 : task % KVH, h1 = by_seq ? KVH : h0 + 1;
            for (int h = h0; h < h1; h++) {
                if (!ok) continue;
                const int len = context_lens[i];
                const int first = first_key(len, window);
                const int32_t *table = block_tables + (size_t)i * max_blocks;
                /* The first key runs of the pair this thread likely takes next (the next
                 * head of its sequence, or the pair `threads` on: tasks are handed out in
                 * order, one at a time), asked for as this pair's last value runs are
                 * read: a pair's first blocks were otherwise plain misses. A wrong guess
                 * costs a few wasted prefetches. 0.95-0.96x the kernel's time (AMD EPYC
                 * Zen 5, 2 threads, 64 sequences of 240-300 tokens, 30 layers' caches,
                 * blocks in order or scattered; alternating builds). */
                const char *then[AHEAD] = {NULL};
                const int guess = !by_seq            ? i * KVH + h + threads
                                  : h + 1 < KVH ? i * KVH + h + 1
                                                : (i + threads) * KVH;
                if (guess < n * KVH) {
                    const int gi = guess / KVH, glen = context_lens[gi];
                    const int gfirst = first_key(glen, window);
                    for (int b = 0; b < AHEAD; b++)
                        then[b] = run_at(k_cache, row_bytes(kind_k, D),
                                         block_tables + (size_t)gi * max_blocks,
                                         (gfirst / BS + b) * BS, glen, guess % KVH, KVH, BS);
                }
                const float *qh = q + ((size_t)i * H + (size_t)h * G) * D;
                const size_t at = ((size_t)i * H + (size_t)h * G) * D;
                float *o = out_bf16 ? res : (float *)out + at;
                const struct pair p = {qh,    o,      k_cache, v_cache, table, first,
                                       len,   h,      KVH,     kind_k,  kind_v, BS,
                                       scale, scores, acc,     wide,    then,  amx};
                if ((D == 64 || D == 128) && G >= 1 && G <= 8) PAIR_SHAPES[D == 128][G - 1](&p);
                else pair_any(&p, G, D);
                uint16_t *ob = (uint16_t *)out + at;
                for (int e = 0; out_bf16 && e < G * D; e++) ob[e] = to_bf16(res[e]);
            }
        }
#if defined(AMX_SCORES)
        if (amx) _tile_release();
#endif
        free(scores);
        free(acc);
        free(wide);
        free(res);
    }
    return failed;
}

/* 1 where the score pass over keys in pairs runs on AMX tiles (AMX_SCORES, and the tiles
 * granted to this process): q as two bfloat16 halves there too. The tests ask, so that
 * a build meant to take the tiles cannot pass them through the vector path instead. */
int kvflow_decode_amx_scores(void) {
#if defined(AMX_SCORES)
    return kvflow_amx_ready();
#else
    return 0;
#endif
}

/* 1 where a bfloat16 cache's scores take q as two bfloat16 halves against the stored keys
 * (this build's CPU has avx512_bf16 and is not an Intel core that has AMX or AVX-512 FP16:
 * KVFLOW_DOT_BF16), else 0: scores then
 * differ from float32 q's by ~1e-5 relative, and the caller's tests allow for it. */
int kvflow_bf16_scores(void) {
#if defined(KVFLOW_DOT_BF16)
    return 1;
#else
    return 0;
#endif
}

int kvflow_paged_decode_f32(const float *q, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, const int32_t *context_lens, void *out,
                            int out_bf16, int n, int H, int KVH, int D, int BS, int max_blocks,
                            float scale, int window) {
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, out, out_bf16, n, H,
                        KVH, D, BS, max_blocks, scale, window, KV_F32, KV_F32);
}

int kvflow_paged_decode_bf16(const float *q, const void *k_cache, const void *v_cache,
                             const int32_t *block_tables, const int32_t *context_lens, void *out,
                             int out_bf16, int n, int H, int KVH, int D, int BS, int max_blocks,
                             float scale, int window) {
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, out, out_bf16, n, H,
                        KVH, D, BS, max_blocks, scale, window, KV_BF16, KV_BF16);
}

/* Keys int8 by groups of I8_KEY_GROUP values, values int8 rows of one scale: 148 bytes
 * a head and token at D 64 against bfloat16's 256 (see worker.hardware.choose_kv_dtype). */
int kvflow_paged_decode_i8(const float *q, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, const int32_t *context_lens, void *out,
                           int out_bf16, int n, int H, int KVH, int D, int BS, int max_blocks,
                           float scale, int window) {
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, out, out_bf16, n, H,
                        KVH, D, BS, max_blocks, scale, window, KV_I8G, KV_I8);
}

/* The values per scale of an int8 cache's key rows, for the library's loader to check
 * against its own (the store is told the group, this kernel has it built in). */
int kvflow_i8_key_group(void) { return I8_KEY_GROUP; }

/* Keys bfloat16, values int8 rows with their scale: the values' bytes nearly halved
 * where their rounding costs next-token agreement nothing measurable (the keys' would:
 * see worker.hardware.choose_kv_dtype). */
int kvflow_paged_decode_bf16_i8(const float *q, const void *k_cache, const void *v_cache,
                                const int32_t *block_tables, const int32_t *context_lens,
                                void *out, int out_bf16, int n, int H, int KVH, int D, int BS,
                                int max_blocks, float scale, int window) {
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, out, out_bf16, n, H,
                        KVH, D, BS, max_blocks, scale, window, KV_BF16, KV_I8);
}

/* Keys bfloat16 in pairs within a block (KV_BF16P: k_cache [NB, KVH, D / 2, BS, 2]),
 * values bfloat16 rows or int8 rows with their scale. */
int kvflow_paged_decode_bf16p(const float *q, const void *k_cache, const void *v_cache,
                              const int32_t *block_tables, const int32_t *context_lens,
                              void *out, int out_bf16, int n, int H, int KVH, int D, int BS,
                              int max_blocks, float scale, int window) {
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, out, out_bf16, n, H,
                        KVH, D, BS, max_blocks, scale, window, KV_BF16P, KV_BF16);
}

int kvflow_paged_decode_bf16p_i8(const float *q, const void *k_cache, const void *v_cache,
                                 const int32_t *block_tables, const int32_t *context_lens,
                                 void *out, int out_bf16, int n, int H, int KVH, int D, int BS,
                                 int max_blocks, float scale, int window) {
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, out, out_bf16, n, H,
                        KVH, D, BS, max_blocks, scale, window, KV_BF16P, KV_I8);
}
