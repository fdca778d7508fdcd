/* Products of a few rows by a weight held in GGUF's blocks, tiled for the product (included
   by gemv.c; specflow.backends.lean.blocks).

   Four tile kinds, each 32 weights of a row a block:
   - Q4_1: float16 scale d, float16 minimum m, 4-bit q; weight = q x d + m. A Q4_0 block
     ((q - 8) x d) is this with m = -8d, exact in float16; specflow's own int4 (`dtype=int4`)
     writes these blocks too.
   - Q4_K: the same with float32 d and m: a Q4_K block's sub-block of 32 (d x 6-bit scale and
     dmin x 6-bit minimum, exact in float32, not in float16).
   - Q8_0: float16 scale d, int8 q; weight = q x d (`dtype=int8`; a Q5_0 block, (q - 16) x d,
     is this exactly).
   - U8: 8-bit unsigned q with a float32 scale s and minimum m per 16 weights; weight = q x s +
     m: Q5_1, Q5_K and Q6_K blocks (Q6_K: q x s - 32 s), and any two of the kinds above fused
     into one product (q, k, v of two types).
   - BF16: 32 bfloat16 weights, no scale (`dtype=bfloat16` where the CPU has AVX512-BF16): the
     activations rounded to bfloat16 (to nearest even) and each pair of products summed in
     float32 by `vdpbf16ps`, llama.cpp's arithmetic for a bf16 file. The widening product
     (gemv.c's BF16_WEIGHTS: float32 activations, float32 arithmetic) runs elsewhere.

   The activations are quantized to int8 per block of 32 (scale s = max |x| / 127, as
   llama.cpp's Q8 blocks), so a block's product is an integer sum, d s sum(q xq) (+ m s sum(xq)
   for Q4_1), exact in int32. The weight is read once per pass, in 5 (Q4_1) or 9.5 (Q8_0) bits a
   weight. The activation's rounding (~0.4% of a block's largest value) is what the product adds
   to the weight's own error: llama.cpp's arithmetic for these files.

   Tiles: the blocks of 16 consecutive rows at one block index lie together, so one AVX-512
   VNNI `vpdpbusd` multiplies 4 weights of each of the 16 rows by the same 4 activations (one
   broadcast) and 8 of them leave each row's whole block sum in its own lane: the float work is
   then one conversion, one scaling and one or two multiply-adds per row per 16 blocks, and the
   16 lanes are 16 results (no horizontal sums). A tile of a Q4_1 block (320 bytes): 4 chunks of
   64 bytes, byte 4i + u of chunk c holding row i's weight 4c + u in its low nibble and 16 + 4c
   + u in its high one, then the 16 rows' d, then their m (float16). Of a Q8_0 block (608
   bytes): 8 chunks of 64 bytes, byte 4i + u of chunk k row i's weight 4k + u, then the 16
   rows' d (float16), then -128 x each row's sum of q (int32: vpdpbusd multiplies unsigned by
   signed, so the activations go in as xq + 128 and this corrects the sum). Of a Q4_K block
   (384 bytes): Q4_1's 256 bytes of nibbles, then the 16 rows' d and m as float32. Of a U8 block
   (768 bytes): 8 chunks of 64 bytes as Q8_0's (q unsigned), then float32 s of the 16 rows'
   first 16 weights, of their second 16, then m likewise. Of a BF16 block (1024 bytes): 16 chunks
   of 64 bytes, bytes 4i..4i+3 of chunk c row i's weights 2c and 2c + 1 (one `vdpbf16ps` lane's
   pair), so that one multiplies 2 weights of each of the 16 rows by the same 2 activations.
   Rows past N are zero. The same scales, minimums and quantized weights as the file's blocks,
   moved.

   Every row of Y is computed by the same operations whatever M and the thread count are (its
   lane's sums in block order; a Q4_1 row's scaled sums and its minimums' term apart, added
   last), so a row's result does not depend on the rows beside it. The int sums are exact on
   every path (their order is free); the float sums are in the same order on the portable path
   and on VNNI's, up to the fusing of multiply-adds. */

#define QK 32
#define TR 16           /* rows per tile */
#define Q4_TILE 320     /* bytes per tile block */
#define Q4K_TILE 384
#define Q8_TILE 608
#define U8_TILE 768

static inline float half_to_f32(uint16_t h) {     /* IEEE binary16 -> float32, exactly */
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, f = h & 0x3ff, u;
    if (e == 0x1f) u = s | 0x7f800000u | (f << 13);                       /* inf, NaN */
    else if (e) u = s | ((e + 112) << 23) | (f << 13);
    else if (!f) u = s;                                                    /* zero */
    else {                                                                 /* subnormal */
        e = 113;
        while (!(f & 0x400)) { f <<= 1; e--; }
        u = s | (e << 23) | ((f & 0x3ff) << 13);
    }
    float out; memcpy(&out, &u, 4); return out;
}

