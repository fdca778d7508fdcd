/* Products of a few rows by a wide weight, at the speed of reading the weight (specflow.backends.lean.native).

   Y[m, n] = sum_k X[m, k] * W[n, k], W row-major [N, K], X [M, K], Y [M, N]: float32, or
   bfloat16 or float16 in and out (the weight widened to float32 as it is read, products and sums
   in float32, each result rounded to the 16-bit type to nearest even, as torch's 16-bit products
   do). float16 where the compiler has _Float16 (GCC 12+, Clang; specflow_has_f16()).

   A decoding pass multiplies 1 to ~8 rows by every weight matrix once, so its cost is the time to
   stream the weights from memory. Each thread takes a contiguous block of W's rows and reads them
   in order, one row at a time (one memory stream per thread: measured faster than interleaving
   two or four rows of W), against up to MC rows of X at once (X stays in L1). Portable C: GCC/Clang
   vector extensions, 8 floats wide (AVX2, AVX-512 or NEON pairs under -march=native).

   Every row of Y is computed by the same sequence of operations whatever M and the thread count
   are, so a row's result does not depend on the rows beside it (as oneDNN's packed product). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__F16C__) || defined(__FMA__)
#include <immintrin.h>
#endif

#define MC 6      /* the most rows of X one walk of a weight row takes (see ROWS_OF_W) */

typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline v8 load_f32(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }

static inline v8 load_bf16(const uint16_t *p) {    /* bfloat16 is float32's upper half */
#ifdef __AVX2__                                      /* one widening load (GCC splits the generic one) */
    __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    u16x8 h; memcpy(&h, p, sizeof h);
    u32x8 w = __builtin_convertvector(h, u32x8) << 16;
#endif
    v8 v; memcpy(&v, &w, sizeof v); return v;
}

static inline float hsum(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* out[i] = hsum(v[i]) for i < 4: the same sums in the same order, with AVX as vectors (each
   row's halves added, then two pairwise adds) instead of each row's lanes one by one. */
static inline __attribute__((always_inline)) void hsum4(const v8 *v, float *out) {
#ifdef __AVX__
    __m128 q[4];
    for (int i = 0; i < 4; i++) {
        __m256 x = (__m256)v[i];
        q[i] = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    }
    _mm_storeu_ps(out, _mm_hadd_ps(_mm_hadd_ps(q[0], q[1]), _mm_hadd_ps(q[2], q[3])));
#else
    for (int i = 0; i < 4; i++) out[i] = hsum(v[i]);
#endif
}

/* a + b * c. Every multiply-add of this file is one of these two, fused (one rounding) where the
   CPU has a fused multiply-add, else a product and a sum: the same operation on every path. The
   file is built with -ffp-contract=off, so the compiler fuses nothing by itself: left to choose,
   GCC's tuning for some CPUs fuses a sum of products in one loop and not in another (on Zen 3 it
   kept dot()'s chain unfused and fused the same sum unrolled over four keys), and then a value
   would depend on which loop computed it. */
static inline v8 madd(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)b, (__m256)c, (__m256)a);
#elif defined(__FP_FAST_FMAF)
    for (int i = 0; i < 8; i++) a[i] = __builtin_fmaf(b[i], c[i], a[i]);
    return a;
#else
    return a + b * c;
#endif
}

static inline float fmadd(float a, float b, float c) {
#if defined(__FMA__) || defined(__FP_FAST_FMAF)
    return __builtin_fmaf(b, c, a);
#else
    return a + b * c;
#endif
}

typedef int32_t i8v __attribute__((vector_size(32)));

