/* Products of a few rows by a weight held in GGUF blocks, as the file holds them (included by
   gemv.c; specflow.backends.lean.blocks).

   Two block types, ggml's own layouts, 32 weights of a row each:
   - Q4_1 (20 bytes): float16 scale d, float16 minimum m, 16 bytes of nibbles; weight j is
     q_j x d + m, q_j the low nibble of byte j (j < 16) or the high nibble of byte j - 16.
     A Q4_0 block ((q - 8) x d) is this with m = -8d, exact in float16; specflow's own int4
     (`dtype=int4`) writes these blocks too.
   - Q8_0 (34 bytes): float16 scale d, 32 int8 q; weight j is q_j x d (a GGUF file's LM head).

   The activations are quantized to int8 per block of 32 (scale s = max |x| / 127, as
   llama.cpp's Q8 blocks), so a block's product is an integer sum, d s sum(q xq) (+ m s sum(xq)
   for Q4_1), exact in int32: with AVX512-VNNI, `vpdpbusd` multiplies 64 unsigned by 64 signed
   bytes into 16 sums in one instruction. The weight is read once per pass from memory, in its
   4.5 (Q4_1: 5) or 8.5 bits a weight. The activation's rounding (~0.4% of a block's largest value)
   is what the product adds to the weight's own error; it is llama.cpp's arithmetic for these
   files.

   Every row of Y is computed by the same operations whatever M and the thread count are (each
   row's sums in block order, its accumulator's lanes summed in one fixed order), so a row's
   result does not depend on the rows beside it. The int sums are exact on every path; the
   float sums' order differs between the AVX-512, AVX2 and portable paths, so two CPUs may
   differ in the last bits (as for gemv.c's float products). */

#define QK 32

typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } block_q4_1;      /* 20 bytes */
typedef struct { uint16_t d; int8_t qs[QK]; } block_q8_0;               /* 34 bytes */
_Static_assert(sizeof(block_q4_1) == 20, "Q4_1 block is 20 bytes");
_Static_assert(sizeof(block_q8_0) == 34, "Q8_0 block is 34 bytes");

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

/* X [M, K] float32 -> per block of 32: xq [M, K] int8, the scale s [M, K/32] and s x sum(xq)
   [M, K/32]. K: a multiple of 32. */
static void quantize_rows(const float *X, int64_t M, int64_t K, int8_t *xq, float *sx, float *xs) {
    int64_t G = K / QK;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            const float *p = X + m * K + g * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) {
                float a = fabsf(p[i]);
                if (a > amax) amax = a;
            }
            float s = amax / 127.0f, inv = s > 0.0f ? 127.0f / amax : 0.0f;
            int sum = 0;
            int8_t *q = xq + m * K + g * QK;
            for (int i = 0; i < QK; i++) {
                int v = (int)nearbyintf(p[i] * inv);
                q[i] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
                sum += q[i];
            }
            sx[m * G + g] = s;
            xs[m * G + g] = s * (float)sum;
        }
}

#define MRB 8          /* rows of X one walk of a weight row takes (accumulators in registers) */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* A weight row's pair of blocks (64 weights) as 64 unsigned bytes in order: the nibbles of
   both blocks split into low and high halves and put back in weight order. */
static inline __m512i q4_pair(const block_q4_1 *b) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)b[1].qs),
                                 _mm_loadu_si128((const __m128i *)b[0].qs));   /* [A | B] */
    __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);        /* Alo Blo Ahi Bhi */
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));               /* Alo Ahi Blo Bhi */
}

static inline __m512 two(float a, float b) {        /* lanes 0-7 a, 8-15 b */
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b));
}

/* Row n of a Q4_1 weight (G blocks) against MR rows of X (xq, their scales as lane pairs sv
   [MR, P, 16] and sums xs [MR, G]): y[j * N] for each row j. The minimums' term, m s sum(xq)
   over the blocks, is one dot product per row of the row's minimums (widened once, mins [G])
   with xs. */