/* Blocks b0..b1 of X [M, K] float32 (block b: its 32 floats from b x 32; K a multiple of 32, so
   block m x K/32 + g is row m's g-th) -> xq [M, K] int8, the scale s [M, K/32] and s x sum(xq)
   [M, K/32]; s x sum(xq) of each half block [M, K/16]. A block's largest |x| (NaN passed over),
   q = nearbyint(x x 127 / max) clamped to +-127 as an int (a NaN's conversion, INT_MIN, to -127)
   and the sums, eight lanes at a time: a scalar loop's values exactly (max and integer sums are
   exact in any order) in a fraction of its time (scalar, it was 4% of a 5-position SmolLM2
   pass's samples, the other thread waiting as long). */
typedef int8_t i8x8 __attribute__((vector_size(8)));

static void quantize_blocks(const float *X, int64_t b0, int64_t b1, int8_t *xq, float *sx,
                            float *xs, float *xs16) {
    const i8v magnitude = (i8v){0} + 0x7fffffff;
    for (int64_t b = b0; b < b1; b++) {                  /* block b: X[b x 32 .. b x 32 + 32) */
        const float *p = X + b * QK;
        v8 x[4], top = (v8){0};
        for (int c = 0; c < 4; c++) {
            i8v bits;
            x[c] = load_f32(p + 8 * c);
            memcpy(&bits, &x[c], sizeof bits);
            bits &= magnitude;                                                /* |x| */
            v8 a; memcpy(&a, &bits, sizeof a);
            top = pick(a > top, a, top);
        }
        float amax = 0.0f;
        for (int i = 0; i < 8; i++) if (top[i] > amax) amax = top[i];
        float s = amax / 127.0f, inv = s > 0.0f ? 127.0f / amax : 0.0f;
        int8_t *q = xq + b * QK;
        i8v half[2] = {(i8v){0}, (i8v){0}};
        for (int c = 0; c < 4; c++) {
            v8 n = x[c] * inv;
#ifdef __AVX__
            n = (v8)_mm256_round_ps((__m256)n, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
            for (int i = 0; i < 8; i++) n[i] = nearbyintf(n[i]);
#endif
            i8v v = __builtin_convertvector(n, i8v);
            i8v over = v > 127, under = v < -127;                 /* each lane all ones or 0 */
            v = (v & ~over) | (over & 127);
            v = (v & ~under) | (under & -127);
            i8x8 narrow = __builtin_convertvector(v, i8x8);
            memcpy(q + 8 * c, &narrow, sizeof narrow);
            half[c / 2] += v;
        }
        int lo = 0, hi = 0;
        for (int i = 0; i < 8; i++) { lo += half[0][i]; hi += half[1][i]; }
        sx[b] = s;
        xs[b] = s * (float)(lo + hi);
        xs16[2 * b] = s * (float)lo;
        xs16[2 * b + 1] = s * (float)hi;
    }
}

static inline float f16_at(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return half_to_f32(h); }
static inline float f32_at(const uint8_t *p) { float f; memcpy(&f, p, 4); return f; }

#define MRB 8          /* rows of X one walk of a tile takes (accumulators in registers) */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* A tile's blocks lie one after another, so a thread streams its tiles in one sequence; each
   block asks for the bytes PF_AHEAD further on, which the core's own prefetchers fetch too late
   once a walk takes several rows of X: 5 rows of SmolLM2's Q4_1 layers 13% faster (2560 bytes:
   640 and 1280 gained less, 5120 no more), one row unchanged. A prefetch past the weight's end
   is dropped, not faulted. */
#define PF_AHEAD 2560
#define PREFETCH(p) _mm_prefetch((const char *)(p) + PF_AHEAD, _MM_HINT_T0)
static inline __m512i bcast4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }

/* One tile (16 rows, G blocks) against MR rows of X: Y[j, 0..valid) for each row j. Q4_1 and
   Q4_K differ only in their scales' width (SCALES sets dv and mv from blk). */