/* x in every lane (one broadcast; `(v8){0} + x` is an add first, as 0 + -0 is +0) */
static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* each lane of `yes` where the lane of `mask` (a comparison's) is set, else of `no` */
static inline v8 pick(i8v mask, v8 yes, v8 no) {
    i8v y, o; memcpy(&y, &yes, sizeof y); memcpy(&o, &no, sizeof o);
    i8v r = (y & mask) | (o & ~mask);
    v8 out; memcpy(&out, &r, sizeof out); return out;
}

/* e^x in each lane, as one function of the lane's value alone (the same bits wherever a score
   sits and whichever loop computes it; exp1 is the same function on one value): x = n ln 2 + r,
   |r| <= ln 2 / 2, e^r by Cephes' polynomial, times 2^n: within 1 ulp of glibc's expf on a
   million values from -87.3 to 89. 0 below -87.3 (where expf turns subnormal: no weight beside
   the row's largest score, 1), +inf past 88.72, NaN stays NaN. Eight lanes in ~20 vector
   operations, where expf took ~15 cycles a value, a third of a key's attention. */
static inline v8 exp8(v8 x) {
    v8 big = (v8){0} + 88.72283f, small = (v8){0} + -87.3f;
    v8 c = pick(x > big, big, x);                                       /* NaN: compares false */
    c = pick(c < small, small, c);
    v8 n = c * 1.44269504088896341f;
#ifdef __AVX__
    n = (v8)_mm256_round_ps((__m256)n, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    for (int i = 0; i < 8; i++) n[i] = __builtin_nearbyintf(n[i]);
#endif
    v8 r = madd(c, n, (v8){0} + -0.693359375f);                         /* c - n ln 2, in two */
    r = madd(r, n, (v8){0} + 2.12194440e-4f);
    v8 p = (v8){0} + 1.9875691500e-4f;
    p = madd((v8){0} + 1.3981999507e-3f, p, r);
    p = madd((v8){0} + 8.3334519073e-3f, p, r);
    p = madd((v8){0} + 4.1665795894e-2f, p, r);
    p = madd((v8){0} + 1.6666665459e-1f, p, r);
    p = madd((v8){0} + 5.0000001201e-1f, p, r);
    p = madd(r + 1.0f, p, r * r);                                       /* 1 + r + r^2 p */
    v8 top = pick(n > 127.0f, (v8){0} + 1.0f, (v8){0});               /* n = 128: 2 x 2^127 */
    i8v e = (__builtin_convertvector(n - top, i8v) + 127) << 23;       /* 2^n, n in -126..127 */
    v8 two_n; memcpy(&two_n, &e, sizeof two_n);
    v8 out = p * (top + 1.0f) * two_n;
    out = pick(x > big, (v8){0} + INFINITY, out);
    out = pick(x < small, (v8){0}, out);
    return pick(x != x, x, out);
}

static inline float exp1(float x) { return exp8((v8){0} + x)[0]; }

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t f32_to_bf16(float f) {      /* to nearest even; NaN stays NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One row w of W (row n) against MCK rows of X from row m0 (2..MC, a compile-time count, so the 2 x MCK
   accumulators stay in registers: 12 of AVX2's 16 at MCK = 6), over the columns k0..k1 (multiples
   of 16, k1 <= k16 = K - K % 16). A walk that does not start at column 0 takes its sums from acc
   [MCK][2], one that ends before k16 leaves them there; the walk that reaches k16 adds the tail
   columns and stores the results. Walked in consecutive column chunks or all at once, a result is
   the same sequence of operations. pf: a walk that reads the row from memory; from two input
   rows up it prefetches the weight PF elements ahead into L2 (8 KB of float32). A one-row walk
   is light enough for the hardware prefetchers to keep the memory busy (a software prefetch cost
   it ~5%); with more rows each line of the weight takes more work, the hardware fell behind and
   the walk stopped overlapping the read with the arithmetic: SmolLM2's products over all its
   weights, 2 threads, 1/2/5/8/16 rows took 20.3/23.7/25.3/34.6/49.5 ms with a prefetch to L1 1
   KB ahead, 18.1/17-19/19-20/23.4/42-47 with this one (2-core Zen 3 EPYC). Not inlined: inside
   the caller, the six input-row pointers no longer fit the general registers and were reloaded
   from the stack in the loop (6 rows 12% slower). */
#define PF 2048
#define GROUP(NAME, WT, LOADW, WIDEN, STORE, MCK)                                                 \
__attribute__((noinline)) static void NAME##_##MCK(const WT *w, const float *x, void *Y, int64_t n, \
                                int64_t m0,                                                      \
                                int64_t N, int64_t K, int64_t k0, int64_t k1, int64_t k16,       \
                                v8 *acc, int64_t pf) {                                           \
    v8 a[MCK][2];                                                                                \
    for (int j = 0; j < MCK; j++) {                                                              \
        a[j][0] = k0 ? acc[2 * j] : (v8){0};                                                     \
        a[j][1] = k0 ? acc[2 * j + 1] : (v8){0};                                                 \
    }                                                                                            \
    for (int64_t k = k0; k < k1; k += 16) {                                                      \
        v8 w0 = LOADW(w + k), w1 = LOADW(w + k + 8);                                             \
        if (pf) __builtin_prefetch(w + k + pf, 0, 2);                                            \
        for (int j = 0; j < MCK; j++) {                                                          \
            a[j][0] = madd(a[j][0], w0, load_f32(x + j * K + k));                                \
            a[j][1] = madd(a[j][1], w1, load_f32(x + j * K + k + 8));                            \
        }                                                                                        \
    }                                                                                            \
    if (k1 < k16) {                                                                              \
        for (int j = 0; j < MCK; j++) { acc[2 * j] = a[j][0]; acc[2 * j + 1] = a[j][1]; }        \
        return;                                                                                  \
    }                                                                                            \
    for (int j = 0; j < MCK; j++) {                                                              \
        float r = hsum(a[j][0] + a[j][1]);                                                       \
        for (int64_t k = k16; k < K; k++) r = fmadd(r, WIDEN(w[k]), x[j * K + k]);             \
        STORE(Y, (m0 + j) * N + n, r);                                                           \
    }                                                                                            \
}

/* Rows n and n + 1 of W against MCK rows of X from row m0, over every column: each result by the
   same operations as GROUP's walk of its row alone (two accumulators over the 16-column steps,
   summed, then the tail), so a result's bits do not change; each load of X serves both weight
   rows. A walk of one weight row loads 2 + 2 MCK vectors for 2 MCK multiply-adds; two weight
   rows load 4 + 2 MCK vectors for 4 MCK (each X vector held in a register for both). It needs
   4 MCK + 6 vector registers: where the compiler has 32 (AVX-512's), PAIR_ROWS is 1. Taken from
   6 rows of X on: SmolLM2's 30 layers' products, 2 threads, 2-core Zen 4, the paired walk
   against the single one (median of 9 alternations): 6 rows 0.92x, 8 rows 0.89x, but 3-5 rows
   1.03-1.05x (there the single walk keeps up with the memory) and 1-2 rows even. */
#if defined(__AVX512VL__)
#define PAIR_ROWS 1
#else
#define PAIR_ROWS 0
#endif
#if PAIR_ROWS      /* its register constraint is x86's; elsewhere no paired walk at all */
#define PAIR(NAME, WT, LOADW, WIDEN, STORE, MCK)                                                  \
__attribute__((noinline)) static void NAME##_pair_##MCK(const WT *w, const float *x, void *Y,     \
                                int64_t n, int64_t m0, int64_t N, int64_t K, int64_t k16,        \
                                int64_t pf) {                                                    \
    const WT *u = w + K;                                                                         \
    v8 a[MCK][2], b[MCK][2];                                                                     \
    for (int j = 0; j < MCK; j++) a[j][0] = a[j][1] = b[j][0] = b[j][1] = (v8){0};               \
    for (int64_t k = 0; k < k16; k += 16) {                                                      \
        v8 w0 = LOADW(w + k), w1 = LOADW(w + k + 8), u0 = LOADW(u + k), u1 = LOADW(u + k + 8);   \
        if (pf) { __builtin_prefetch(w + k + pf, 0, 2); __builtin_prefetch(u + k + pf, 0, 2); }  \
        for (int j = 0; j < MCK; j++) {                                                          \
            v8 x0 = load_f32(x + j * K + k), x1 = load_f32(x + j * K + k + 8);                   \
            __asm__("" : "+v"(x0), "+v"(x1));     /* in registers: each load serves two rows */  \
            a[j][0] = madd(a[j][0], w0, x0);                                                     \
            a[j][1] = madd(a[j][1], w1, x1);                                                     \
            b[j][0] = madd(b[j][0], u0, x0);                                                     \
            b[j][1] = madd(b[j][1], u1, x1);                                                     \
        }                                                                                        \
    }                                                                                            \
    for (int j = 0; j < MCK; j++) {                                                              \
        float r = hsum(a[j][0] + a[j][1]), q = hsum(b[j][0] + b[j][1]);                          \
        for (int64_t k = k16; k < K; k++) r = fmadd(r, WIDEN(w[k]), x[j * K + k]);             \
        for (int64_t k = k16; k < K; k++) q = fmadd(q, WIDEN(u[k]), x[j * K + k]);             \
        STORE(Y, (m0 + j) * N + n, r);                                                           \
        STORE(Y, (m0 + j) * N + n + 1, q);                                                       \
    }                                                                                            \
}

#define PAIR_WALK(NAME, pf)                                                                      \
    switch (mc) {                                                                                \
    case 2: NAME##_pair_2(W + n * K, X + m0 * K, Y, n, m0, N, K, k16, pf); break;                \
    case 3: NAME##_pair_3(W + n * K, X + m0 * K, Y, n, m0, N, K, k16, pf); break;                \
    case 4: NAME##_pair_4(W + n * K, X + m0 * K, Y, n, m0, N, K, k16, pf); break;                \
    case 5: NAME##_pair_5(W + n * K, X + m0 * K, Y, n, m0, N, K, k16, pf); break;                \
    default: NAME##_pair_6(W + n * K, X + m0 * K, Y, n, m0, N, K, k16, pf); break;               \
    }
#else
#define PAIR(NAME, WT, LOADW, WIDEN, STORE, MCK)
#define PAIR_WALK(NAME, pf)
#endif

/* Rows n0..n1 of W against the one row of X (M = 1), the one-row case of GROUP: each result by
   the same operations as a GROUP walk gives each of its rows (two accumulators over the
   16-column steps, summed, then the tail), so a row's bits do not depend on M, in one call for
   the thread's whole share of rows (a single stream through W): GROUP's one-row walk, called
   per weight row with the chunking arguments the many-row walks need, cost 2-8% of a one-row
   product of SmolLM2's matrices (576 columns, 36 steps a row). M = 1 is the only way to a group
   of one row (groups of up to MC rows split M evenly), so GROUP starts at two.
   Walking four rows side by side instead (each load of X serving four) ran at half the speed:
   four interleaved streams defeat the prefetchers where one long one does not. */
#define SINGLE(NAME, WT, LOADW, WIDEN, STORE)                                                     \
__attribute__((noinline)) static void NAME##_single(const WT *W, const float *x, void *Y,        \
                                                    int64_t n0, int64_t n1, int64_t K,           \
                                                    int64_t k16) {                               \
    for (int64_t n = n0; n < n1; n++) {                                                          \
        const WT *w = W + n * K;                                                                 \
        v8 a0 = (v8){0}, a1 = (v8){0};                                                           \
        for (int64_t k = 0; k < k16; k += 16) {                                                  \
            a0 = madd(a0, LOADW(w + k), load_f32(x + k));                                        \
            a1 = madd(a1, LOADW(w + k + 8), load_f32(x + k + 8));                                \
        }                                                                                        \
        float r = hsum(a0 + a1);                                                                 \
        for (int64_t k = k16; k < K; k++) r = fmadd(r, WIDEN(w[k]), x[k]);                       \
        STORE(Y, n, r);                                                                          \
    }                                                                                            \
}

/* The walk of row n of W over columns k0..k1 against the group of mc rows of X from row m0. */
#define WALK(NAME, k0, k1, acc, pf)                                                              \
    switch (mc) {                                                                                \
    case 2: NAME##_2(W + n * K, X + m0 * K, Y, n, m0, N, K, k0, k1, k16, acc, pf); break;         \
    case 3: NAME##_3(W + n * K, X + m0 * K, Y, n, m0, N, K, k0, k1, k16, acc, pf); break;         \
    case 4: NAME##_4(W + n * K, X + m0 * K, Y, n, m0, N, K, k0, k1, k16, acc, pf); break;         \
    case 5: NAME##_5(W + n * K, X + m0 * K, Y, n, m0, N, K, k0, k1, k16, acc, pf); break;         \
    default: NAME##_6(W + n * K, X + m0 * K, Y, n, m0, N, K, k0, k1, k16, acc, pf); break;        \
    }

/* Rows n0..n1 of W against the M rows of X (float32); STORE(Y, index, value) stores a result. The
   M rows are split into ceil(M / MC) groups of near-equal size.

   One group (up to MC rows), or rows of X that fit in L1 together (M x K <= X_IN_L1 floats,
   24 KB): the first group's walk of a weight row streams it from memory, the others walk it
   again from L1. 5 or 6 rows are thus one walk, about one row's time (the weight read), not a
   walk of 4 and a second, latency-bound walk of 1 or 2 (1.4-1.5x a row's time before; 1.1x).

   More rows of X than L1 holds (compute-bound): the weight rows go in blocks of NB (float32
   weights: 5 or 6 rows in two groups, not one: one walk of 5 rows of 1536 columns (30 KB of X
   beside the weight's row) reloaded X from L2 at every step, SmolLM2's down products 1.4-1.6x a
   one-row product's time, 1.23-1.28x in two groups, 30 layers' worth streamed, 2-core Zen 4;
   16-bit weights stay one group: widening each weight twice cost more, 1.5x -> 1.7-2x). The first
   group's walks stream a block from memory; each other group then walks the block again from
   L2, in column chunks of KC, so that its rows of X (at most MC x KC floats) stay in L1 through
   the block, each sum carried between chunks in acc. Walking every group along each weight row
   in turn cycled all the rows of X through L1 for every weight row: 16-18 rows of SmolLM2's
   matrices took 1.2x as long. The second group's walks prefetch the next block into L2 (NB x K
   elements ahead), so the memory works while the later groups compute: SmolLM2 passes of 9 and
   17 queries 3-7% faster (a prefetch into L1 there was 11% slower). */