#define Q4_GROUP(MR)                                                                             \
__attribute__((noinline)) static void q4_group_##MR(const block_q4_1 *b, const int8_t *xq,        \
        const float *sv, const float *xs, float *y, int64_t N, int64_t K, int64_t G,              \
        float *mins) {                                                                           \
    __m512 acc[MR];                                                                              \
    int64_t P = (G + 1) / 2;                                                                     \
    for (int j = 0; j < MR; j++) acc[j] = _mm512_setzero_ps();                                   \
    int64_t p = 0;                                                                               \
    for (; 2 * p + 1 < G; p++) {                                                                 \
        const block_q4_1 *bp = b + 2 * p;                                                        \
        __m512i w = q4_pair(bp);                                                                 \
        __m512 dv = two(half_to_f32(bp[0].d), half_to_f32(bp[1].d));                             \
        for (int j = 0; j < MR; j++) {                                                           \
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,                           \
                                            _mm512_loadu_si512(xq + j * K + 64 * p));            \
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(sv + (j * P + p) * 16)); \
            acc[j] = _mm512_fmadd_ps(dv, t, acc[j]);                                             \
        }                                                                                        \
    }                                                                                            \
    if (p < P) {                         /* an odd last block: the upper lanes stay zero */     \
        const block_q4_1 *bp = b + 2 * p;                                                        \
        const __m128i low = _mm_set1_epi8(0x0F);                                                 \
        __m128i v = _mm_loadu_si128((const __m128i *)bp->qs);                                    \
        __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low),                   \
                                     _mm_and_si128(v, low));                                     \
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_setzero_si256(), 1);    \
        __m512 dv = _mm512_set1_ps(half_to_f32(bp->d));                                          \
        for (int j = 0; j < MR; j++) {                                                           \
            __m512i x = _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xq + j * K + 64 * p);             \
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);                       \
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(sv + (j * P + p) * 16)); \
            acc[j] = _mm512_fmadd_ps(dv, t, acc[j]);                                             \
        }                                                                                        \
    }                                                                                            \
    for (int64_t g = 0; g < G; g++) mins[g] = half_to_f32(b[g].m);                               \
    for (int j = 0; j < MR; j++) y[j * N] = _mm512_reduce_add_ps(acc[j]) + dot(mins, xs + j * G, G); \
}

/* Row n of a Q8_0 weight against MR rows of X, with xu = xq + 128 as unsigned bytes: vpdpbusd
   multiplies unsigned by signed, so sum(xu q) - 128 sum(q) = sum(xq q), the correction summed by
   the same instruction once per weight pair and taken as each row's starting value. */