#define NIBBLE_GROUP(NAME, TILE, SCALES, MR)                                             \
__attribute__((noinline)) static void NAME##_tile_##MR(const uint8_t *tile, const int8_t *xq,         \
        const float *sx, const float *xs, float *y, int64_t N, int64_t K, int64_t G,              \
        uint16_t valid) {                                                                       \
    __m512 acc[MR], accm[MR];        /* the scaled sums, the minimums' term */                 \
    const __m512i low = _mm512_set1_epi8(0x0F);                                                  \
    for (int j = 0; j < MR; j++) acc[j] = accm[j] = _mm512_setzero_ps();                         \
    for (int64_t b = 0; b < G; b++) {                                                            \
        const uint8_t *blk = tile + b * TILE;                                                 \
        __m512i w[8];                                                                            \
        for (int c = 0; c < TILE; c += 64) PREFETCH(blk + c);                                    \
        for (int c = 0; c < 4; c++) {                                                            \
            __m512i v = _mm512_loadu_si512(blk + 64 * c);                                        \
            w[c] = _mm512_and_si512(v, low);                                                     \
            w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);                           \
        }                                                                                        \
        __m512 dv, mv;                                                                           \
        SCALES                                                                                   \
        for (int j = 0; j < MR; j++) {                                                           \
            const int8_t *x = xq + j * K + b * QK;                                               \
            __m512i sum = _mm512_setzero_si512();                                                \
            if (MR > 1)            /* one chain: the other rows' chains hide its latency */      \
                for (int k = 0; k < 4; k++)                                                      \
                    sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum, w[k], bcast4(x + 4 * k)), \
                                              w[k + 4], bcast4(x + 16 + 4 * k));                 \
            else {                 /* alone: four chains of two, a quarter of the latency */     \
                __m512i s[4];                                                                    \
                for (int k = 0; k < 4; k++)                                                      \
                    s[k] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[k], \
                                          bcast4(x + 4 * k)), w[k + 4], bcast4(x + 16 + 4 * k)); \
                sum = _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]),                             \
                                       _mm512_add_epi32(s[2], s[3]));     /* exact */            \
            }                                                                                    \
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(sx[j * G + b]));     \
            acc[j] = _mm512_fmadd_ps(dv, t, acc[j]);                                             \
            accm[j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[j * G + b]), accm[j]);                \
        }                                                                                        \
    }                                                                                            \
    for (int j = 0; j < MR; j++)                                                                 \
        _mm512_mask_storeu_ps(y + j * N, valid, _mm512_add_ps(acc[j], accm[j]));                 \
}

#define F16_SCALES dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256)));        \
                   mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 288)));
#define F32_SCALES dv = _mm512_loadu_ps(blk + 256); mv = _mm512_loadu_ps(blk + 320);
#define Q4_GROUP(MR) NIBBLE_GROUP(q4, Q4_TILE, F16_SCALES, MR)
#define Q4K_GROUP(MR) NIBBLE_GROUP(q4k, Q4K_TILE, F32_SCALES, MR)

/* A U8 tile: unsigned q by signed xq as Q4_1's nibbles, each half block its own scale. */
#define U8_GROUP(MR)                                                                             \
__attribute__((noinline)) static void u8_tile_##MR(const uint8_t *tile, const int8_t *xq,         \
        const float *sx, const float *xs16, float *y, int64_t N, int64_t K, int64_t G,            \
        uint16_t valid) {                                                                       \
    __m512 acc[MR], accm[MR];                                                                    \
    for (int j = 0; j < MR; j++) acc[j] = accm[j] = _mm512_setzero_ps();                         \
    for (int64_t b = 0; b < G; b++) {                                                            \
        const uint8_t *blk = tile + b * U8_TILE;                                                 \
        __m512i w[8];                                                                            \
        for (int c = 0; c < U8_TILE; c += 64) PREFETCH(blk + c);                                 \
        for (int k = 0; k < 8; k++) w[k] = _mm512_loadu_si512(blk + 64 * k);                    \
        __m512 s0 = _mm512_loadu_ps(blk + 512), s1 = _mm512_loadu_ps(blk + 576);                 \
        __m512 m0 = _mm512_loadu_ps(blk + 640), m1 = _mm512_loadu_ps(blk + 704);                 \
        for (int j = 0; j < MR; j++) {                                                           \
            const int8_t *x = xq + j * K + b * QK;                                               \
            __m512i h[4];                  /* two chains a half */                              \
            for (int k = 0; k < 4; k++)                                                          \
                h[k] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(),           \
                       w[2 * k], bcast4(x + 8 * k)), w[2 * k + 1], bcast4(x + 8 * k + 4));        \
            __m512 sxv = _mm512_set1_ps(sx[j * G + b]);                                          \
            __m512 t0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(h[0], h[1])), sxv);     \
            __m512 t1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(h[2], h[3])), sxv);     \
            acc[j] = _mm512_fmadd_ps(s1, t1, _mm512_fmadd_ps(s0, t0, acc[j]));                   \
            const float *xh = xs16 + 2 * (j * G + b);                                            \
            accm[j] = _mm512_fmadd_ps(m1, _mm512_set1_ps(xh[1]),                                 \
                                      _mm512_fmadd_ps(m0, _mm512_set1_ps(xh[0]), accm[j]));       \
        }                                                                                        \
    }                                                                                            \
    for (int j = 0; j < MR; j++)                                                                 \
        _mm512_mask_storeu_ps(y + j * N, valid, _mm512_add_ps(acc[j], accm[j]));                 \
}

