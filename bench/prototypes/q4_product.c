// A prototype, measured and not wired in (bench/prototypes/q4_product.py runs it against ATen's
// int4 operator): two int4 products over GGUF-style Q4 blocks for the native int4 pass to come.
// 1. q4_gemm: blocks decoded to float per row pair of nibbles, float FMAs.
// 2. q4_gemm_vnni: activations quantized to int8 per block (as llama.cpp's Q8 blocks), the
//    nibbles multiplied as unsigned bytes with VNNI's vpdpbusd, 64 weights an instruction.
// Build: gcc -O3 -march=native -fopenmp -shared -fPIC q4_product.c -o libq4_product.so
//
// y[M, N] = x[M, K] @ W^T, W in GGUF-style 4-bit blocks of 32 along K:
// qs [N, K/32, 16] uint8 (byte j: weight j low nibble, weight j+16 high nibble),
// d, m [N, K/32] float: w = q * d + m. x float32. M <= 8.
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

static inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

void q4_gemm(const uint8_t *qs, const float *d, const float *mn, const float *x, float *y,
             int64_t N, int64_t K, int64_t M) {
    const int64_t G = K / 32;
    float xsum[8 * 4096 / 32];          // [M, G] sums of x over each group
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < G; g++) {
            __m512 a = _mm512_loadu_ps(x + r * K + g * 32), b = _mm512_loadu_ps(x + r * K + g * 32 + 16);
            xsum[r * G + g] = hsum512(_mm512_add_ps(a, b));
        }
    const __m128i low = _mm_set1_epi8(0x0F);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        __m512 acc[8];
        float msum[8];
        for (int r = 0; r < M; r++) { acc[r] = _mm512_setzero_ps(); msum[r] = 0.f; }
        const uint8_t *q = qs + n * G * 16;
        const float *dn = d + n * G, *mn_ = mn + n * G;
        for (int64_t g = 0; g < G; g++) {
            __m128i b = _mm_loadu_si128((const __m128i *)(q + g * 16));
            __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
            __m512 qlo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
            __m512 qhi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
            __m512 dv = _mm512_set1_ps(dn[g]);
            float mg = mn_[g];
            for (int r = 0; r < M; r++) {
                const float *xr = x + r * K + g * 32;
                __m512 t = _mm512_mul_ps(qlo, _mm512_loadu_ps(xr));
                t = _mm512_fmadd_ps(qhi, _mm512_loadu_ps(xr + 16), t);
                acc[r] = _mm512_fmadd_ps(dv, t, acc[r]);
                msum[r] += mg * xsum[r * G + g];
            }
        }
        for (int r = 0; r < M; r++) y[r * N + n] = hsum512(acc[r]) + msum[r];
    }
}

// VNNI: activations quantized to int8 per group of 32 (scale sx = max|x| / 127), weights'
// nibbles as unsigned bytes: sum_k w_k x_k = d sx sum(q_k xq_k) + m sx sum(xq_k).
// xq [M, K] int8, sx [M, G], xs [M, G] = sx * sum(xq) over the group.
void q4_quantize_x(const float *x, int8_t *xq, float *sx, float *xs, int64_t K, int64_t M) {
    const int64_t G = K / 32;
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *p = x + r * K + g * 32;
            float amax = 0.f;
            for (int i = 0; i < 32; i++) { float a = p[i] < 0 ? -p[i] : p[i]; if (a > amax) amax = a; }
            float s = amax / 127.f, inv = s > 0 ? 1.f / s : 0.f;
            int sum = 0;
            for (int i = 0; i < 32; i++) {
                int v = (int)__builtin_roundf(p[i] * inv);
                xq[r * K + g * 32 + i] = (int8_t)v; sum += v;
            }
            sx[r * G + g] = s; xs[r * G + g] = s * (float)sum;
        }
}

void q4_gemm_vnni(const uint8_t *qs, const float *d, const float *mn, const int8_t *xq,
                  const float *sx, const float *xs, float *y, int64_t N, int64_t K, int64_t M) {
    const int64_t G = K / 32, P = G / 2;      // G even here
    const __m256i low = _mm256_set1_epi8(0x0F);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        __m512 acc[8];
        for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
        const uint8_t *q = qs + n * G * 16;
        const float *dn = d + n * G;
        for (int64_t p = 0; p < P; p++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(q + p * 32));   // [A 16 | B 16]
            __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);   // Alo Blo Ahi Bhi
            __m512i w = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));     // Alo Ahi Blo Bhi
            __m512 dv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(dn[2 * p]), _mm512_set1_ps(dn[2 * p + 1]));
            for (int r = 0; r < M; r++) {
                __m512i xv = _mm512_loadu_si512((const void *)(xq + r * K + p * 64));
                __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
                const float *sxr = sx + r * G + 2 * p;
                __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sxr[0]), _mm512_set1_ps(sxr[1]));
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, sc), _mm512_cvtepi32_ps(s), acc[r]);
            }
        }
        const float *mnn = mn + n * G;
        for (int r = 0; r < M; r++) {
            float ms = 0.f;
            const float *xsr = xs + r * G;
            for (int64_t g = 0; g < G; g++) ms += mnn[g] * xsr[g];
            y[r * N + n] = _mm512_reduce_add_ps(acc[r]) + ms;
        }
    }
}