#define X_IN_L1 6144
#define NB 16
#define KC 768
#define ROWS_OF_W(NAME, WT, LOADW, WIDEN, STORE)                                                  \
GROUP(NAME, WT, LOADW, WIDEN, STORE, 2) GROUP(NAME, WT, LOADW, WIDEN, STORE, 3)                   \
GROUP(NAME, WT, LOADW, WIDEN, STORE, 4) GROUP(NAME, WT, LOADW, WIDEN, STORE, 5)                   \
GROUP(NAME, WT, LOADW, WIDEN, STORE, 6)                                                           \
SINGLE(NAME, WT, LOADW, WIDEN, STORE)                                                             \
PAIR(NAME, WT, LOADW, WIDEN, STORE, 2) PAIR(NAME, WT, LOADW, WIDEN, STORE, 3)                     \
PAIR(NAME, WT, LOADW, WIDEN, STORE, 4) PAIR(NAME, WT, LOADW, WIDEN, STORE, 5)                     \
PAIR(NAME, WT, LOADW, WIDEN, STORE, 6)                                                            \
static void NAME(const WT *W, const float *X, void *Y, int64_t n0, int64_t n1, int64_t N,          \
                 int64_t K, int64_t M) {                                                         \
    int64_t k16 = K - K % 16;                                                                    \
    int64_t groups = (M + MC - 1) / MC;                                                          \
    if (groups == 1 && M > 4 && M * K > X_IN_L1 && sizeof(WT) == 4) groups = 2;   /* see above */ \
    int64_t size = M / groups, larger = M % groups;                                              \
    v8 acc[NB][2 * MC];                                                                          \
    if (groups == 1 || M * K <= X_IN_L1) {                                                       \
        int64_t n = n0;                                                                          \
        if (M == 1) {                               /* one stream, one call */                   \
            NAME##_single(W, X, Y, n0, n1, K, k16);                                              \
            return;                                                                              \
        }                                                                                        \
        if (PAIR_ROWS && M >= 6)                    /* two weight rows a walk */                 \
            for (; n + 1 < n1; n += 2)                                                           \
                for (int64_t g = 0, m0 = 0, mc; g < groups; g++, m0 += mc) {                     \
                    mc = size + (g < larger);                                                    \
                    PAIR_WALK(NAME, g == 0 ? PF : 0)                                             \
                }                                                                                \
        for (; n < n1; n++)                                                                      \
            for (int64_t g = 0, m0 = 0, mc; g < groups; g++, m0 += mc) {                         \
                mc = size + (g < larger);                                                        \
                WALK(NAME, 0, k16, acc[0], g == 0 ? PF : 0)   /* acc not touched */            \
            }                                                                                    \
        return;                                                                                  \
    }                                                                                            \
    for (int64_t b0 = n0; b0 < n1; b0 += NB) {                                                   \
        int64_t b1 = b0 + NB < n1 ? b0 + NB : n1;                                                \
        for (int64_t g = 0, m0 = 0; g < groups; g++) {                                           \
            int64_t mc = size + (g < larger), chunk = g == 0 ? k16 : KC;                         \
            int64_t pf = g == 0 ? PF : g == 1 && b1 < n1 ? NB * K : 0;                          \
            for (int64_t c0 = 0;; c0 += chunk) {                                                 \
                int64_t c1 = c0 + chunk < k16 ? c0 + chunk : k16;                                \
                for (int64_t n = b0; n < b1; n++) WALK(NAME, c0, c1, acc[n - b0], pf)            \
                if (c1 == k16) break;                                                            \
            }                                                                                    \
            m0 += mc;                                                                            \
        }                                                                                        \
    }                                                                                            \
}

#define AS_F32(v) (v)
#define STORE_F32(Y, i, r) (((float *)(Y))[i] = (r))
#define STORE_BF16(Y, i, r) (((uint16_t *)(Y))[i] = f32_to_bf16(r))
ROWS_OF_W(rows_f32, float, load_f32, AS_F32, STORE_F32)
ROWS_OF_W(rows_bf16, uint16_t, load_bf16, bf16_to_f32, STORE_BF16)
ROWS_OF_W(rows_bf16w, uint16_t, load_bf16, bf16_to_f32, STORE_F32)    /* bf16 W, float32 X and Y */

#ifdef __FLT16_MAX__
typedef _Float16 h8 __attribute__((vector_size(16)));
static inline v8 load_f16(const _Float16 *p) {
#ifdef __F16C__                                      /* one conversion (GCC splits the generic one) */
    __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    v8 v; memcpy(&v, &f, sizeof v); return v;
#else
    h8 h; memcpy(&h, p, sizeof h); return __builtin_convertvector(h, v8);
#endif
}
#define F16_TO_F32(h) ((float)(h))
#define STORE_F16(Y, i, r) (((_Float16 *)(Y))[i] = (_Float16)(r))
ROWS_OF_W(rows_f16, _Float16, load_f16, F16_TO_F32, STORE_F16)
ROWS_OF_W(rows_f16w, _Float16, load_f16, F16_TO_F32, STORE_F32)    /* float16 W, float32 X and Y */
#endif

#define SPLIT(CALL)                                                                              \
    _Pragma("omp parallel num_threads(threads)")                                                 \
    {                                                                                            \
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();                             \
        int64_t per = (N + T - 1) / T;                                                           \
        int64_t n0 = t * per, n1 = n0 + per < N ? n0 + per : N;                                  \
        if (n0 < N) CALL;                                                                        \
    }

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline float widen(const void *p, int64_t i, int dtype) {
    if (dtype == F32) return ((const float *)p)[i];
    if (dtype == BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
#ifdef __FLT16_MAX__
    return (float)((const _Float16 *)p)[i];
#else
    return 0.0f;
#endif
}

/* X as float32 rows for the products: X itself (float32, no norm), else a copy widened to float32
   and, with a norm weight G [K], each row RMS-normalised first (as the lean forward's _rms):
   x / sqrt(mean(x^2) + eps) * G, in float32. NULL: out of memory. */
/* row [K] (float32, in place) RMS-normalised and scaled by G [K] of `dtype`, in float32: the one
   norm of the native product and of the native pass. The squares are summed in 32 lanes (four
   chains of eight), the lanes in a fixed order, the tail past a multiple of 32 after them: one
   chain of K dependent adds, as written before, cost 4 cycles a value (~2,300 for SmolLM2's
   576, twice a layer a query: 5% of a 5-position pass's layers, the other thread waiting). */
static void rms_in_place(float *row, const void *G, float eps, int dtype, int64_t K) {
    int64_t k32 = K - K % 32, k = 0;
    v8 acc[4] = {(v8){0}, (v8){0}, (v8){0}, (v8){0}};
    for (; k < k32; k += 32)
        for (int i = 0; i < 4; i++) {
            v8 v = load_f32(row + k + 8 * i);
            acc[i] = madd(acc[i], v, v);
        }
    float ss = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
    for (; k < K; k++) ss = fmadd(ss, row[k], row[k]);
    float r = 1.0f / sqrtf(ss / (float)K + eps);
    for (int64_t k = 0; k < K; k++) row[k] = row[k] * r * widen(G, k, dtype);
}

static const float *prepare_x(const void *X, const void *G, float eps, int dtype, int64_t M,
                              int64_t K, float **owned) {
    *owned = NULL;
    if (dtype == F32 && !G) return (const float *)X;
    float *x = malloc((size_t)(M * K) * sizeof(float));
    if (!x) return NULL;
    for (int64_t m = 0; m < M; m++) {
        float *row = x + m * K;
        for (int64_t k = 0; k < K; k++) row[k] = widen(X, m * K + k, dtype);
        if (G) rms_in_place(row, G, eps, dtype, K);
    }
    *owned = x;
    return x;
}

/* Y = X W^T (G: rms_norm(X) W^T). dtype: 0 float32, 1 bfloat16, 2 float16 (W, X, G, Y alike).
   Returns 0, 1 out of memory, 2 a dtype this build lacks. */
int specflow_gemv(const void *W, const void *X, void *Y, int64_t N, int64_t K, int64_t M,
                  int threads, int dtype, const void *G, float eps) {
#ifndef __FLT16_MAX__
    if (dtype == F16) return 2;
#endif
    float *owned;
    const float *x = prepare_x(X, G, eps, dtype, M, K, &owned);
    if (!x) return 1;
    if (dtype == F32) {
        SPLIT(rows_f32((const float *)W, x, Y, n0, n1, N, K, M))
    } else if (dtype == BF16) {
        SPLIT(rows_bf16((const uint16_t *)W, x, Y, n0, n1, N, K, M))
    }
#ifdef __FLT16_MAX__
    else {
        SPLIT(rows_f16((const _Float16 *)W, x, Y, n0, n1, N, K, M))
    }
#endif
    free(owned);
    return 0;
}

int specflow_has_f16(void) {
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
}

/* The largest of p[0..V) (NaN passed over; -inf for none) and whether any is NaN: eight lanes
   at a time, four vectors in flight. */
static float row_top(const float *p, int64_t V, int *any_nan) {
    v8 top[4];
    i8v nan = (i8v){0};
    for (int c = 0; c < 4; c++) top[c] = (v8){0} - INFINITY;
    int64_t j = 0;
    for (; j + 32 <= V; j += 32)
        for (int c = 0; c < 4; c++) {
            v8 v = load_f32(p + j + 8 * c);
#ifdef __AVX__                                           /* max_ps keeps top where v is NaN */
            top[c] = (v8)_mm256_max_ps((__m256)v, (__m256)top[c]);
            nan |= (i8v)_mm256_cmp_ps((__m256)v, (__m256)v, _CMP_UNORD_Q);
#else
            nan |= v != v;
            top[c] = pick(v > top[c], v, top[c]);
#endif
        }
    float m = -INFINITY;
    *any_nan = 0;
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 8; i++) {
            if (top[c][i] > m) m = top[c][i];
            *any_nan |= nan[i] != 0;
        }
    for (; j < V; j++) {
        if (p[j] != p[j]) *any_nan = 1;
        else if (p[j] > m) m = p[j];
    }
    return m;
}