#define Q8_GROUP(MR)                                                                             \
__attribute__((noinline)) static void q8_tile_##MR(const uint8_t *tile, const uint8_t *xu,        \
        const float *sx, float *y, int64_t N, int64_t K, int64_t G, uint16_t valid) {           \
    __m512 acc[MR];                                                                              \
    for (int j = 0; j < MR; j++) acc[j] = _mm512_setzero_ps();                                   \
    for (int64_t b = 0; b < G; b++) {                                                            \
        const uint8_t *blk = tile + b * Q8_TILE;                                                 \
        __m512i w[8];                                                                            \
        for (int c = 0; c < Q8_TILE; c += 64) PREFETCH(blk + c);                                 \
        for (int k = 0; k < 8; k++) w[k] = _mm512_loadu_si512(blk + 64 * k);                    \
        __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 512)));           \
        __m512i start = _mm512_loadu_si512(blk + 544);                                          \
        for (int j = 0; j < MR; j++) {                                                           \
            const int8_t *x = (const int8_t *)xu + j * K + b * QK;                               \
            __m512i s = start;                                                                   \
            if (MR > 1)                              /* one chain, as Q4_1's */                  \
                for (int k = 0; k < 8; k++) s = _mm512_dpbusd_epi32(s, bcast4(x + 4 * k), w[k]); \
            else {                                                                               \
                __m512i s1 = _mm512_setzero_si512();                                             \
                for (int k = 0; k < 4; k++) {                                                    \
                    s = _mm512_dpbusd_epi32(s, bcast4(x + 4 * k), w[k]);                         \
                    s1 = _mm512_dpbusd_epi32(s1, bcast4(x + 16 + 4 * k), w[k + 4]);             \
                }                                                                                \
                s = _mm512_add_epi32(s, s1);                                                     \
            }                                                                                    \
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(sx[j * G + b]));       \
            acc[j] = _mm512_fmadd_ps(dv, t, acc[j]);                                             \
        }                                                                                        \
    }                                                                                            \
    for (int j = 0; j < MR; j++) _mm512_mask_storeu_ps(y + j * N, valid, acc[j]);                \
}
#define BLOCKS_VNNI 1
#else
/* Portable: each row's block sums as integers, then the same float steps in block order. */
#define NIBBLE_GROUP(NAME, TILE, SCALES, MR)                                             \
static void NAME##_tile_##MR(const uint8_t *tile, const int8_t *xq, const float *sx,                 \
        const float *xs, float *y, int64_t N, int64_t K, int64_t G, uint16_t valid) {            \
    for (int j = 0; j < MR; j++)                                                                 \
        for (int i = 0; i < TR; i++) {                                                           \
            if (!(valid >> i & 1)) continue;                                                     \
            float acc = 0.0f, accm = 0.0f;                                                       \
            for (int64_t b = 0; b < G; b++) {                                                    \
                const uint8_t *blk = tile + b * TILE;                                         \
                const int8_t *x = xq + j * K + b * QK;                                           \
                int32_t s = 0;                                                                   \
                for (int c = 0; c < 4; c++)                                                      \
                    for (int u = 0; u < 4; u++) {                                                \
                        uint8_t v = blk[64 * c + 4 * i + u];                                     \
                        s += (v & 0x0F) * x[4 * c + u] + (v >> 4) * x[16 + 4 * c + u];           \
                    }                                                                            \
                float d, m;                                                                      \
                SCALES                                                                           \
                acc = fmadd(acc, d, (float)s * sx[j * G + b]);                                   \
                accm = fmadd(accm, m, xs[j * G + b]);                                            \
            }                                                                                    \
            y[j * N + i] = acc + accm;                                                           \
        }                                                                                        \
}
#define F16_SCALES d = f16_at(blk + 256 + 2 * i); m = f16_at(blk + 288 + 2 * i);
#define F32_SCALES d = f32_at(blk + 256 + 4 * i); m = f32_at(blk + 320 + 4 * i);
#define Q4_GROUP(MR) NIBBLE_GROUP(q4, Q4_TILE, F16_SCALES, MR)
#define Q4K_GROUP(MR) NIBBLE_GROUP(q4k, Q4K_TILE, F32_SCALES, MR)
#define U8_GROUP(MR)                                                                             \
static void u8_tile_##MR(const uint8_t *tile, const int8_t *xq, const float *sx,                 \
        const float *xs16, float *y, int64_t N, int64_t K, int64_t G, uint16_t valid) {          \
    for (int j = 0; j < MR; j++)                                                                 \
        for (int i = 0; i < TR; i++) {                                                           \
            if (!(valid >> i & 1)) continue;                                                     \
            float acc = 0.0f, accm = 0.0f;                                                       \
            for (int64_t b = 0; b < G; b++) {                                                    \
                const uint8_t *blk = tile + b * U8_TILE;                                         \
                const int8_t *x = xq + j * K + b * QK;                                           \
                int32_t h[2] = {0, 0};                                                           \
                for (int k = 0; k < 8; k++)                                                      \
                    for (int u = 0; u < 4; u++)                                                  \
                        h[k >= 4] += blk[64 * k + 4 * i + u] * x[4 * k + u];                     \
                const float *xh = xs16 + 2 * (j * G + b);                                        \
                acc = fmadd(acc, f32_at(blk + 512 + 4 * i), (float)h[0] * sx[j * G + b]);        \
                acc = fmadd(acc, f32_at(blk + 576 + 4 * i), (float)h[1] * sx[j * G + b]);        \
                accm = fmadd(accm, f32_at(blk + 640 + 4 * i), xh[0]);                            \
                accm = fmadd(accm, f32_at(blk + 704 + 4 * i), xh[1]);                            \
            }                                                                                    \
            y[j * N + i] = acc + accm;                                                           \
        }                                                                                        \
}
#define Q8_GROUP(MR)                                                                             \
static void q8_tile_##MR(const uint8_t *tile, const uint8_t *xu, const float *sx,                \
        float *y, int64_t N, int64_t K, int64_t G, uint16_t valid) {                            \
    for (int j = 0; j < MR; j++)                                                                 \
        for (int i = 0; i < TR; i++) {                                                           \
            if (!(valid >> i & 1)) continue;                                                     \
            float acc = 0.0f;                                                                    \
            for (int64_t b = 0; b < G; b++) {                                                    \
                const uint8_t *blk = tile + b * Q8_TILE;                                         \
                const uint8_t *x = xu + j * K + b * QK;                                          \
                int32_t s, start;                                                                \
                memcpy(&start, blk + 544 + 4 * i, 4);                                            \
                s = start;                                                                       \
                for (int k = 0; k < 8; k++)                                                      \
                    for (int u = 0; u < 4; u++)                                                  \
                        s += x[4 * k + u] * (int8_t)blk[64 * k + 4 * i + u];                     \
                uint16_t d;                                                                      \
                memcpy(&d, blk + 512 + 2 * i, 2);                                                \
                acc = fmadd(acc, half_to_f32(d), (float)s * sx[j * G + b]);                     \
            }                                                                                    \
            y[j * N + i] = acc;                                                                  \
        }                                                                                        \
}
#define BLOCKS_VNNI 0
#endif