#define Q8_GROUP(MR)                                                                             \
__attribute__((noinline)) static void q8_group_##MR(const block_q8_0 *b, const uint8_t *xu,       \
        const float *sv, float *y, int64_t N, int64_t K, int64_t G) {                            \
    __m512 acc[MR];                                                                              \
    int64_t P = (G + 1) / 2;                                                                     \
    const __m512i ones = _mm512_set1_epi8(1);                                                    \
    for (int j = 0; j < MR; j++) acc[j] = _mm512_setzero_ps();                                   \
    for (int64_t p = 0; p < P; p++) {                                                            \
        const block_q8_0 *bp = b + 2 * p;                                                        \
        int pair = 2 * p + 1 < G;                                                                \
        __m256i w0 = _mm256_loadu_si256((const __m256i *)bp[0].qs);                             \
        __m256i w1 = pair ? _mm256_loadu_si256((const __m256i *)bp[1].qs) : _mm256_setzero_si256(); \
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);                       \
        __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(),                                 \
                          _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w), 7)); \
        __m512 dv = two(half_to_f32(bp[0].d), pair ? half_to_f32(bp[1].d) : 0.0f);              \
        for (int j = 0; j < MR; j++) {                                                           \
            __m512i x = pair ? _mm512_loadu_si512(xu + j * K + 64 * p)                          \
                             : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xu + j * K + 64 * p);      \
            __m512i s = _mm512_dpbusd_epi32(start, x, w);                                        \
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(sv + (j * P + p) * 16)); \
            acc[j] = _mm512_fmadd_ps(dv, t, acc[j]);                                             \
        }                                                                                        \
    }                                                                                            \
    for (int j = 0; j < MR; j++) y[j * N] = _mm512_reduce_add_ps(acc[j]);                        \
}
#define BLOCKS_VNNI 1
#else
/* Portable: each block's integer sum, then d s sum(q xq) added in block order. */
#define Q4_GROUP(MR)                                                                             \
static void q4_group_##MR(const block_q4_1 *b, const int8_t *xq, const float *sx,                \
        const float *xs, float *y, int64_t N, int64_t K, int64_t G, float *mins) {               \
    (void)mins;                                                                                  \
    for (int j = 0; j < MR; j++) {                                                               \
        float acc = 0.0f;                                                                        \
        for (int64_t g = 0; g < G; g++) {                                                        \
            const int8_t *x = xq + j * K + g * QK;                                               \
            int32_t s = 0;                                                                       \
            for (int i = 0; i < QK / 2; i++)                                                     \
                s += (b[g].qs[i] & 0x0F) * x[i] + (b[g].qs[i] >> 4) * x[i + QK / 2];             \
            acc = fmadd(acc, half_to_f32(b[g].d) * sx[j * G + g], (float)s);                    \
            acc = fmadd(acc, half_to_f32(b[g].m), xs[j * G + g]);                                \
        }                                                                                        \
        y[j * N] = acc;                                                                          \
    }                                                                                            \
}
#define Q8_GROUP(MR)                                                                             \
static void q8_group_##MR(const block_q8_0 *b, const int8_t *xq, const float *sx,                \
        float *y, int64_t N, int64_t K, int64_t G) {                                             \
    for (int j = 0; j < MR; j++) {                                                               \
        float acc = 0.0f;                                                                        \
        for (int64_t g = 0; g < G; g++) {                                                        \
            const int8_t *x = xq + j * K + g * QK;                                               \
            int32_t s = 0;                                                                       \
            for (int i = 0; i < QK; i++) s += b[g].qs[i] * x[i];                                 \
            acc = fmadd(acc, half_to_f32(b[g].d) * sx[j * G + g], (float)s);                    \
        }                                                                                        \
        y[j * N] = acc;                                                                          \
    }                                                                                            \
}
#define BLOCKS_VNNI 0
#endif

Q4_GROUP(1) Q4_GROUP(2) Q4_GROUP(3) Q4_GROUP(4) Q4_GROUP(5) Q4_GROUP(6) Q4_GROUP(7) Q4_GROUP(8)
Q8_GROUP(1) Q8_GROUP(2) Q8_GROUP(3) Q8_GROUP(4) Q8_GROUP(5) Q8_GROUP(6) Q8_GROUP(7) Q8_GROUP(8)

/* X quantized once for every weight a pass multiplies it by. */
typedef struct {
    int64_t M, K, G, P;
    int8_t *xq;          /* [M, K] */
    uint8_t *xu;         /* [M, K] xq + 128 (Q8_0 products; NULL until wanted) */
    float *sx, *xs;      /* [M, G] */
    float *sv;           /* [M, P, 16] each pair of scales as lanes (the VNNI path) */
} quantized_x;

static void free_quantized(quantized_x *q) {
    free(q->xq); free(q->xu); free(q->sx); free(q->xs); free(q->sv);
    memset(q, 0, sizeof *q);
}

/* 0, or 1 out of memory. */
static int quantize_x(const float *X, int64_t M, int64_t K, int want_u8, quantized_x *q) {
    memset(q, 0, sizeof *q);
    q->M = M; q->K = K; q->G = K / QK; q->P = (q->G + 1) / 2;
    q->xq = malloc((size_t)(M * K));
    q->sx = malloc((size_t)(M * q->G) * sizeof(float));
    q->xs = malloc((size_t)(M * q->G) * sizeof(float));
    q->sv = malloc((size_t)(M * q->P * 16) * sizeof(float));
    if (want_u8) q->xu = malloc((size_t)(M * K));
    if (!q->xq || !q->sx || !q->xs || !q->sv || (want_u8 && !q->xu)) { free_quantized(q); return 1; }
    quantize_rows(X, M, K, q->xq, q->sx, q->xs);
    for (int64_t m = 0; m < M; m++)
        for (int64_t p = 0; p < q->P; p++) {
            float a = q->sx[m * q->G + 2 * p], b = 2 * p + 1 < q->G ? q->sx[m * q->G + 2 * p + 1] : 0.0f;
            for (int i = 0; i < 16; i++) q->sv[(m * q->P + p) * 16 + i] = i < 8 ? a : b;
        }
    if (want_u8)
        for (int64_t i = 0; i < M * K; i++) q->xu[i] = (uint8_t)((int)q->xq[i] + 128);
    return 0;
}