/* out[r] = the largest value of row r of x [R, V] float32, NaN where the row has one: torch's
   amax(-1). One thread: a round's few rows of logits, where torch's reduction opened a parallel
   region per call (~45 us for a 49,152-wide row just written by the LM head, ~20 here). */
int specflow_row_max(const float *x, int64_t R, int64_t V, float *out) {
    for (int64_t r = 0; r < R; r++) {
        int any_nan;
        float m = row_top(x + r * V, V, &any_nan);
        out[r] = any_nan ? NAN : m;
    }
    return 0;
}

/* out[r] = the index of row r's largest value among x [R, V] float32, as torch.argmax(-1) on a
   CPU: the first index of the maximum, the first NaN where a row has one (NaN counts as the
   largest). One thread: a verifier's few rows, where torch's argmax (an index carried beside
   every compare, 43 us for a 49,152-wide row here) cost ten times its max (3.6 us). Here the
   max (row_top), then the first index equal to it. */
int specflow_argmax(const float *x, int64_t R, int64_t V, int64_t *out) {
    for (int64_t r = 0; r < R; r++) {
        const float *p = x + r * V;
        int any_nan;
        float m = row_top(p, V, &any_nan);
        int64_t at = 0;
        if (any_nan) {
            while (p[at] == p[at]) at++;
        } else {
            int64_t v8s = V - V % 8;
            for (at = 0; at < v8s; at += 8) {
#ifdef __AVX__
                int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + at),
                                                             _mm256_set1_ps(m), _CMP_EQ_OQ));
                if (!mask) continue;                                   /* no lane equal */
                at += __builtin_ctz((unsigned)mask);
#else
                i8v hit = load_f32(p + at) == m;
                uint64_t w[4];
                memcpy(w, &hit, sizeof w);
                if (!(w[0] | w[1] | w[2] | w[3])) continue;               /* no lane equal */
                int lane = 0;
                while (!hit[lane]) lane++;
                at += lane;
#endif
                break;
            }
            if (at >= v8s)
                for (at = v8s; at < V && p[at] != m; at++) {}
        }
        out[r] = at;
    }
    return 0;
}

/* ---- A whole pass through the decoder layers, float32 (specflow_layers) -----------------------

   The lean forward's per-layer sequence (RMSNorm, q/k/v product, rotary, cache write, attention,
   o product, residual, RMSNorm, gate/up product, SiLU x up, down product, residual) as one call
   for a pass of a few queries (up to native.MAX_ROWS). Query r of cache slot slot[r] (rotated by
   its rows of cos and sin) is written at cache column col[r], and sees its slot's keys
   0..below[r]-1 and, with a tree (see != NULL), key below[r] + i where see[r, i] (i < S): a
   causal row sees 0..col[r] (below = col + 1, no tree); a token tree's node sees the committed
   prefix and its ancestors.
   Every query's keys and values are written before any query attends, so a row's later
   positions see its earlier ones. Python's cost per operation (a few microseconds each, about 35
   per layer) is most of a small model's pass; here it is one call per pass.

   A query's result does not depend on the other queries of the pass or on the thread count:
   each product row is computed as in specflow_gemv, each (query, head) attention by one thread
   over its visible keys in column order (a tree node's ancestors come in the same order as the
   same tokens' keys in a chain, so it scores as the chain does). */

static void rms_rows(const float *X, const float *G, float eps, int64_t M, int64_t K, float *out) {
    memcpy(out, X, (size_t)(M * K) * sizeof(float));
    for (int64_t m = 0; m < M; m++) rms_in_place(out + m * K, G, eps, F32, K);
}