Q4_GROUP(1) Q4_GROUP(2) Q4_GROUP(3) Q4_GROUP(4) Q4_GROUP(5) Q4_GROUP(6) Q4_GROUP(7) Q4_GROUP(8)
Q8_GROUP(1) Q8_GROUP(2) Q8_GROUP(3) Q8_GROUP(4) Q8_GROUP(5) Q8_GROUP(6) Q8_GROUP(7) Q8_GROUP(8)
Q4K_GROUP(1) Q4K_GROUP(2) Q4K_GROUP(3) Q4K_GROUP(4) Q4K_GROUP(5) Q4K_GROUP(6) Q4K_GROUP(7)
Q4K_GROUP(8)
U8_GROUP(1) U8_GROUP(2) U8_GROUP(3) U8_GROUP(4) U8_GROUP(5) U8_GROUP(6) U8_GROUP(7) U8_GROUP(8)

/* A BF16 tile against MR rows of X rounded to bfloat16 (xb [MR, K]): each row's sums in two
   chains (even chunks, odd chunks; one chain of 18 dependent `vdpbf16ps` a 576-wide row held a
   one-row product to half the memory's speed), added last, the same for every MR. No software
   prefetch for one row: the hardware's keeps one stream busy (as gemv.c's one-row walk). */
#define BF16_TILE 1024
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BF16_GROUP(MR)                                                                           \
__attribute__((noinline)) static void bf16_tile_##MR(const uint8_t *tile, const uint16_t *xb,     \
        float *y, int64_t N, int64_t K, int64_t G, uint16_t valid) {                            \
    __m512 acc[MR][2];                                                                           \
    for (int j = 0; j < MR; j++) acc[j][0] = acc[j][1] = _mm512_setzero_ps();                    \
    for (int64_t b = 0; b < G; b++) {                                                            \
        const uint8_t *blk = tile + b * BF16_TILE;                                               \
        if (MR > 1)                        /* as the VNNI tiles' PREFETCH, 2560 bytes on */      \
            for (int c = 0; c < BF16_TILE; c += 64) _mm_prefetch((const char *)blk + c + 2560,   \
                                                                 _MM_HINT_T0);                   \
        _Pragma("GCC unroll 8") for (int c = 0; c < 16; c += 2) {                                \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(blk + 64 * c);                            \
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(blk + 64 * c + 64);                       \
            _Pragma("GCC unroll 8") for (int j = 0; j < MR; j++) {                               \
                const uint16_t *x = xb + j * K + b * QK + 2 * c;                                 \
                int32_t x0, x1;                                                                  \
                memcpy(&x0, x, 4); memcpy(&x1, x + 2, 4);                                        \
                acc[j][0] = _mm512_dpbf16_ps(acc[j][0], w0, (__m512bh)_mm512_set1_epi32(x0));     \
                acc[j][1] = _mm512_dpbf16_ps(acc[j][1], w1, (__m512bh)_mm512_set1_epi32(x1));     \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    for (int j = 0; j < MR; j++)                                                                 \
        _mm512_mask_storeu_ps(y + j * N, valid, _mm512_add_ps(acc[j][0], acc[j][1]));            \
}
#define BF16_DOT 1
#else
/* Portable, never chosen (Python holds bfloat16 weights this way only where the build has
   `vdpbf16ps`): the same sums in the same order, each pair as two multiply-adds, whose
   rounding may differ from the instruction's. */
#define BF16_GROUP(MR)                                                                           \
static void bf16_tile_##MR(const uint8_t *tile, const uint16_t *xb, float *y, int64_t N,         \
        int64_t K, int64_t G, uint16_t valid) {                                                  \
    for (int j = 0; j < MR; j++)                                                                 \
        for (int i = 0; i < TR; i++) {                                                           \
            if (!(valid >> i & 1)) continue;                                                     \
            float acc[2] = {0.0f, 0.0f};                                                         \
            for (int64_t b = 0; b < G; b++)                                                      \
                for (int c = 0; c < 16; c++) {                                                   \
                    const uint8_t *p = tile + b * BF16_TILE + 64 * c + 4 * i;                    \
                    const uint16_t *x = xb + j * K + b * QK + 2 * c;                             \
                    uint16_t w0, w1;                                                             \
                    memcpy(&w0, p, 2); memcpy(&w1, p + 2, 2);                                    \
                    acc[c & 1] = fmadd(fmadd(acc[c & 1], bf16_to_f32(w1), bf16_to_f32(x[1])),    \
                                       bf16_to_f32(w0), bf16_to_f32(x[0]));                      \
                }                                                                                \
            y[j * N + i] = acc[0] + acc[1];                                                      \
        }                                                                                        \
}
#define BF16_DOT 0
#endif
BF16_GROUP(1) BF16_GROUP(2) BF16_GROUP(3) BF16_GROUP(4) BF16_GROUP(5) BF16_GROUP(6)
BF16_GROUP(7) BF16_GROUP(8)

/* n floats of X (a multiple of 8) rounded to bfloat16 as f32_to_bf16 rounds each. */
static void round_to_bf16(const float *x, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) {
        u32x8 u, r, nan;
        memcpy(&u, x + i, sizeof u);
        nan = (u32x8)((u & 0x7fffffffu) > 0x7f800000u);                 /* each lane 0 or ~0 */
        r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        r = (r & ~nan) | (((u >> 16) | 0x40u) & nan);
        u16x8 h = __builtin_convertvector(r, u16x8);
        memcpy(out + i, &h, sizeof h);
    }
}

/* X quantized once for every weight a pass multiplies it by. */
typedef struct {
    const float *X;      /* [M, K]: the rows quantized */
    int64_t M, K, G;
    int8_t *xq;          /* [M, K] */
    uint8_t *xu;         /* [M, K] xq + 128 (Q8_0 products; NULL until wanted) */
    float *sx, *xs;      /* [M, G] */
    float *xs16;         /* [M, 2G] */
    uint16_t *xb;        /* [M, K] X rounded to bfloat16 (BF16 products: then nothing else) */
} quantized_x;

/* the weight kinds after gemv.c's F32/BF16/F16; BF16_WEIGHTS, F16_WEIGHTS: bfloat16 or float16 W
   read against float32 X (gemv.c's product()) */
enum { BLOCK_Q4_1 = 3, BLOCK_Q8_0 = 4, BF16_WEIGHTS = 5, BLOCK_Q4_K = 6, BLOCK_U8 = 7,
       F16_WEIGHTS = 8, BLOCK_BF16 = 9 };

/* Room for inputs of up to `values` values quantized, in slots: one a thread, and (index
   `together`) one the threads fill together. Each slot holds the int8 layout and its scales
   (`values` / 32 + 1 of each kind), the uint8 one (Q8_0 products) and the bfloat16 one (BF16
   products), where wanted. */
typedef struct {
    int8_t *xq; uint8_t *xu; uint16_t *xb; float *scale;
    int64_t values, scales, together;
} quant_room;

static void room_free(quant_room *room) {
    free(room->xq); free(room->xu); free(room->xb); free(room->scale);
}

/* 0, or 1 out of memory (nothing left allocated). */
static int room_alloc(quant_room *room, int64_t values, int64_t slots, int64_t together,
                      int want_q, int want_u8, int want_bf16) {
    *room = (quant_room){NULL, NULL, NULL, NULL, values, values / QK + 1, together};
    if (want_q) {
        room->xq = malloc((size_t)(slots * values));
        room->scale = malloc((size_t)(slots * 4 * room->scales) * sizeof(float));
    }
    if (want_u8) room->xu = malloc((size_t)(slots * values));
    if (want_bf16) room->xb = malloc((size_t)(slots * values) * sizeof(uint16_t));
    if ((want_q && (!room->xq || !room->scale)) || (want_u8 && !room->xu) ||
        (want_bf16 && !room->xb)) {
        room_free(room);
        return 1;
    }
    return 0;
}

/* X [M, K] as a product of `kind` reads it once quantized into slot `slot` of room. */
static quantized_x room_x(const quant_room *room, int64_t slot, const float *X, int64_t M,
                          int64_t K, int kind) {
    quantized_x q = {X, M, K, K / QK, NULL, NULL, NULL, NULL, NULL, NULL};
    if (kind == BLOCK_BF16) {
        q.xb = room->xb + slot * room->values;
        return q;
    }
    q.xq = room->xq + slot * room->values;
    q.sx = room->scale + slot * 4 * room->scales;
    q.xs = q.sx + room->scales;
    q.xs16 = q.sx + 2 * room->scales;
    if (kind == BLOCK_Q8_0) q.xu = room->xu + slot * room->values;
    return q;
}

/* Blocks b0..b1 of q->X quantized into q (and xu, xq + 128, where a Q8_0 product wants it). */
static void quantize_part(quantized_x *q, int64_t b0, int64_t b1) {
    if (q->xb) {
        round_to_bf16(q->X + b0 * QK, q->xb + b0 * QK, (b1 - b0) * QK);
        return;
    }
    quantize_blocks(q->X, b0, b1, q->xq, q->sx, q->xs, q->xs16);
    if (q->xu)
        for (int64_t i = b0 * QK; i < b1 * QK; i++) q->xu[i] = (uint8_t)((int)q->xq[i] + 128);
}

static int64_t tile_bytes(int kind) {
    return kind == BLOCK_Q4_1 ? Q4_TILE : kind == BLOCK_Q4_K ? Q4K_TILE :
           kind == BLOCK_U8 ? U8_TILE : kind == BLOCK_BF16 ? BF16_TILE : Q8_TILE;
}

/* Tiles t0..t1 of a block weight W (N rows, tiled) against every row of x. */
static void block_rows(const void *W, int kind, const quantized_x *x, float *Y, int64_t t0,
                       int64_t t1, int64_t N) {
    int64_t K = x->K, G = x->G, bytes = tile_bytes(kind);
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *tile = (const uint8_t *)W + t * G * bytes;
        int64_t rows = N - t * TR < TR ? N - t * TR : TR;
        uint16_t valid = (uint16_t)((1u << rows) - 1);
        for (int64_t m0 = 0; m0 < x->M; m0 += MRB) {
            int64_t mr = x->M - m0 < MRB ? x->M - m0 : MRB;
            float *y = Y + m0 * N + t * TR;
            const float *sx = x->sx ? x->sx + m0 * G : NULL, *xs = x->xs ? x->xs + m0 * G : NULL;
#define Q4CALL(R) q4_tile_##R(tile, x->xq + m0 * K, sx, xs, y, N, K, G, valid)
#define Q8CALL(R) q8_tile_##R(tile, x->xu + m0 * K, sx, y, N, K, G, valid)
#define Q4KCALL(R) q4k_tile_##R(tile, x->xq + m0 * K, sx, xs, y, N, K, G, valid)
#define U8CALL(R) u8_tile_##R(tile, x->xq + m0 * K, sx, x->xs16 + 2 * m0 * G, y, N, K, G, valid)
#define BF16CALL(R) bf16_tile_##R(tile, x->xb + m0 * K, y, N, K, G, valid)
#define BY_ROWS(CALL) switch (mr) { case 1: CALL(1); break; case 2: CALL(2); break;               \
                case 3: CALL(3); break; case 4: CALL(4); break; case 5: CALL(5); break;          \
                case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; }
            if (kind == BLOCK_Q4_1) { BY_ROWS(Q4CALL) }
            else if (kind == BLOCK_Q4_K) { BY_ROWS(Q4KCALL) }
            else if (kind == BLOCK_U8) { BY_ROWS(U8CALL) }
            else if (kind == BLOCK_BF16) { BY_ROWS(BF16CALL) }
            else { BY_ROWS(Q8CALL) }
#undef BY_ROWS
#undef BF16CALL
#undef Q4KCALL
#undef U8CALL
#undef Q4CALL
#undef Q8CALL
        }
    }
}