enum { BLOCK_Q4_1 = 3, BLOCK_Q8_0 = 4 };      /* the weight kinds after gemv.c's F32/BF16/F16 */

/* Rows n0..n1 of a block weight W (N rows of K / 32 blocks) against every row of x. */
static void block_rows(const void *W, int kind, const quantized_x *x, float *Y, int64_t n0,
                       int64_t n1, int64_t N) {
    int64_t K = x->K, G = x->G;
    float mins_[512], *mins = G <= 512 ? mins_ : malloc((size_t)G * sizeof(float));
    if (!mins) return;               /* K past 16384 and no memory: quantize_x's check failed first */
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m0 = 0; m0 < x->M; m0 += MRB) {
            int64_t mr = x->M - m0 < MRB ? x->M - m0 : MRB;
            float *y = Y + m0 * N + n;
#if BLOCKS_VNNI
            const float *sv = x->sv + m0 * x->P * 16, *xs = x->xs + m0 * G;
#define Q4CALL(R) q4_group_##R((const block_q4_1 *)W + n * G, x->xq + m0 * K, sv, xs, y, N, K, G, mins)
#define Q8CALL(R) q8_group_##R((const block_q8_0 *)W + n * G, x->xu + m0 * K, sv, y, N, K, G)
#else
            const float *sx = x->sx + m0 * G, *xs = x->xs + m0 * G;
#define Q4CALL(R) q4_group_##R((const block_q4_1 *)W + n * G, x->xq + m0 * K, sx, xs, y, N, K, G, mins)
#define Q8CALL(R) q8_group_##R((const block_q8_0 *)W + n * G, x->xq + m0 * K, sx, y, N, K, G)
            (void)xs;
#endif
#define BY_ROWS(CALL) switch (mr) { case 1: CALL(1); break; case 2: CALL(2); break;               \
                case 3: CALL(3); break; case 4: CALL(4); break; case 5: CALL(5); break;          \
                case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; }
            if (kind == BLOCK_Q4_1) { BY_ROWS(Q4CALL) } else { BY_ROWS(Q8CALL) }
#undef BY_ROWS
#undef Q4CALL
#undef Q8CALL
        }
    if (mins != mins_) free(mins);
}

static void block_product(const void *W, int kind, const quantized_x *x, float *Y, int64_t N,
                          int threads) {
    SPLIT(block_rows(W, kind, x, Y, n0, n1, N))
}

/* Y [M, N] float32 = X [M, K] float32 times W^T, W: N rows of K / 32 blocks of `kind` (3 Q4_1,
   4 Q8_0); G [K] float32 or NULL: RMSNorm(X) x G first (eps). Returns 0, 1 out of memory, 2 a
   K that is not a multiple of 32. */
int specflow_blocks(const void *W, int kind, const float *X, float *Y, int64_t N, int64_t K,
                    int64_t M, int threads, const float *G, float eps) {
    if (K % QK) return 2;
    float *owned;
    const float *x = prepare_x(X, G, eps, F32, M, K, &owned);
    if (!x) return 1;
    quantized_x q;
    int failed = quantize_x(x, M, K, kind == BLOCK_Q8_0, &q);
    free(owned);
    if (failed) return 1;
    block_product(W, kind, &q, Y, N, threads);
    free_quantized(&q);
    return 0;
}

int specflow_blocks_vnni(void) { return BLOCKS_VNNI; }