static void rotary(float *v, const float *cos, const float *sin, int64_t D) {
    int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

static inline float dot(const float *a, const float *b, int64_t D) {
    int64_t d8 = D - D % 8;
    v8 acc = (v8){0};
    for (int64_t d = 0; d < d8; d += 8) acc = madd(acc, load_f32(a + d), load_f32(b + d));
    float s = hsum(acc);
    for (int64_t d = d8; d < D; d++) s = fmadd(s, a[d], b[d]);
    return s;
}

/* s[i] = dot(a, b + i * D, D) for four consecutive rows of b: each by dot()'s operations, the four
   sums in flight together instead of one chain of dependent multiply-adds. */
static inline void dot4(const float *a, const float *b, int64_t D, float s[4]) {
    int64_t d8 = D - D % 8;
    v8 acc[4] = {(v8){0}, (v8){0}, (v8){0}, (v8){0}};
    for (int64_t d = 0; d < d8; d += 8) {
        v8 x = load_f32(a + d);
        for (int i = 0; i < 4; i++) acc[i] = madd(acc[i], x, load_f32(b + i * D + d));
    }
    for (int i = 0; i < 4; i++) {
        s[i] = hsum(acc[i]);
        for (int64_t d = d8; d < D; d++) s[i] = fmadd(s[i], a[d], b[i * D + d]);
    }
}

#include "blocks.c"      /* GGUF blocks: their product (after dot(), which it uses) */

/* Thread t of T's share of Y [M, N] = X [M, K] W^T for a weight of `kind` (F32, BF16_WEIGHTS:
   bfloat16 W widened as it is read, F16_WEIGHTS, or blocks.c's BLOCK_* tiles: block_share),
   inside a parallel region every thread of which calls it: W's rows split as SPLIT splits
   them; a row's result does not depend on the split. */
static void product_share(const void *W, int kind, const float *X, float *Y, int64_t N,
                          int64_t K, int64_t M, int64_t t, int64_t T, const quant_room *room,
                          int64_t *taken) {
    if (kind != F32 && kind != BF16_WEIGHTS && kind != F16_WEIGHTS) {
        block_share(W, kind, X, Y, N, K, M, t, T, room, taken);
        return;
    }
    int64_t per = (N + T - 1) / T, n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
    if (n0 >= N) return;
    if (kind == F32) rows_f32((const float *)W, X, Y, n0, n1, N, K, M);
    else if (kind == BF16_WEIGHTS) rows_bf16w((const uint16_t *)W, X, Y, n0, n1, N, K, M);
#ifdef __FLT16_MAX__
    else rows_f16w((const _Float16 *)W, X, Y, n0, n1, N, K, M);
#endif
}

/* Y [M, N] = X [M, K] W^T for a weight of `kind` (product_share) in a parallel region of its
   own. 0, or 1 out of memory. */
static int product(const void *W, int kind, const float *X, float *Y, int64_t N, int64_t K,
                   int64_t M, int threads) {
    int nt = threads > 0 ? threads : 1;
    quant_room room = {0};
    if (kind != F32 && kind != BF16_WEIGHTS && kind != F16_WEIGHTS) {
        int together = M * K >= QUANT_SPLIT;     /* one slot the threads fill, or one each */
        if (room_alloc(&room, M * K, together ? 1 : nt, 0, kind != BLOCK_BF16,
                       kind == BLOCK_Q8_0, kind == BLOCK_BF16))
            return 1;
    }
    int64_t taken = 0;
    _Pragma("omp parallel num_threads(nt)")
    product_share(W, kind, X, Y, N, K, M, omp_get_thread_num(), omp_get_num_threads(), &room,
                  &taken);
    room_free(&room);
    return 0;
}

/* Y [M, N] float32 = X [M, K] float32 times a held weight W^T of `kind` (F32, BF16_WEIGHTS,
   F16_WEIGHTS or BLOCK_* blocks: product()); G [K] float32 or NULL: RMSNorm(X) x G first (eps).
   Returns 0, 1 out of memory, 2 a block weight whose K is not a multiple of 32. */
int specflow_held(const void *W, int kind, const float *X, float *Y, int64_t N, int64_t K,
                  int64_t M, int threads, const float *G, float eps) {
    if (kind != F32 && kind != BF16_WEIGHTS && kind != F16_WEIGHTS && K % QK) return 2;
    float *owned;
    const float *x = prepare_x(X, G, eps, F32, M, K, &owned);
    if (!x) return 1;
    int failed = product(W, kind, x, Y, N, K, M, threads);
    free(owned);
    return failed;
}

/* out[D] = softmax(q . K[j] * scale) V[j] over the keys j < n that are visible: j < below, or
   see[j - below] (see: NULL, nothing past below). scores: n floats of scratch.

   Each score is dot()'s sequence of operations and each output element sums its keys in column
   order, whatever the other keys are; the loops are only arranged for the core: the keys below
   `below` (all visible) are scored four at a time (dot4), and with D a multiple of 8 up to 128
   the output is summed in registers (not through memory, which the compiler must assume V may
   alias). */
static inline __attribute__((always_inline)) void attend_d(
        const float *q, const float *K, const float *V, int64_t n, int64_t below,
        const uint8_t *see, const int64_t D, float scale, float *scores, float *out) {
    float top = -INFINITY;
    int64_t b4 = below - below % 4, j = 0;
    for (; j < b4; j += 4) {
        float s[4];
        dot4(q, K + j * D, D, s);
        for (int i = 0; i < 4; i++) {
            scores[j + i] = s[i] * scale;
            if (scores[j + i] > top) top = scores[j + i];
        }
    }
    for (; j < n; j++) {
        if (j >= below && !see[j - below]) continue;
        scores[j] = dot(q, K + j * D, D) * scale;
        if (scores[j] > top) top = scores[j];
    }
    float total = 0.0f;
    for (j = 0; j < n; j++) {
        if (j >= below && !see[j - below]) continue;
        scores[j] = exp1(scores[j] - top);
        total += scores[j];
    }
    float inv = 1.0f / total;
    if (D % 8 == 0 && D <= 128) {
        v8 o[16];
        for (int64_t i = 0; i < D / 8; i++) o[i] = (v8){0};
        for (j = 0; j < n; j++) {
            if (j >= below && !see[j - below]) continue;
            const float *v = V + j * D;
            v8 p = splat(scores[j]);           /* e^s: never -0 */
            for (int64_t i = 0; i < D / 8; i++) o[i] = madd(o[i], p, load_f32(v + 8 * i));
        }
        for (int64_t i = 0; i < D / 8; i++) {
            v8 r = o[i] * inv;
            memcpy(out + 8 * i, &r, sizeof r);
        }
        return;
    }
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (j = 0; j < n; j++) {
        if (j >= below && !see[j - below]) continue;
        const float *v = V + j * D;
        float p = scores[j];
        for (int64_t d = 0; d < D; d++) out[d] = fmadd(out[d], p, v[d]);
    }
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
}

/* Attention of NH (<= GH) query heads q [NH, D] that read one key/value head, each exactly as
   attend_d computes it alone (each score dot()'s operations, exp1, the same column-order sums),
   into out [NH, D]; scores: GH x n floats of scratch. Only the loops differ: the keys go in
   blocks of four through every head (a block is read from memory once, then from L1: a head
   walked alone read all n keys per head, from L2 or further at a long context), the scores'
   lanes are summed four keys at a time (hsum4), e^x is taken eight scores at a time (exp8), and
   the values are summed 32 columns at a time for every head (12 accumulators and 4 values in
   registers). D: a multiple of 32. */
#define GH 3
/* out [NH, D] = each head's values summed with its weights scores[h x n + j] (column order) x
   inv[h], NV x 8 columns a walk (NH x NV accumulators in registers: one or two heads take 64, so
   that more sums are in flight than one multiply-add's latency). */
static inline __attribute__((always_inline)) void value_sums(
        const int NH, const int NV, const float *V, int64_t n, int64_t below, const uint8_t *see,
        const int64_t D, const float *scores, const float *inv, float *out) {
    for (int64_t c = 0; c < D; c += 8 * NV) {
        v8 o[GH][8];            /* sized by constants: [NV] would be a variable-length array,
                                   kept on the stack (every sum through memory) */
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < NV; i++) o[h][i] = (v8){0};
        for (int64_t j = 0; j < n; j++) {
            if (j >= below && !see[j - below]) continue;
            const float *v = V + j * D + c;
            v8 vv[8];
            for (int i = 0; i < NV; i++) vv[i] = load_f32(v + 8 * i);
            for (int h = 0; h < NH; h++) {
                v8 p = splat(scores[h * n + j]);     /* e^s: never -0 */
                for (int i = 0; i < NV; i++) o[h][i] = madd(o[h][i], p, vv[i]);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < NV; i++) {
                v8 r = o[h][i] * inv[h];
                memcpy(out + h * D + c + 8 * i, &r, sizeof r);
            }
    }
}

/* Four keys' scores of one head (hsum4's sums of acc[0..4) x scale) into s[0..4), and the
   largest kept lane by lane in top: `if (s > top) top = s` four at a time (a NaN passed over), so
   the row's largest is the same value whichever lanes its scores went through. */
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i4v __attribute__((vector_size(16)));
static inline __attribute__((always_inline)) v4 scores4(const v8 *acc, float scale, float *s,
                                                        v4 top) {
    float h[4];
    hsum4(acc, h);
    v4 x, out;
    memcpy(&x, h, sizeof x);
    x = x * scale;
    memcpy(s, &x, sizeof x);
    i4v more = x > top, a, b;
    memcpy(&a, &x, sizeof a);
    memcpy(&b, &top, sizeof b);
    a = (a & more) | (b & ~more);
    memcpy(&out, &a, sizeof out);
    return out;
}

static inline __attribute__((always_inline)) void attend_heads(
        const float *q, const int NH, const float *K, const float *V, int64_t n, int64_t below,
        const uint8_t *see, const int64_t D, float scale, float *scores, float *out) {
    float top[GH], total[GH], inv[GH];
    v4 top4[GH];
    for (int h = 0; h < NH; h++) {
        top[h] = -INFINITY;
        top4[h] = (v4){-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    }
    int64_t b4 = below - below % 4, j = 0;
    for (; j + 8 <= b4; j += 8) {         /* eight keys a block: eight chains in flight a head */
        const float *k = K + j * D;
        for (int h = 0; h < NH; h++) {
            const float *qh = q + h * D;
            v8 acc[8] = {(v8){0}, (v8){0}, (v8){0}, (v8){0}, (v8){0}, (v8){0}, (v8){0}, (v8){0}};
            for (int64_t d = 0; d < D; d += 8) {
                v8 x = load_f32(qh + d);
                for (int i = 0; i < 8; i++) acc[i] = madd(acc[i], x, load_f32(k + i * D + d));
            }
            float *sh = scores + h * n + j;
            top4[h] = scores4(acc, scale, sh, top4[h]);
            top4[h] = scores4(acc + 4, scale, sh + 4, top4[h]);
        }
    }
    for (; j < b4; j += 4) {
        const float *k = K + j * D;
        for (int h = 0; h < NH; h++) {
            const float *qh = q + h * D;
            v8 acc[4] = {(v8){0}, (v8){0}, (v8){0}, (v8){0}};
            for (int64_t d = 0; d < D; d += 8) {
                v8 x = load_f32(qh + d);
                for (int i = 0; i < 4; i++) acc[i] = madd(acc[i], x, load_f32(k + i * D + d));
            }
            top4[h] = scores4(acc, scale, scores + h * n + j, top4[h]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int i = 0; i < 4; i++)
            if (top4[h][i] > top[h]) top[h] = top4[h][i];
    for (; j < n; j++) {
        if (j >= below && !see[j - below]) continue;
        for (int h = 0; h < NH; h++) {
            float sc = dot(q + h * D, K + j * D, D) * scale;
            scores[h * n + j] = sc;
            if (sc > top[h]) top[h] = sc;
        }
    }
    int64_t b8 = below - below % 8;
    for (int h = 0; h < NH; h++) {
        float *sh = scores + h * n;
        v8 m = (v8){0} + top[h];
        for (j = 0; j < b8; j += 8) {
            v8 e = exp8(load_f32(sh + j) - m);
            memcpy(sh + j, &e, sizeof e);
        }
        for (; j < n; j++) {
            if (j >= below && !see[j - below]) continue;
            sh[j] = exp1(sh[j] - top[h]);
        }
        total[h] = 0.0f;
    }
    for (j = 0; j < n; j++) {              /* each head's sum in column order, the heads' sums */
        if (j >= below && !see[j - below]) continue;          /* side by side (NH chains) */
        for (int h = 0; h < NH; h++) total[h] += scores[h * n + j];
    }
    for (int h = 0; h < NH; h++) inv[h] = 1.0f / total[h];
    if (NH < 3 && D % 64 == 0) value_sums(NH, 8, V, n, below, see, D, scores, inv, out);
    else value_sums(NH, 4, V, n, below, see, D, scores, inv, out);
}

/* nh (1..GH) heads of one key/value head: attend_heads with the counts as constants (D 64 and
   128: the loops unroll and the sums stay in registers); another D: attend_d for each head. */
static void attend_group(const float *q, int nh, const float *K, const float *V, int64_t n,
                         int64_t below, const uint8_t *see, int64_t D, float scale,
                         float *scores, float *out) {
#define HEADS(DD)                                                                                \
    switch (nh) {                                                                                \
    case 1: attend_heads(q, 1, K, V, n, below, see, DD, scale, scores, out); return;             \
    case 2: attend_heads(q, 2, K, V, n, below, see, DD, scale, scores, out); return;             \
    default: attend_heads(q, 3, K, V, n, below, see, DD, scale, scores, out); return;            \
    }
    if (D == 64) { HEADS(64) }
    if (D == 128) { HEADS(128) }
#undef HEADS
    for (int h = 0; h < nh; h++)
        attend_d(q + h * D, K, V, n, below, see, D, scale, scores, out + h * D);
}

/* act[e] = SiLU(gate) x up for the flat elements lo <= e < hi of act [R, I], where row r of gu
   [R, 2I] is row r's gate, then its up: gate / (1 + e^-gate) x up, e^ by exp8 (eight at a time;
   the tail by exp1, the same function), so an element's value does not depend on where a split
   falls. glibc's expf, one value at a time, made this the pass's largest serial step: 8% of a
   5-position SmolLM2 pass, the other thread waiting. layers() splits it among its threads. */
static void silu_range(const float *gu, float *act, int64_t I, int64_t lo, int64_t hi) {
    for (int64_t r = lo / I; r * I < hi; r++) {
        const float *gate = gu + r * 2 * I, *up = gate + I;
        float *a = act + r * I;
        int64_t i0 = lo > r * I ? lo - r * I : 0, i1 = hi - r * I < I ? hi - r * I : I, i = i0;
        for (; i + 8 <= i1; i += 8) {
            v8 g = load_f32(gate + i), out = g / (1.0f + exp8(-g)) * load_f32(up + i);
            memcpy(a + i, &out, sizeof out);
        }
        for (; i < i1; i++) a[i] = gate[i] / (1.0f + exp1(-gate[i])) * up[i];
    }
}

/* x [R, E] (in/out): the residual stream entering layer 0, left as it leaves layer L-1.
   W: 4 weights per layer (q/k/v stacked [(H+2Hkv)D, E], o [E, HD], gate/up stacked [2I, E],
   down [E, I]), each of kinds[i]: F32, BF16_WEIGHTS, or blocks.c's BLOCK_* tiles (the input
   quantized per block); G: 2 norm weights per layer [E]; keys/values: each layer's cache [S, Hkv, C, D];
   slot, col, below [R]; see [R, S] or NULL; cos, sin [R, D] (each query's rotary rows, at its
   position);
   capture [L]: -1, or j to copy the input of that layer into caps[j] [R, E]. side [R, E] or NULL:
   layer 0's q/k/v read [RMSNorm(side) x side_norm, RMSNorm(x) x G[0]] ([R, 2E]; its q/k/v
   weight [(H+2Hkv)D, 2E]): an EAGLE-3 head's layer, side the drafted tokens' embeddings.
   Returns 0, 1 out of memory, 3 a column or visible key outside the cache.

   The threads stay one team for the whole pass: each keeps its own copy of the residual stream
   and computes the norms, the residual adds and (below QUANT_SPLIT values) each product's
   quantized input itself (the same values in every thread: a few microseconds a layer of a
   decoding pass), and they meet at a barrier after each
   step that writes what the others read (the q/k/v product, rotary and cache writes,
   attention, the o product, the gate/up product, SiLU, the down product). A parallel region
   per product and serial steps between them (the other thread waiting) cost ~20% of a
   one-position pass of SmolLM2's Q4_1 blocks in waiting. */
static int layers(float *x, int64_t R, int64_t E, int64_t H, int64_t Hkv, int64_t D, int64_t I,
                  int64_t L, const void *const *W, const int8_t *kinds, const float *const *G,
                  float eps,
                  float *const *keys, float *const *values, int64_t C, const int64_t *slot,
                  const int64_t *col, const int64_t *below,
                  const uint8_t *see, int64_t S, const float *cos, const float *sin,
                  const int64_t *capture, float *caps, const float *side, const float *side_norm,
                  int threads) {
    if (!see) S = 0;
    for (int64_t r = 0; r < R; r++)
        if (col[r] < 0 || col[r] >= C || below[r] < 0 || below[r] + S > C) return 3;
    int64_t QKV = (H + 2 * Hkv) * D, widest = QKV > 2 * I ? QKV : 2 * I;
    int64_t in = side ? 2 * E : E;                   /* the widest product input */
    if (H * D > in) in = H * D;
    if (I > in) in = I;
    int nt = threads > 0 ? threads : 1;
    /* shared: the products' outputs, attention's */
    float *wide = malloc((size_t)(R * widest) * sizeof(float));
    float *att = malloc((size_t)(R * H * D) * sizeof(float));
    float *act = malloc((size_t)(R * I) * sizeof(float));
    float *sum = malloc((size_t)(R * E) * sizeof(float));            /* o's, then down's */
    float *scores = malloc((size_t)(nt * GH * C) * sizeof(float));
    /* each thread's: its residual stream, normed input ([side, x] for a head's layer 0), the
       input quantized (int8 and scales, uint8, bfloat16) */
    float *own = malloc((size_t)nt * (size_t)(R * (E + in)) * sizeof(float));
    /* each product's count of tiles handed out (block_share), a cache line apart */
    int64_t *taken = calloc((size_t)(8 * 4 * L), sizeof(int64_t));
    quant_room room;                          /* a slot a thread, + 1 the threads fill together */
    int no_room = room_alloc(&room, R * in, nt + 1, nt, 1, 1, 1);
    if (!wide || !att || !act || !sum || !scores || !own || !taken || no_room) {
        free(wide); free(att); free(act); free(sum); free(scores); free(own); free(taken);
        if (!no_room) room_free(&room);
        return 1;
    }
    float inv_sqrt = 1.0f / sqrtf((float)D);
    int64_t group = H / Hkv;
    /* attention units: a query's key/value head with up to GH of its query heads, the groups
       split further while there are fewer units than twice the threads (one query of 3 key heads
       on 2 threads: 6 units of 1-2 heads, not 3 of 3) */
    int64_t parts = (group + GH - 1) / GH;
    while (parts < group && R * Hkv * parts < 2 * nt) parts++;
    _Pragma("omp parallel num_threads(nt)")
    {
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        float *xp = own + t * R * (E + in), *xn = xp + R * E;
#define SHARE(w, kind, X, Y, N, K) \
        product_share(w, kind, X, Y, N, K, R, t, T, &room, taken + 8 * (4 * l + nth++))
        memcpy(xp, x, (size_t)(R * E) * sizeof(float));
        for (int64_t l = 0; l < L; l++) {
            const void *const *w = W + 4 * l;
            const int8_t *kind = kinds + 4 * l;
            float *kc = keys[l], *vc = values[l];
            int nth = 0;                              /* the layer's product, for SHARE */
            if (t == 0 && capture[l] >= 0)
                memcpy(caps + capture[l] * R * E, xp, (size_t)(R * E) * sizeof(float));
            if (side && l == 0) {                            /* [side normed, x normed] */
                for (int64_t r = 0; r < R; r++) {
                    float *row = xn + r * 2 * E;
                    memcpy(row, side + r * E, (size_t)E * sizeof(float));
                    rms_in_place(row, side_norm, eps, F32, E);
                    memcpy(row + E, xp + r * E, (size_t)E * sizeof(float));
                    rms_in_place(row + E, G[2 * l], eps, F32, E);
                }
                SHARE(w[0], kind[0], xn, wide, QKV, 2 * E);
            } else {
                rms_rows(xp, G[2 * l], eps, R, E, xn);
                SHARE(w[0], kind[0], xn, wide, QKV, E);                  /* [R, (H+2Hkv)D] */
            }
            _Pragma("omp barrier")
            /* rotary on each query and key head, keys and values into the cache */
            _Pragma("omp for schedule(static)")
            for (int64_t u = 0; u < R * (H + 2 * Hkv); u++) {
                int64_t r = u / (H + 2 * Hkv), h = u % (H + 2 * Hkv);
                float *v = wide + r * QKV + h * D;
                if (h < H + Hkv) rotary(v, cos + r * D, sin + r * D, D);
                if (h >= H) {
                    int64_t g = h < H + Hkv ? h - H : h - H - Hkv;
                    int64_t at = ((slot[r] * Hkv + g) * C + col[r]) * D;
                    memcpy((h < H + Hkv ? kc : vc) + at, v, (size_t)D * sizeof(float));
                }
            }                                                        /* (a barrier) */
            _Pragma("omp for schedule(static)")
            for (int64_t u = 0; u < R * Hkv * parts; u++) {
                int64_t r = u / (Hkv * parts), g = u / parts % Hkv, part = u % parts;
                int64_t h0 = g * group + part * group / parts;
                int64_t h1 = g * group + (part + 1) * group / parts;
                int64_t base = (slot[r] * Hkv + g) * C * D;
                attend_group(wide + r * QKV + h0 * D, (int)(h1 - h0), kc + base, vc + base,
                             below[r] + S, below[r], see ? see + r * S : NULL, D, inv_sqrt,
                             scores + t * GH * C, att + (r * H + h0) * D);
            }                                                        /* (a barrier) */
            SHARE(w[1], kind[1], att, sum, E, H * D);                  /* [R, E] */
            _Pragma("omp barrier")
            for (int64_t i = 0; i < R * E; i++) xp[i] += sum[i];
            rms_rows(xp, G[2 * l + 1], eps, R, E, xn);
            SHARE(w[2], kind[2], xn, wide, 2 * I, E);                  /* [R, 2I] */
            _Pragma("omp barrier")
            {
                int64_t n = R * I, per = (n + T - 1) / T, lo = t * per;
                int64_t hi = lo + per < n ? lo + per : n;
                if (lo < n) silu_range(wide, act, I, lo, hi);            /* [R, I] */
            }
            _Pragma("omp barrier")
            SHARE(w[3], kind[3], act, sum, E, I);                      /* [R, E] */
            _Pragma("omp barrier")
            for (int64_t i = 0; i < R * E; i++) xp[i] += sum[i];
            /* (sum is written again after the next layer's barriers, once every thread has
               added it) */
        }
        if (t == 0) memcpy(x, xp, (size_t)(R * E) * sizeof(float));
#undef SHARE
    }
    free(wide); free(att); free(act); free(sum); free(scores); free(own); free(taken);
    room_free(&room);
    return 0;
}

int specflow_layers(float *x, int64_t R, int64_t E, int64_t H, int64_t Hkv, int64_t D, int64_t I,
                    int64_t L, const void *const *W, const int8_t *kinds, const float *const *G,
                    float eps,
                    float *const *keys, float *const *values, int64_t C, const int64_t *slot,
                    const int64_t *col, const int64_t *below,
                    const uint8_t *see, int64_t S, const float *cos, const float *sin,
                    const int64_t *capture, float *caps, int threads) {
    return layers(x, R, E, H, Hkv, D, I, L, W, kinds, G, eps, keys, values, C, slot, col, below,
                  see, S, cos, sin, capture, caps, NULL, NULL, threads);
}

/* specflow_layers, then the LM head over the R rows it leaves: logits [R, N] = RMSNorm(x) x G_out
   (eps) times head^T, the head of `head_kind` as product() takes it (F32, BF16_WEIGHTS,
   F16_WEIGHTS or BLOCK_*), by the operations specflow_gemv (float32) and specflow_held (the
   others) use with their norm: a pass's logits in the same call as its layers. x is left as
   the last layer leaves it. Returns specflow_layers' codes. */
int specflow_layers_head(float *x, int64_t R, int64_t E, int64_t H, int64_t Hkv, int64_t D,
                         int64_t I, int64_t L, const void *const *W, const int8_t *kinds,
                         const float *const *G, float eps, float *const *keys,
                         float *const *values, int64_t C, const int64_t *slot, const int64_t *col,
                         const int64_t *below, const uint8_t *see, int64_t S, const float *cos,
                         const float *sin, const int64_t *capture, float *caps,
                         const float *G_out, const void *head, int head_kind, int64_t N,
                         float *logits, int threads) {
    int failed = layers(x, R, E, H, Hkv, D, I, L, W, kinds, G, eps, keys, values, C, slot, col,
                        below, see, S, cos, sin, capture, caps, NULL, NULL, threads);
    if (failed) return failed;
    float *normed = malloc((size_t)(R * E) * sizeof(float));
    if (!normed) return 1;
    rms_rows(x, G_out, eps, R, E, normed);
    failed = product(head, head_kind, normed, logits, N, E, R, threads);
    free(normed);
    return failed;
}

/* One EAGLE-3 head layer (layers() with L = 1 and its side input): x [R, E] the head states in
   and out, side [R, E] the tokens' embeddings, side_norm [E] its input_layernorm, G its
   hidden_norm and post_attention_layernorm. */
int specflow_side_layer(float *x, const float *side, const float *side_norm, int64_t R,
                        int64_t E, int64_t H, int64_t Hkv, int64_t D, int64_t I,
                        const void *const *W, const int8_t *kinds, const float *const *G,
                        float eps, float *const *keys, float *const *values, int64_t C,
                        const int64_t *slot, const int64_t *col, const int64_t *below,
                        const uint8_t *see, int64_t S, const float *cos, const float *sin,
                        int threads) {
    const int64_t none = -1;
    return layers(x, R, E, H, Hkv, D, I, 1, W, kinds, G, eps, keys, values, C, slot, col, below,
                  see, S, cos, sin, &none, NULL, side, side_norm, threads);
}

/* ---- Greedy draft steps of a decoder as one call (specflow_chain) -----------------------------

   A draft model's autoregressive steps: each step runs its queries through layers(), then the
   final RMSNorm (G_out), the LM head (head, of `head_kind` as product() takes it, N rows) and the
   argmax over its first V logits for each row's last query, and the token found is the row's
   one query of the next step. Row r takes steps[r] steps (0 to S); its step 0 feeds its
   fed_len[r] >= 1 tokens (the committed ones its cache lacks, in fed, row after row), at cache
   columns col0[r], col0[r] + 1, ... and the same rotary positions (rows of the tables cos, sin
   [P, D]); each query sees its slot's keys up to its own column. out[r, s] = the token step s
   found (-1 where the row took no step s): the first largest logit, or 0 where the row's
   largest is not finite (a NaN, an infinity, or every logit -inf), as the shaping call's
   mark_empty leaves such a row (zeros) for torch's argmax. Each step computes what the lean
   forward's native pass and its native LM-head product compute for the same queries, by the
   same products. The embedding embed [V_in, E] is a
   float32 table (embed_kind -1) or held in blocks of embed_kind (embed_row). Returns 0, 1 out of
   memory, 3 a column or position outside the cache or the tables, 4 a token outside the
   embedding's V_in rows. min_p > 0: a row stops after the first draft whose probability under
   its step's softmax (over the first V logits) is below min_p (that draft kept), as
   transformers' assistant_confidence_threshold stops an assistant model. */
/* The draft of each of n states [n, E]: the final RMSNorm (G_out), the LM head (head, of `kind`
   as product() takes it, N rows) and the first largest of the first `top` logits, or 0 where the
   largest is not finite (a NaN, an infinity, or every logit -inf: the shaping call's mark_empty
   zeroes such a row before torch's argmax), mapped through ids [N] unless NULL, into
   out[live[i] * S + s]. normed [n, E] and logits [n, N] are scratch. min_p > 0: where a draft's
   probability under the softmax of those `top` logits, 1 / sum e^(l - largest) (0 where the
   largest is not finite), is below min_p, its row takes no step after s (until[live[i]] = s +
   1). 0, or 1 out of memory. */
static int draft_tokens(const float *states, const float *G_out, float eps, const void *head,
                        int kind, int64_t N, int64_t top, const int64_t *ids, int64_t n,
                        int64_t E, float *normed, float *logits, const int64_t *live, int64_t S,
                        int64_t s, int64_t *out, float min_p, int64_t *until, int threads) {
    rms_rows(states, G_out, eps, n, E, normed);
    if (product(head, kind, normed, logits, N, E, n, threads)) return 1;
    for (int64_t i = 0; i < n; i++) {
        const float *row = logits + i * N;
        int64_t best = 0;
        for (int64_t v = 1; v < top && row[best] == row[best]; v++)
            if (row[v] > row[best] || row[v] != row[v]) best = v;
        int finite = isfinite(row[best]);
        out[live[i] * S + s] = !finite ? 0 : ids ? ids[best] : best;
        if (min_p <= 0.0f) continue;
        float p = 0.0f;
        if (finite) {
            v8 m = splat(row[best]), sum = (v8){0};
            int64_t v = 0;
            for (; v + 8 <= top; v += 8) sum += exp8(load_f32(row + v) - m);
            float total = hsum(sum);
            for (; v < top; v++) total += exp1(row[v] - row[best]);
            p = 1.0f / total;
        }
        if (p < min_p) until[live[i]] = s + 1;
    }
    return 0;
}

/* Row `token` of an embedding table [V_in, E] into out: float32 rows (kind -1) or a block weight
   of that kind (specflow_block_rows: a table held in its tied head's blocks). 4 where token is
   outside the table. */
static int embed_row(const void *embed, int kind, int64_t token, int64_t V_in, int64_t E,
                     float *out) {
    if (token < 0 || token >= V_in) return 4;
    if (kind < 0) {
        memcpy(out, (const float *)embed + token * E, (size_t)E * sizeof(float));
        return 0;
    }
    return specflow_block_rows(embed, kind, &token, 1, V_in, E, out) ? 4 : 0;
}

int specflow_chain(const void *embed, int embed_kind, int64_t V_in, int64_t R, const int64_t *fed,
                   const int64_t *fed_len, const int64_t *steps, int64_t S, int64_t E, int64_t H,
                   int64_t Hkv, int64_t D, int64_t I, int64_t L, const void *const *W,
                   const int8_t *kinds, const float *const *G, float eps, float *const *keys,
                   float *const *values, int64_t C, const int64_t *slot, const int64_t *col0,
                   const float *cos, const float *sin, int64_t P, const float *G_out,
                   const void *head, int head_kind, int64_t N, int64_t V, int64_t *out,
                   float min_p, int threads) {
    int64_t top = V < N ? V : N, Q = 0;           /* Q: the most queries of a step (step 0's) */
    for (int64_t r = 0; r < R; r++) {
        if (steps[r] < 0 || steps[r] > S || fed_len[r] < 1) return 3;
        int64_t reach = col0[r] + fed_len[r] + steps[r] - 1;       /* columns written: < reach */
        if (steps[r] && (col0[r] < 0 || reach > C || reach > P)) return 3;
        for (int64_t j = 0; j < fed_len[r]; j++)
            if (steps[r] && (fed[Q + j] < 0 || fed[Q + j] >= V_in)) return 4;
        Q += fed_len[r];
        for (int64_t s = 0; s < S; s++) out[r * S + s] = -1;
    }
    if (Q < R) Q = R;
    int64_t *live = malloc((size_t)(Q > 0 ? Q : 1) * 5 * sizeof(int64_t));
    int64_t *capture = malloc((size_t)(L > 0 ? L : 1) * sizeof(int64_t));
    int64_t *until = malloc((size_t)(R > 0 ? R : 1) * sizeof(int64_t));   /* steps, or fewer */
    float *x = malloc((size_t)(Q * E) * sizeof(float));
    float *xn = malloc((size_t)(R * E) * sizeof(float));
    float *rot = malloc((size_t)(Q * 2 * D) * sizeof(float));
    float *logits = malloc((size_t)(R * N) * sizeof(float));
    int failed = !live || !capture || !until || !x || !xn || !rot || !logits;
    for (int64_t r = 0; r < R && !failed; r++) until[r] = steps[r];
    for (int64_t l = 0; l < L && !failed; l++) capture[l] = -1;
    int64_t *lslot = live + Q, *lcol = live + 2 * Q, *lbelow = live + 3 * Q, *last = live + 4 * Q;
    for (int64_t s = 0; s < S && !failed; s++) {
        int64_t n = 0, rows = 0;       /* n queries; rows: the live rows, live[i] their index */
        for (int64_t r = 0, at = 0; r < R; at += fed_len[r], r++) {
            if (until[r] <= s) continue;
            int64_t count = s ? 1 : fed_len[r];
            for (int64_t j = 0; j < count; j++, n++) {
                int64_t token = s ? out[r * S + s - 1] : fed[at + j];
                int64_t column = s ? col0[r] + fed_len[r] + s - 1 : col0[r] + j;
                if ((failed = embed_row(embed, embed_kind, token, V_in, E, x + n * E))) break;
                lslot[n] = slot[r];
                lcol[n] = column;
                lbelow[n] = column + 1;
                memcpy(rot + n * D, cos + column * D, (size_t)D * sizeof(float));
                memcpy(rot + (Q + n) * D, sin + column * D, (size_t)D * sizeof(float));
            }
            if (failed) break;
            live[rows] = r;
            last[rows++] = n - 1;
        }
        if (failed || !n) break;
        failed = layers(x, n, E, H, Hkv, D, I, L, W, kinds, G, eps, keys, values, C, lslot,
                        lcol, lbelow, NULL, 0, rot, rot + Q * D, capture, NULL, NULL, NULL,
                        threads);
        if (failed) break;
        for (int64_t i = 0; i < rows; i++)                /* each live row's last query */
            memcpy(xn + i * E, x + last[i] * E, (size_t)E * sizeof(float));
        if (draft_tokens(xn, G_out, eps, head, head_kind, N, top, NULL, rows, E, x, logits,
                         live, S, s, out, min_p, until, threads)) { failed = 1; break; }
    }
    free(live); free(capture); free(until); free(x); free(xn); free(rot); free(logits);
    return failed;
}

/* ---- An EAGLE-3 head's greedy steps as one call (specflow_head_chain) ------------------------

   x [R, E]: each row's head state after its committed pairs (overwritten). Step 0 takes the
   draft from that state: the final RMSNorm (G_out), the LM head (head, `head_kind`, N rows:
   the draft vocabulary) and the argmax, mapped to the target's vocabulary through ids [N]
   (increasing, so the first largest logit in draft order is the first in target order too).
   Each later step feeds the state and the token just drafted (its row of embed [V_in, E]) to the
   head's layer (specflow_side_layer: W, kinds, G, side_norm), at cache column col0[r] + s - 1
   and the same rotary position, and takes the draft from the layer's output as step 0 did. Row
   r takes steps[r] steps (0 to S); out[r, s] = the target token step s found (-1 where the row
   took no step s; token 0 where the largest logit is not finite, as the shaping call leaves
   such a row). Each step computes what the head's two native calls compute for it.
   min_p > 0: a row stops after the first draft whose probability under its step's softmax (over
   the N draft logits) is below min_p, as specflow_chain's.
   Returns 0, 1 out of memory, 3 a column or position outside the cache or the tables, 4 a
   drafted token outside embed's rows. */
int specflow_head_chain(float *x, const float *embed, int64_t V_in, const float *side_norm,
                        int64_t R, const int64_t *steps, int64_t S, int64_t E, int64_t H,
                        int64_t Hkv, int64_t D, int64_t I, const void *const *W,
                        const int8_t *kinds, const float *const *G, float eps,
                        float *const *keys, float *const *values, int64_t C,
                        const int64_t *slot, const int64_t *col0, const float *cos,
                        const float *sin, int64_t P, const float *G_out, const void *head,
                        int head_kind, int64_t N, const int64_t *ids, int64_t *out,
                        float min_p, int threads) {
    for (int64_t r = 0; r < R; r++) {
        if (steps[r] < 0 || steps[r] > S) return 3;
        if (steps[r] > 1 && (col0[r] < 0 || col0[r] + steps[r] - 1 > C
                             || col0[r] + steps[r] - 1 > P)) return 3;
        for (int64_t s = 0; s < S; s++) out[r * S + s] = -1;
    }
    int64_t *live = malloc((size_t)(R > 0 ? R : 1) * 4 * sizeof(int64_t));
    float *h = malloc((size_t)(R * E) * sizeof(float));
    float *side = malloc((size_t)(R * E) * sizeof(float));
    float *xn = malloc((size_t)(R * E) * sizeof(float));
    float *rot = malloc((size_t)(R * 2 * D) * sizeof(float));
    float *logits = malloc((size_t)(R * N) * sizeof(float));
    int64_t *until = malloc((size_t)(R > 0 ? R : 1) * sizeof(int64_t));   /* steps, or fewer */
    int failed = !live || !h || !side || !xn || !rot || !logits || !until;
    for (int64_t r = 0; r < R && !failed; r++) until[r] = steps[r];
    int64_t *lslot = live + R, *lcol = live + 2 * R, *lbelow = live + 3 * R;
    for (int64_t s = 0; s < S && !failed; s++) {
        int64_t n = 0;
        for (int64_t r = 0; r < R; r++) {
            if (until[r] <= s) continue;
            if (s) {
                int64_t token = out[r * S + s - 1], column = col0[r] + s - 1;
                if (token < 0 || token >= V_in) { failed = 4; break; }
                memcpy(side + n * E, embed + token * E, (size_t)E * sizeof(float));
                memcpy(rot + n * D, cos + column * D, (size_t)D * sizeof(float));
                memcpy(rot + (R + n) * D, sin + column * D, (size_t)D * sizeof(float));
                lslot[n] = slot[r];
                lcol[n] = column;
                lbelow[n] = column + 1;
            }
            memcpy(h + n * E, x + r * E, (size_t)E * sizeof(float));
            live[n++] = r;
        }
        if (failed || !n) break;
        if (s) {
            const int64_t none = -1;
            failed = layers(h, n, E, H, Hkv, D, I, 1, W, kinds, G, eps, keys, values, C, lslot,
                            lcol, lbelow, NULL, 0, rot, rot + R * D, &none, NULL, side,
                            side_norm, threads);
            if (failed) break;
            for (int64_t i = 0; i < n; i++)
                memcpy(x + live[i] * E, h + i * E, (size_t)E * sizeof(float));
        }
        if (draft_tokens(h, G_out, eps, head, head_kind, N, N, ids, n, E, xn, logits, live, S,
                         s, out, min_p, until, threads)) { failed = 1; break; }
    }
    free(live); free(h); free(side); free(xn); free(rot); free(logits); free(until);
    return failed;
}