/* An input of at least this many values is quantized by the threads together (each its share
   of the blocks, then a barrier) rather than whole by each: a prefill's 120 rows quantized
   twice cost 3% of it (Q4_1 blocks); a decoding pass's one to a few rows are quicker quantized
   twice than met at a barrier. */
#define QUANT_SPLIT 4096

/* Thread t of T's share of Y [M, N] = X W^T for a block weight W of `kind`, inside a parallel
   region every thread of which calls it (it may meet them at a barrier): X quantized into the
   thread's own slot of `room`, or from QUANT_SPLIT values into the shared one by all of them;
   then W's tiles, static shares, or with two threads from both ends: each takes a share of
   what is left (a third, at least two tiles) from the count `taken` (zero on entry), thread
   0's tiles running up from the first and thread 1's down from the last (each share in order),
   so the two meet wherever the slower one has got to. Which thread computes a row changes
   nothing in it. */
static void block_share(const void *W, int kind, const float *X, float *Y, int64_t N, int64_t K,
                        int64_t M, int64_t t, int64_t T, const quant_room *room,
                        int64_t *taken) {
    int together = T > 1 && M * K >= QUANT_SPLIT;
    quantized_x qx = room_x(room, together ? room->together : t, X, M, K, kind), *q = &qx;
    int64_t blocks = M * q->G;
    if (together) {
        int64_t share = (blocks + T - 1) / T, b0 = t * share;
        int64_t b1 = b0 + share < blocks ? b0 + share : blocks;
        if (b0 < blocks) quantize_part(q, b0, b1);
        _Pragma("omp barrier")
    } else {
        quantize_part(q, 0, blocks);
    }
    int64_t tiles = (N + TR - 1) / TR, per = (tiles + T - 1) / T;
    if (T != 2) {
        int64_t a = t * per, z = a + per < tiles ? a + per : tiles;
        if (a < tiles) block_rows(W, kind, q, Y, a, z, N);
        return;
    }
    for (int64_t done = 0;;) {
        int64_t left = tiles - __atomic_load_n(taken, __ATOMIC_RELAXED);
        int64_t want = left / 3 > 2 ? left / 3 : 2;
        int64_t got = __atomic_fetch_add(taken, want, __ATOMIC_RELAXED);
        if (got >= tiles) break;
        int64_t n = got + want <= tiles ? want : tiles - got;
        int64_t a = t == 0 ? done : tiles - done - n;
        block_rows(W, kind, q, Y, a, a + n, N);
        done += n;
    }
}

