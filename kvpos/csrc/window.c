#include "common.h"

/* Scores of int8 keys for groups of queries: out[h, j] = scale[h, j] * max_g sum_d q[h, g, d] * k[h, j, d].
   q float32 [H, G, D] contiguous (G <= 16); kt int8 [H, nb, D, 16] (keys in blocks of 16, transposed so that one
   dim of 16 keys is 16 consecutive bytes: every inner loop is a plain 16-wide vector op); scale float32 [H, F];
   out float32 [H, nb * 16] contiguous (entries >= F are padding). */
void kvpos_score_int8(const float *q, const int8_t *kt, const float *scale, float *out, int64_t H, int64_t G,
                      int64_t F, int64_t D, int64_t nb, int nthreads) {
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")
    for (int64_t idx = 0; idx < H * nb; idx++) {
        const int64_t h = idx / nb, b = idx % nb;
        const float *qh = q + h * G * D;
        const int8_t *kb = kt + idx * D * 16;
        float best[16];
        for (int i = 0; i < 16; i++) best[i] = -3.0e38f;
        for (int64_t g = 0; g < G; g++) {              /* one 16-wide vector accumulator per query */
            const float *qg = qh + g * D;
            float a[16];
#if defined(__AVX512F__)
            __m512 acc = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                const __m128i kv = _mm_loadu_si128((const __m128i *)(kb + d * 16));
                acc = _mm512_fmadd_ps(_mm512_set1_ps(qg[d]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(kv)), acc);
            }
            _mm512_storeu_ps(a, acc);
#elif defined(__AVX2__)
            __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                const __m256 qv = _mm256_set1_ps(qg[d]);
                const __m128i k0 = _mm_loadl_epi64((const __m128i *)(kb + d * 16));
                const __m128i k1 = _mm_loadl_epi64((const __m128i *)(kb + d * 16 + 8));
                lo = _mm256_fmadd_ps(qv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(k0)), lo);
                hi = _mm256_fmadd_ps(qv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(k1)), hi);
            }
            _mm256_storeu_ps(a, lo);
            _mm256_storeu_ps(a + 8, hi);
#else
            for (int i = 0; i < 16; i++) a[i] = 0.0f;
            for (int64_t d = 0; d < D; d++)
                for (int i = 0; i < 16; i++) a[i] += qg[d] * (float)kb[d * 16 + i];
#endif
            for (int i = 0; i < 16; i++) best[i] = a[i] > best[i] ? a[i] : best[i];
        }
        for (int i = 0; i < 16; i++) {
            const int64_t j = b * 16 + i;
            out[h * nb * 16 + j] = j < F ? best[i] * scale[h * F + j] : -3.0e38f;
        }
    }
}

/* Indices of the k largest entries of each row of s [H, F] (unordered), by quickselect on a copy; out int64 [H, k].
   O(F) per row instead of a sort. */
static void kv_select(float *v, int64_t *ix, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const float pivot = v[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {                                      /* descending partition */
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                float tv = v[i]; v[i] = v[j]; v[j] = tv;
                int64_t ti = ix[i]; ix[i] = ix[j]; ix[j] = ti;
                i++; j--;
            }
        }
        if (k - 1 <= j) hi = j; else if (k - 1 >= i) lo = i; else break;
    }
}

void kvpos_topk(const float *s, int64_t H, int64_t F, int64_t k, int64_t *out, float *work_v, int64_t *work_i,
                int nthreads) {
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")
    for (int64_t h = 0; h < H; h++) {
        float *v = work_v + h * F;
        int64_t *ix = work_i + h * F;
        for (int64_t j = 0; j < F; j++) { v[j] = s[h * F + j]; ix[j] = j; }
        kv_select(v, ix, F, k);
        for (int64_t j = 0; j < k; j++) out[h * k + j] = ix[j];
    }
}