int specflow_blocks_vnni(void) { return BLOCKS_VNNI; }
int specflow_bf16_dot(void) { return BF16_DOT; }

/* out [n, K] float32 = rows ids[0..n) of a block weight W [N, K] of `kind`, as its values (q x d
   (+ m), each a float32 product then a sum: what BlockWeight.dequantize computes): an embedding
   table held in its blocks, looked up. Returns 0, or 2 an id outside 0..N. */
int specflow_block_rows(const void *W, int kind, const int64_t *ids, int64_t n, int64_t N,
                        int64_t K, float *out) {
    int64_t G = K / QK, bytes = tile_bytes(kind);
    for (int64_t r = 0; r < n; r++) {
        int64_t id = ids[r];
        if (id < 0 || id >= N) return 2;
        int64_t i = id % TR;
        const uint8_t *row = (const uint8_t *)W + (id / TR) * G * bytes;
        for (int64_t b = 0; b < G; b++) {
            const uint8_t *blk = row + b * bytes;
            float *o = out + r * K + b * QK;
            if (kind == BLOCK_Q4_1 || kind == BLOCK_Q4_K) {
                int wide = kind == BLOCK_Q4_K;
                float d = wide ? f32_at(blk + 256 + 4 * i) : f16_at(blk + 256 + 2 * i);
                float m = wide ? f32_at(blk + 320 + 4 * i) : f16_at(blk + 288 + 2 * i);
                for (int c = 0; c < 4; c++)
                    for (int u = 0; u < 4; u++) {
                        uint8_t v = blk[64 * c + 4 * i + u];
                        o[4 * c + u] = (float)(v & 0x0F) * d + m;
                        o[16 + 4 * c + u] = (float)(v >> 4) * d + m;
                    }
            } else if (kind == BLOCK_U8) {
                for (int j = 0; j < QK; j++) {
                    int h = j >= QK / 2;
                    o[j] = (float)blk[64 * (j / 4) + 4 * i + j % 4] * f32_at(blk + 512 + 64 * h + 4 * i)
                           + f32_at(blk + 640 + 64 * h + 4 * i);
                }
            } else {
                float d = f16_at(blk + 512 + 2 * i);
                for (int j = 0; j < QK; j++)
                    o[j] = (float)(int8_t)blk[64 * (j / 4) + 4 * i + j % 4] * d;
            }
        }
    }
    return 0;
}
