#include "common.h"
#include <stdlib.h>

/* Decode attention over RAW keys (rotate on read, never materialised). One query token per row.
   q float32 [B, Hq, D] contiguous (rotated by the model); k, v: T* [B, Hkv, *, D] with unit stride on D, stride D on
   slots, B/H strides kb, kh (v: vb, vh), in elements; cs, sn float32 [Bc, N, R/2] contiguous, the cos/sin of each
   slot's position already multiplied by the RoPE attention scaling (Bc in {1, B}); mask float32 additive [Bm, N]
   (Bm in {1, B}) or NULL; out float32 [B, Hq, D]; Hq = Hkv * G (query head h * G + g reads kv head h, as
   transformers' repeat_kv); work float32 [B * Hkv * nch * G * (D + 2)]; layout 0 = half, 1 = interleaved.
   Work item = (row, kv head, chunk of KV_CHUNK slots): scores of the G queries against the chunk's keys (each key
   rotated once, in registers), the chunk's softmax partials (max, sum, V accumulation); a second loop merges the
   chunks (split-K, so that 2 threads stay busy with 3 kv heads). Rows every key of which is masked give 0.
   AVX2 paths: scores and exp for the half layout with R/2 and D - R multiples of 8, the value sums for D a multiple
   of 32 (accumulators in registers; G up to 4 compiled as constants); otherwise plain C (same formulas). */
#define KV_CHUNK 128
#define KV_MAXG 16

#if defined(__AVX2__)
static inline __m256 ld8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 ld8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
/* exp(x) for x <= 0 (scores minus their max): Cody-Waite reduction, degree-6 polynomial (about 2 ulp); x below
   -87 (exp underflows, masked keys are -inf) gives exactly 0. */
static inline __m256 exp8_nonpos(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 dead = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(dead, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#define KV_AVX2 1
#else
#define KV_AVX2 0
#endif

/* scores sc[g][j - j0] of the G queries against keys j0..j1-1, rotated on the fly */
#define SCORES_SCALAR_ANY(FILL, LOAD)                                                                          \
    for (int64_t j = j0; j < j1; j++) {                                                                       \
        const float *cj = crow + j * h2, *nj = nrow + j * h2;                                                  \
        float kf[256], kx[256];                                                                                \
        FILL(LOAD)                                                                                             \
        for (int64_t i = 0; i < h2; i++) {                                                                     \
            const int64_t ia = layout == 0 ? i : 2 * i, ie = layout == 0 ? i + h2 : 2 * i + 1;                \
            kx[ia] = kf[ia] * cj[i] - kf[ie] * nj[i];                                                          \
            kx[ie] = kf[ie] * cj[i] + kf[ia] * nj[i];                                                          \
        }                                                                                                      \
        for (int64_t i = R; i < D; i++) kx[i] = kf[i];                                                         \
        const float add = mrow ? mrow[j] : 0.0f;                                                               \
        for (int64_t g = 0; g < G; g++) {                                                                      \
            const float *qg = qh + g * D;                                                                      \
            float dot = 0.0f;                                                                                  \
            for (int64_t i = 0; i < D; i++) dot += qg[i] * kx[i];                                              \
            sc[g][j - j0] = dot * scale + add;                                                                 \
        }                                                                                                      \
    }
#define RAW_FILL(LOAD) { const T *kj = kr + j * D; for (int64_t i = 0; i < D; i++) kf[i] = LOAD(kj[i]); }
#define SCORES_SCALAR(LOAD) SCORES_SCALAR_ANY(RAW_FILL, LOAD)

#define SCORES_AVX2_ANY(PRE, KEY8, LD8, GC)                                                                     \
    for (int64_t j = j0; j < j1; j++) {                                                                       \
        PRE                                                                                                    \
        const float *cj = crow + j * h2, *nj = nrow + j * h2;                                                  \
        __m256 acc[KV_MAXG];                                                                                   \
        for (int64_t g = 0; g < (GC); g++) acc[g] = _mm256_setzero_ps();                                       \
        for (int64_t i = 0; i < h2; i += 8) {                                                                  \
            const __m256 a = KEY8(LD8, i), e = KEY8(LD8, i + h2);                                              \
            const __m256 c = _mm256_loadu_ps(cj + i), n = _mm256_loadu_ps(nj + i);                             \
            const __m256 ra = _mm256_fmsub_ps(a, c, _mm256_mul_ps(e, n));                                      \
            const __m256 rb = _mm256_fmadd_ps(e, c, _mm256_mul_ps(a, n));                                      \
            for (int64_t g = 0; g < (GC); g++) {                                                               \
                const float *qg = qh + g * D;                                                                  \
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), ra, acc[g]);                                 \
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i + h2), rb, acc[g]);                            \
            }                                                                                                  \
        }                                                                                                      \
        for (int64_t i = R; i < D; i += 8) {                                                                   \
            const __m256 x = KEY8(LD8, i);                                                                     \
            for (int64_t g = 0; g < (GC); g++)                                                                 \
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + i), x, acc[g]);                         \
        }                                                                                                      \
        const float add = mrow ? mrow[j] : 0.0f;                                                               \
        for (int64_t g = 0; g < (GC); g++) sc[g][j - j0] = hsum8(acc[g]) * scale + add;                        \
    }
#define RAW_PRE const T *kj = kr + j * D;
#define RAW_KEY8(LD8, o) LD8(kj + (o))
#define SCORES_AVX2(LD8, GC) SCORES_AVX2_ANY(RAW_PRE, RAW_KEY8, LD8, GC)

/* V accumulation, 32 dims at a time in registers: acc[g][d0..d0+32) += p[g][j] * v[j][d0..d0+32) */
#define VACC_AVX2_ANY(VT, VLD8, GC)                                                                            \
    for (int64_t d0 = 0; d0 < D; d0 += 32) {                                                                  \
        __m256 a[KV_MAXG][4];                                                                                  \
        for (int64_t g = 0; g < (GC); g++)                                                                     \
            for (int u = 0; u < 4; u++) a[g][u] = _mm256_setzero_ps();                                         \
        for (int64_t j = 0; j < nj; j++) {                                                                     \
            const VT *vj = vr + (j0 + j) * D + d0;                                                             \
            const __m256 x0 = VLD8(vj), x1 = VLD8(vj + 8), x2 = VLD8(vj + 16), x3 = VLD8(vj + 24);             \
            for (int64_t g = 0; g < (GC); g++) {                                                               \
                const __m256 p = _mm256_set1_ps(sc[g][j]);                                                     \
                a[g][0] = _mm256_fmadd_ps(p, x0, a[g][0]);                                                     \
                a[g][1] = _mm256_fmadd_ps(p, x1, a[g][1]);                                                     \
                a[g][2] = _mm256_fmadd_ps(p, x2, a[g][2]);                                                     \
                a[g][3] = _mm256_fmadd_ps(p, x3, a[g][3]);                                                     \
            }                                                                                                  \
        }                                                                                                      \
        for (int64_t g = 0; g < (GC); g++)                                                                     \
            for (int u = 0; u < 4; u++) _mm256_storeu_ps(acc[g] + d0 + 8 * u, a[g][u]);                       \
    }
#define VACC_AVX2(LD8, GC) VACC_AVX2_ANY(T, LD8, GC)

/* the G-specialised forms (G a compile-time constant keeps the accumulators in registers) */
#define BY_G(MACRO, LD8)                                                                                       \
    switch (G) {                                                                                               \
        case 1: MACRO(LD8, 1) break;                                                                           \
        case 2: MACRO(LD8, 2) break;                                                                           \
        case 3: MACRO(LD8, 3) break;                                                                           \
        case 4: MACRO(LD8, 4) break;                                                                           \
        default: MACRO(LD8, G) break;                                                                          \
    }

/* softmax partials of one chunk per query g: sc <- exp(sc - m), wk <- (m, l); WEIGHT then rescales sc by value
   (after l is summed); the value accumulators start at 0 */
#define CHUNK_SOFTMAX(WEIGHT, LOAD)                                                                            \
        float *wk = work + idx * G * (D + 2);                                                                  \
        for (int64_t g = 0; g < G; g++) {                                                                      \
            float m = -INFINITY, l = 0.0f;                                                                     \
            for (int64_t j = 0; j < nj; j++) m = sc[g][j] > m ? sc[g][j] : m;                                  \
            if (m == -INFINITY) {                                                                              \
                for (int64_t j = 0; j < nj; j++) sc[g][j] = 0.0f;                                              \
            } else {                                                                                           \
                int64_t j = 0;                                                                                 \
                KV_EXP_VEC                                                                                     \
                for (; j < nj; j++) sc[g][j] = expf(sc[g][j] - m);                                             \
                for (j = 0; j < nj; j++) l += sc[g][j];                                                        \
                WEIGHT(LOAD)                                                                                   \
            }                                                                                                  \
            wk[g * (D + 2)] = m;                                                                               \
            wk[g * (D + 2) + 1] = l;                                                                           \
            if (!vecv) for (int64_t i = 0; i < D; i++) acc[g][i] = 0.0f;                                       \
        }
#define NO_WEIGHT(LOAD)
#define Q8_VALUE_SCALES(LOAD) if (!tail) for (j = 0; j < nj; j++) sc[g][j] *= LOAD(vsr[j0 + j]);

/* merge the chunks of each query row (split-K): out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c */
#define DECODE_MERGE                                                                                           \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                                        \
    for (int64_t r = 0; r < B * Hkv * G; r++) {                                                               \
        const int64_t g = r % G, bh = r / G;                                                                  \
        float M = -INFINITY, L = 0.0f, *o = out + r * D;                                                       \
        for (int64_t c = 0; c < nch; c++) {                                                                   \
            const float mc = work[((bh * nch + c) * G + g) * (D + 2)];                                        \
            M = mc > M ? mc : M;                                                                               \
        }                                                                                                      \
        for (int64_t i = 0; i < D; i++) o[i] = 0.0f;                                                           \
        if (M == -INFINITY) continue;                                                                          \
        for (int64_t c = 0; c < nch; c++) {                                                                   \
            const float *wc = work + ((bh * nch + c) * G + g) * (D + 2);                                      \
            if (wc[0] == -INFINITY) continue;                                                                  \
            const float f = expf(wc[0] - M);                                                                   \
            L += f * wc[1];                                                                                    \
            for (int64_t i = 0; i < D; i++) o[i] += f * wc[2 + i];                                             \
        }                                                                                                      \
        for (int64_t i = 0; i < D; i++) o[i] /= L;                                                             \
    }

#define DECODE_BODY(LOAD, LD8) DECODE_BODY_WITH(LOAD, LD8, KV_SCORES_VEC, SCORES_SCALAR)
/* the raw-key decode loop, scores by SVEC(LD8) (AVX2) or SSCALAR(LOAD) (plain C) */
#define DECODE_BODY_WITH(LOAD, LD8, SVEC, SSCALAR)                                                             \
    const int64_t h2 = R / 2, nch = (N + KV_CHUNK - 1) / KV_CHUNK, total = B * Hkv * nch;                     \
    const int vec = KV_AVX2 && layout == 0 && h2 % 8 == 0 && (D - R) % 8 == 0;                               \
    const int vecv = KV_AVX2 && D % 32 == 0;                                                                  \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                                        \
    for (int64_t idx = 0; idx < total; idx++) {                                                               \
        const int64_t c = idx % nch, h = (idx / nch) % Hkv, b = idx / (nch * Hkv);                             \
        const int64_t j0 = c * KV_CHUNK, j1 = j0 + KV_CHUNK < N ? j0 + KV_CHUNK : N, nj = j1 - j0;            \
        const float *qh = q + (b * Hkv * G + h * G) * D;                                                      \
        const T *kr = k + b * kb + h * kh, *vr = v + b * vb + h * vh;                                         \
        const float *crow = cs + (Bc > 1 ? b : 0) * N * h2, *nrow = sn + (Bc > 1 ? b : 0) * N * h2;           \
        const float *mrow = mask ? mask + (Bm > 1 ? b : 0) * N : 0;                                           \
        float sc[KV_MAXG][KV_CHUNK], acc[KV_MAXG][256];                                                        \
        if (vec) { SVEC(LD8) } else { SSCALAR(LOAD) }                                                         \
        CHUNK_SOFTMAX(NO_WEIGHT, LOAD)                                                                         \
        if (vecv) { KV_VACC_VEC(LD8) } else {                                                                \
        for (int64_t j = 0; j < nj; j++) {                 /* each value row read once, for every query */     \
            const T *vj = vr + (j0 + j) * D;                                                                   \
            float vx[256];                                                                                     \
            for (int64_t i = 0; i < D; i++) vx[i] = LOAD(vj[i]);                                               \
            for (int64_t g = 0; g < G; g++) {                                                                  \
                const float p = sc[g][j];                                                                      \
                _Pragma("GCC ivdep")                                                                           \
                for (int64_t i = 0; i < D; i++) acc[g][i] += p * vx[i];                                        \
            }                                                                                                  \
        } }                                                                                                    \
        for (int64_t g = 0; g < G; g++) memcpy(wk + g * (D + 2) + 2, acc[g], D * sizeof(float));               \
    }                                                                                                          \
    DECODE_MERGE

#if KV_AVX2
#define KV_SCORES_VEC(LD8) BY_G(SCORES_AVX2, LD8)
#define KV_VACC_VEC(LD8) BY_G(VACC_AVX2, LD8)
#define KV_EXP_VEC                                                                                             \
    for (; j + 8 <= nj; j += 8)                                                                                \
        _mm256_storeu_ps(sc[g] + j, exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc[g] + j), _mm256_set1_ps(m))));
#else
#define KV_SCORES_VEC(LD8)
#define KV_VACC_VEC(LD8)
#define KV_EXP_VEC
#endif

#define DECODE_ARGS const float *q, const void *kp, const void *vp, const float *cs, const float *sn,              \
                    const float *mask, float *out, float *work, int64_t B, int64_t Hkv, int64_t G, int64_t N,      \
                    int64_t D, int64_t R, int64_t Bc, int64_t Bm, int64_t kb, int64_t kh, int64_t vb, int64_t vh,  \
                    float scale, int layout, int nthreads
void kvpos_decode_raw_f32(DECODE_ARGS) { typedef float T; const T *k = kp, *v = vp; DECODE_BODY(IDENT, ld8_f32) }
void kvpos_decode_raw_bf16(DECODE_ARGS) { typedef uint16_t T; const T *k = kp, *v = vp; DECODE_BODY(bf16_load, ld8_bf16) }

/* Decode attention over RAW keys under read-time position maps (kvpos.posmap): query head h*G+g rotates each key
   with its own table (per-head position scales, Ms-PoE) and scores it with the query variant of the key's segment
   (per-(head, segment) offsets, PINE). q float32 [B, Hq, V, D]: V rotated variants of each query head; cs, sn float32
   [Rt, Bc, N, R/2]: Rt rotation tables (cos/sin of each slot's mapped position, times the attention scaling), or,
   with fpos int64 [Bc, N] (slot positions in [0, F * (NT - F)), F = 2^FB), factored tables [Rt, NT, R/2] whose rows
   0..F-1 hold the angles of t mod F (unscaled) and rows F + m those of F m (times the scaling): the key turns by the
   first, the query back by the second, s R(-hi) q . R(lo) k = q . s R(hi + lo) k (small tables that stay in cache,
   for per-head scales p -> p / r);
   hrow int64 [Hq]: the table of each query head; seg int32 [Bs, N] (Bs in {1, B}) or NULL: the query variant each
   key is scored with (NULL: variant 0; out of range: variant 0 and a return value of 1); mask float32 additive
   [Bm, Hm, N] or NULL, Hm in {1, Hq}: one row for every head or one per query head (a per-head window). Other
   arguments as kvpos_decode_raw_*. A group whose G heads share one table
   rotates each key once, as the plain kernel does; otherwise each key is rotated once per head, in registers. */
/* the additive mask of query head h*G+g at key j: one row for all heads (Hm = 1) or one per query head (Hm = Hq) */
#define HEAD_ADD(g) (mhd ? mhd[(Hm > 1 ? h * G + (g) : 0) * N + j] : 0.0f)
#define HEADS_PRE                                                                                              \
        int64_t sj = srow ? srow[j] : 0;                                                                       \
        if (sj < 0 || sj >= V) { sj = 0; _Pragma("omp atomic") bad |= 1; }    /* reported, never read */      \
        int64_t tj = fpos ? fpos[bc * N + j] : 0;                                                              \
        if (fpos && (tj < 0 || (tj >> FB) >= NT - FR)) { tj = 0; _Pragma("omp atomic") bad |= 2; }            \
        if (sj != qsj) {                     /* the variant rows, kept along a run of keys of one segment */  \
            for (int64_t g = 0; g < G; g++) qvs[g] = q + ((b * Hkv * G + h * G + g) * V + sj) * D;           \
            qsj = sj;                                                                                          \
        }                                                                                                      \
        const float *qv[KV_MAXG], *cg[KV_MAXG], *ng[KV_MAXG];                                                  \
        if (!fpos && shared) {               /* one table for the group: one row pointer, as the plain kernel */\
            cg[0] = cs + ((hrow[h * G] * Bc + bc) * N + j) * h2;                                               \
            ng[0] = sn + ((hrow[h * G] * Bc + bc) * N + j) * h2;                                               \
        }                                                                                                      \
        for (int64_t g = 0; g < G; g++) {                                                                      \
            qv[g] = qvs[g];                                                                                    \
            if (!fpos) {                                                                                       \
                if (shared) continue;                                                                          \
                cg[g] = cs + ((hrow[h * G + g] * Bc + bc) * N + j) * h2;                                       \
                ng[g] = sn + ((hrow[h * G + g] * Bc + bc) * N + j) * h2;                                       \
                continue;                                                                                      \
            }                                                                                                  \
            /* factored: the key turns by row t mod F, the query back by row F + t / F (kept while the        \
               (t / F, variant) pair repeats, as it does along contiguous positions) */                       \
            const int64_t base = hrow[h * G + g] * NT, key = (tj >> FB) * V + sj;                             \
            cg[g] = cs + (base + (tj & (FR - 1))) * h2; ng[g] = sn + (base + (tj & (FR - 1))) * h2;           \
            if (key != qkey[g]) {                                                                              \
                const float *ch = cs + (base + FR + (tj >> FB)) * h2, *nh = sn + (base + FR + (tj >> FB)) * h2;\
                for (int64_t i = 0; i < h2; i++) {                                                             \
                    const int64_t ia = layout == 0 ? i : 2 * i, ie = layout == 0 ? i + h2 : 2 * i + 1;        \
                    qbuf[g][ia] = qvs[g][ia] * ch[i] + qvs[g][ie] * nh[i];                                     \
                    qbuf[g][ie] = qvs[g][ie] * ch[i] - qvs[g][ia] * nh[i];                                     \
                }                                                                                              \
                for (int64_t i = R; i < D; i++) qbuf[g][i] = qvs[g][i];                                        \
                qkey[g] = key;                                                                                 \
            }                                                                                                  \
            qv[g] = qbuf[g];                                                                                   \
        }
#define HEADS_SCORES_SCALAR(LOAD)                                                                              \
    for (int64_t j = j0; j < j1; j++) {                                                                       \
        HEADS_PRE                                                                                              \
        const T *kj = kr + j * D;                                                                              \
        float kf[256], kx[256];                                                                                \
        for (int64_t i = 0; i < D; i++) kf[i] = LOAD(kj[i]);                                                   \
        for (int64_t i = R; i < D; i++) kx[i] = kf[i];                                                         \
        for (int64_t g = 0; g < G; g++) {                                                                      \
            const float *cx = !fpos && shared ? cg[0] : cg[g], *nx = !fpos && shared ? ng[0] : ng[g];          \
            for (int64_t i = 0; i < h2; i++) {                                                                 \
                const int64_t ia = layout == 0 ? i : 2 * i, ie = layout == 0 ? i + h2 : 2 * i + 1;            \
                kx[ia] = kf[ia] * cx[i] - kf[ie] * nx[i];                                                      \
                kx[ie] = kf[ie] * cx[i] + kf[ia] * nx[i];                                                      \
            }                                                                                                  \
            float dot = 0.0f;                                                                                  \
            for (int64_t i = 0; i < D; i++) dot += qv[g][i] * kx[i];                                           \
            sc[g][j - j0] = dot * scale + HEAD_ADD(g);                                                         \
        }                                                                                                      \
    }
#if KV_AVX2
/* one table for the whole group and no factoring (PINE's offsets): the plain kernel's loop, the query variant of
   each key's segment kept while the segment repeats */
#define HEADS_ONE_TABLE_AVX2(LD8, GC)                                                                          \
    for (int64_t j = j0; j < j1; j++) {                                                                       \
        int64_t sj = srow ? srow[j] : 0;                                                                       \
        if (sj < 0 || sj >= V) { sj = 0; _Pragma("omp atomic") bad |= 1; }    /* reported, never read */      \
        if (sj != qsj) {                                                                                       \
            for (int64_t g = 0; g < (GC); g++) qvs[g] = q + ((b * Hkv * G + h * G + g) * V + sj) * D;        \
            qsj = sj;                                                                                          \
        }                                                                                                      \
        const T *kj = kr + j * D;                                                                              \
        const float *cj = ctab + j * h2, *nj = ntab + j * h2;                                                  \
        __m256 acc[KV_MAXG];                                                                                   \
        for (int64_t g = 0; g < (GC); g++) acc[g] = _mm256_setzero_ps();                                       \
        for (int64_t i = 0; i < h2; i += 8) {                                                                  \
            const __m256 a = LD8(kj + i), e = LD8(kj + i + h2);                                                \
            const __m256 c = _mm256_loadu_ps(cj + i), n = _mm256_loadu_ps(nj + i);                             \
            const __m256 ra = _mm256_fmsub_ps(a, c, _mm256_mul_ps(e, n));                                      \
            const __m256 rb = _mm256_fmadd_ps(e, c, _mm256_mul_ps(a, n));                                      \
            for (int64_t g = 0; g < (GC); g++) {                                                               \
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qvs[g] + i), ra, acc[g]);                             \
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qvs[g] + i + h2), rb, acc[g]);                        \
            }                                                                                                  \
        }                                                                                                      \
        for (int64_t i = R; i < D; i += 8) {                                                                   \
            const __m256 x = LD8(kj + i);                                                                      \
            for (int64_t g = 0; g < (GC); g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qvs[g] + i), x, acc[g]);\
        }                                                                                                      \
        for (int64_t g = 0; g < (GC); g++) sc[g][j - j0] = hsum8(acc[g]) * scale + HEAD_ADD(g);                \
    }
/* factored tables and one query variant (Ms-PoE's per-head scales): per key, each head turns it by its table's row
   t mod F; the queries turned back by row F + t / F once per run of F positions */
#define HEADS_FACTORED_AVX2(LD8, GC)                                                                           \
    for (int64_t j = j0; j < j1; j++) {                                                                       \
        int64_t tj = fpos[bc * N + j];                                                                         \
        if (tj < 0 || (tj >> FB) >= NT - FR) { tj = 0; _Pragma("omp atomic") bad |= 2; }                      \
        const int64_t hi = tj >> FB, lo = (tj & (FR - 1)) * h2;                                                \
        if (hi != qhi) {                                                                                       \
            for (int64_t g = 0; g < (GC); g++) {                                                               \
                const float *q0 = q + (b * Hkv * G + h * G + g) * V * D;                                       \
                const float *ch = ftab[g] + (FR + hi) * h2, *nh = fsin[g] + (FR + hi) * h2;                    \
                for (int64_t i = 0; i < h2; i++) {                                                             \
                    qbuf[g][i] = q0[i] * ch[i] + q0[i + h2] * nh[i];                                           \
                    qbuf[g][i + h2] = q0[i + h2] * ch[i] - q0[i] * nh[i];                                      \
                }                                                                                              \
                for (int64_t i = R; i < D; i++) qbuf[g][i] = q0[i];                                            \
            }                                                                                                  \
            qhi = hi;                                                                                          \
        }                                                                                                      \
        const T *kj = kr + j * D;                                                                              \
        __m256 acc[KV_MAXG];                                                                                   \
        for (int64_t g = 0; g < (GC); g++) acc[g] = _mm256_setzero_ps();                                       \
        for (int64_t i = 0; i < h2; i += 8) {                                                                  \
            const __m256 a = LD8(kj + i), e = LD8(kj + i + h2);                                                \
            for (int64_t g = 0; g < (GC); g++) {                                                               \
                const __m256 c = _mm256_loadu_ps(ftab[g] + lo + i), n = _mm256_loadu_ps(fsin[g] + lo + i);     \
                const __m256 ra = _mm256_fmsub_ps(a, c, _mm256_mul_ps(e, n));                                  \
                const __m256 rb = _mm256_fmadd_ps(e, c, _mm256_mul_ps(a, n));                                  \
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qbuf[g] + i), ra, acc[g]);                            \
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qbuf[g] + i + h2), rb, acc[g]);                       \
            }                                                                                                  \
        }                                                                                                      \
        for (int64_t i = R; i < D; i += 8) {                                                                   \
            const __m256 x = LD8(kj + i);                                                                      \
            for (int64_t g = 0; g < (GC); g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qbuf[g] + i), x, acc[g]);\
        }                                                                                                      \
        for (int64_t g = 0; g < (GC); g++) sc[g][j - j0] = hsum8(acc[g]) * scale + HEAD_ADD(g);                \
    }
#define HEADS_SCORES_AVX2(LD8, GC)                                                                             \
    if (!fpos && shared) {                                                                                     \
        const float *ctab = cs + (hrow[h * G] * Bc + bc) * N * h2, *ntab = sn + (hrow[h * G] * Bc + bc) * N * h2;\
        HEADS_ONE_TABLE_AVX2(LD8, GC)                                                                          \
    } else if (fpos && !srow) {                                                                                \
        const float *ftab[KV_MAXG], *fsin[KV_MAXG];                                                            \
        for (int64_t g = 0; g < (GC); g++) {                                                                   \
            ftab[g] = cs + hrow[h * G + g] * NT * h2; fsin[g] = sn + hrow[h * G + g] * NT * h2;                \
        }                                                                                                      \
        int64_t qhi = -1;                                                                                      \
        HEADS_FACTORED_AVX2(LD8, GC)                                                                           \
    } else                                                                                                     \
    for (int64_t j = j0; j < j1; j++) {                                                                       \
        HEADS_PRE                                                                                              \
        const T *kj = kr + j * D;                                                                              \
        __m256 acc[KV_MAXG];                                                                                   \
        for (int64_t g = 0; g < (GC); g++) acc[g] = _mm256_setzero_ps();                                       \
        for (int64_t i = 0; i < h2; i += 8) {                                                                  \
            const __m256 a = LD8(kj + i), e = LD8(kj + i + h2);                                                \
            if (shared) {                                                                                       \
                const __m256 c = _mm256_loadu_ps(cg[0] + i), n = _mm256_loadu_ps(ng[0] + i);                   \
                const __m256 ra = _mm256_fmsub_ps(a, c, _mm256_mul_ps(e, n));                                  \
                const __m256 rb = _mm256_fmadd_ps(e, c, _mm256_mul_ps(a, n));                                  \
                for (int64_t g = 0; g < (GC); g++) {                                                           \
                    acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qv[g] + i), ra, acc[g]);                          \
                    acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qv[g] + i + h2), rb, acc[g]);                     \
                }                                                                                              \
            } else {                                                                                           \
                for (int64_t g = 0; g < (GC); g++) {                                                           \
                    const __m256 c = _mm256_loadu_ps(cg[g] + i), n = _mm256_loadu_ps(ng[g] + i);               \
                    const __m256 ra = _mm256_fmsub_ps(a, c, _mm256_mul_ps(e, n));                              \
                    const __m256 rb = _mm256_fmadd_ps(e, c, _mm256_mul_ps(a, n));                              \
                    acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qv[g] + i), ra, acc[g]);                          \
                    acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qv[g] + i + h2), rb, acc[g]);                     \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int64_t i = R; i < D; i += 8) {                                                                   \
            const __m256 x = LD8(kj + i);                                                                      \
            for (int64_t g = 0; g < (GC); g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qv[g] + i), x, acc[g]);\
        }                                                                                                      \
        for (int64_t g = 0; g < (GC); g++) sc[g][j - j0] = hsum8(acc[g]) * scale + HEAD_ADD(g);                \
    }
#define HEADS_SCORES_VEC(LD8) BY_G(HEADS_SCORES_AVX2, LD8)
#else
#define HEADS_SCORES_VEC(LD8)
#endif

/* the per-work-item values the heads scoring reads: the batch row of the tables and segments, whether the G heads
   of kv head h share one table */
#define HEADS_SETUP                                                                                            \
        const int64_t bc = Bc > 1 ? b : 0;                                                                     \
        const int32_t *srow = seg ? seg + (Bs > 1 ? b : 0) * N : 0;                                            \
        const float *mhd = mask ? mask + (Bm > 1 ? b : 0) * Hm * N : 0;    /* [Hm in {1, Hq}, N] of row b */ \
        int shared = 1;                                                                                        \
        float qbuf[KV_MAXG][256];                                                                              \
        const float *qvs[KV_MAXG];                                                                             \
        int64_t qkey[KV_MAXG], qsj = -1;                                                                       \
        const int64_t FR = (int64_t)1 << FB;          /* factored tables: rows of t mod FR, then of FR m */   \
        for (int64_t g = 0; g < G; g++) qkey[g] = -1;                                                          \
        for (int64_t g = 1; g < G; g++) shared &= hrow[h * G + g] == hrow[h * G];
#define HEADS_VEC(LD8) { HEADS_SETUP HEADS_SCORES_VEC(LD8) }
#define HEADS_SCALAR(LOAD) { HEADS_SETUP HEADS_SCORES_SCALAR(LOAD) }

#define DECODE_HEADS_ARGS const float *q, const void *kp, const void *vp, const float *cs, const float *sn,        \
                    const int64_t *hrow, const int32_t *seg, const int64_t *fpos, int64_t NT, int64_t FB,           \
                    const float *mask,                                                                               \
                    float *out, float *work, int64_t B,                                                              \
                    int64_t Hkv, int64_t G, int64_t V, int64_t N, int64_t D, int64_t R, int64_t Bc, int64_t Bs,      \
                    int64_t Bm, int64_t Hm, int64_t kb, int64_t kh, int64_t vb, int64_t vh, float scale, int layout, \
                    int nthreads
/* returns 0, or bit 1 when a segment index was outside [0, V), bit 2 when a factored position was outside its tables
   (those keys were scored with variant 0 / position 0: the caller discards out) */
int kvpos_decode_heads_f32(DECODE_HEADS_ARGS) {
    typedef float T; const T *k = kp, *v = vp; int bad = 0;
    DECODE_BODY_WITH(IDENT, ld8_f32, HEADS_VEC, HEADS_SCALAR) return bad; }
int kvpos_decode_heads_bf16(DECODE_HEADS_ARGS) {
    typedef uint16_t T; const T *k = kp, *v = vp; int bad = 0;
    DECODE_BODY_WITH(bf16_load, ld8_bf16, HEADS_VEC, HEADS_SCALAR) return bad; }

/* Decode attention over int8 keys and values (storage="int8"): like kvpos_decode_raw_*, with each key dequantized in
   registers before its rotation: sealed slots j < Q are codes kc[j] * their group's scale row ks[rows[j]], slots
   j >= Q are the unquantized tail kt[j - Q]; values are codes vc[j] * vs[j] (the per-token scale is folded into
   the softmax weight), the tail's vt[j - Q] (kt and vt share strides). T is the scales' (and tail's) type. The tail gets its own chunks, so a chunk reads one kind. */
#if KV_AVX2
static inline __m256 ld8_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#define Q8_KEY8(LD8, o) (tail ? LD8(tj + (o)) : _mm256_mul_ps(ld8_i8(kj + (o)), LD8(sj + (o))))
#define Q8_PRE                                                                                                 \
        const int8_t *kj = kr + j * D;                                                                         \
        const T *sj = tail ? sr : sr + (int64_t)rows[j] * sD, *tj = tail ? tr + (j - Q) * D : tr;
#define Q8_SCORES_AVX2(LD8, GC) SCORES_AVX2_ANY(Q8_PRE, Q8_KEY8, LD8, GC)
#define Q8_VACC_AVX2(LD8, GC) VACC_AVX2_ANY(int8_t, ld8_i8, GC)
#define Q8_SCORES_VEC(LD8) BY_G(Q8_SCORES_AVX2, LD8)
#define Q8_VACC_VEC(LD8) BY_G(Q8_VACC_AVX2, LD8)
#else
#define Q8_SCORES_VEC(LD8)
#define Q8_VACC_VEC(LD8)
#endif

#define Q8_FILL(LOAD)                                                                                          \
        if (tail) { const T *tj = tr + (j - Q) * D; for (int64_t i = 0; i < D; i++) kf[i] = LOAD(tj[i]); }     \
        else {                                                                                                 \
            const int8_t *kj = kr + j * D; const T *sj = sr + (int64_t)rows[j] * sD;                           \
            for (int64_t i = 0; i < D; i++) kf[i] = (float)kj[i] * LOAD(sj[i]);                                \
        }
#define Q8_SCORES_SCALAR(LOAD) SCORES_SCALAR_ANY(Q8_FILL, LOAD)

#define DECODE_Q8_BODY(LOAD, LD8)                                                                              \
    const int64_t h2 = R / 2, ncq = (Q + KV_CHUNK - 1) / KV_CHUNK;                                           \
    const int64_t nch = ncq + (N - Q + KV_CHUNK - 1) / KV_CHUNK, total = B * Hkv * nch;                       \
    const int vec = KV_AVX2 && layout == 0 && h2 % 8 == 0 && (D - R) % 8 == 0;                               \
    const int vecv = KV_AVX2 && D % 32 == 0;                                                                  \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                                        \
    for (int64_t idx = 0; idx < total; idx++) {                                                               \
        const int64_t c = idx % nch, h = (idx / nch) % Hkv, b = idx / (nch * Hkv);                             \
        const int tail = c >= ncq;                                                                             \
        const int64_t j0 = tail ? Q + (c - ncq) * KV_CHUNK : c * KV_CHUNK;                                    \
        const int64_t lim = tail ? N : Q, j1 = j0 + KV_CHUNK < lim ? j0 + KV_CHUNK : lim, nj = j1 - j0;       \
        const float *qh = q + (b * Hkv * G + h * G) * D;                                                      \
        const int8_t *kr = kc + b * kb + h * kh, *vr = vc + b * vb + h * vh;                                  \
        const T *sr = ks + b * sb + h * sh, *tr = kt + b * tb + h * th, *vsr = vs + b * vsb + h * vsh;        \
        const T *vtr = vt + b * tb + h * th;                                                                   \
        const float *crow = cs + (Bc > 1 ? b : 0) * N * h2, *nrow = sn + (Bc > 1 ? b : 0) * N * h2;           \
        const float *mrow = mask ? mask + (Bm > 1 ? b : 0) * N : 0;                                           \
        float sc[KV_MAXG][KV_CHUNK], acc[KV_MAXG][256];                                                        \
        if (vec) { Q8_SCORES_VEC(LD8) } else { Q8_SCORES_SCALAR(LOAD) }                                        \
        CHUNK_SOFTMAX(Q8_VALUE_SCALES, LOAD)                                                                   \
        if (tail) {                                           /* the tail's values are unquantized (vt) */     \
            const int64_t jt = j0 - Q;                                                                         \
            { const int64_t j0 = jt; const T *vr = vtr;                                                        \
              if (vecv) { KV_VACC_VEC(LD8) } else {                                                            \
              for (int64_t j = 0; j < nj; j++) {                                                               \
                  const T *vj = vr + (j0 + j) * D;                                                             \
                  for (int64_t g = 0; g < G; g++) {                                                            \
                      const float p = sc[g][j];                                                                \
                      for (int64_t i = 0; i < D; i++) acc[g][i] += p * LOAD(vj[i]);                            \
                  }                                                                                            \
              } } }                                                                                            \
        } else if (vecv) { Q8_VACC_VEC(LD8) } else {                                                         \
        for (int64_t j = 0; j < nj; j++) {                                                                     \
            const int8_t *vj = vr + (j0 + j) * D;                                                              \
            for (int64_t g = 0; g < G; g++) {                                                                  \
                const float p = sc[g][j];                                                                      \
                for (int64_t i = 0; i < D; i++) acc[g][i] += p * (float)vj[i];                                 \
            }                                                                                                  \
        } }                                                                                                    \
        for (int64_t g = 0; g < G; g++) memcpy(wk + g * (D + 2) + 2, acc[g], D * sizeof(float));               \
    }                                                                                                          \
    DECODE_MERGE

#define DECODE_Q8_ARGS const float *q, const int8_t *kc, const int32_t *rows, const void *ksp, const void *ktp,      \
                       const int8_t *vc, const void *vsp, const void *vtp, const float *cs, const float *sn, const float *mask,       \
                       float *out, float *work, int64_t B, int64_t Hkv, int64_t G, int64_t N, int64_t Q, int64_t D,  \
                       int64_t R, int64_t Bc, int64_t Bm, int64_t kb, int64_t kh, int64_t sb, int64_t sh, int64_t sD, \
                       int64_t tb, int64_t th, int64_t vb, int64_t vh, int64_t vsb, int64_t vsh, float scale,        \
                       int layout, int nthreads
void kvpos_decode_q8_f32(DECODE_Q8_ARGS) {
    typedef float T; const T *ks = ksp, *kt = ktp, *vs = vsp, *vt = vtp; DECODE_Q8_BODY(IDENT, ld8_f32) }
void kvpos_decode_q8_bf16(DECODE_Q8_ARGS) {
    typedef uint16_t T; const T *ks = ksp, *kt = ktp, *vs = vsp, *vt = vtp; DECODE_Q8_BODY(bf16_load, ld8_bf16) }


/* PINE's importance of each document to one query row, WITHOUT RoPE (kvpos.posmap.segment_importance before its
   division by the document sizes): for query head h*G+g, the softmax of scale * q.k + mask over the slots that
   belong to a document and are not masked, summed per document. q float32 [B, Hq, D] (unrotated queries); k T*
   raw keys [B, Hkv, *, D] as kvpos_decode_raw_* (strides kb, kh); doc int32 [Bs, N] (Bs in {1, B}): the document
   of each slot in [0, n), -1 for the others (any other value: the slot is skipped and bit 1 returned); mask float32
   additive [Bm, Hm, N] or NULL (Bm in {1, B}, Hm in {1, Hq}); out float32 [B, Hq, n] (a row with no visible
   document slot: zeros); work float32 [B * Hkv * nch * G * (n + 1)]. Work item = (row, kv head, chunk of KV_CHUNK
   slots) as in the decode kernel: the chunk's max and per-document sums of exp(score - max) per query, merged
   afterwards (split-K). AVX2 path: the dot products and exp for D a multiple of 8; otherwise plain C. */
#define IMP_SKIP(dj) ((dj) < 0 || (dj) >= n)
/* x[0] + ... + x[len - 1] (eight lanes at a time where AVX2 is built) */
static inline float run_sum(const float *x, int64_t len) {
    float t = 0.0f;
    int64_t i = 0;
#if KV_AVX2
    __m256 a = _mm256_setzero_ps();
    for (; i + 8 <= len; i += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(x + i));
    t = hsum8(a);
#endif
    for (; i < len; i++) t += x[i];
    return t;
}
/* max(x[0], ..., x[len - 1]), -inf for len 0 (eight lanes at a time where AVX2 is built) */
static inline float run_max(const float *x, int64_t len) {
    float m = -INFINITY;
    int64_t i = 0;
#if KV_AVX2
    if (len >= 8) {
        __m256 a = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= len; i += 8) a = _mm256_max_ps(a, _mm256_loadu_ps(x + i));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        m = _mm_cvtss_f32(h);
    }
#endif
    for (; i < len; i++) m = x[i] > m ? x[i] : m;
    return m;
}
#define IMP_DOTS_SCALAR(LOAD)                                                                                      \
    for (int64_t j = j0; j < j1; j++) {                                                                       \
        const int32_t dj = drow[j];                                                                            \
        if (IMP_SKIP(dj)) {                                                                                    \
            if (dj >= n || dj < -1) { _Pragma("omp atomic") bad |= 1; }                                        \
            for (int64_t g = 0; g < G; g++) sc[g][j - j0] = -INFINITY;                                         \
            continue;                                                                                          \
        }                                                                                                      \
        const T *kj = kr + j * D;                                                                              \
        for (int64_t g = 0; g < G; g++) {                                                                      \
            const float *qg = qh + g * D;                                                                      \
            float dot = 0.0f;                                                                                  \
            for (int64_t i = 0; i < D; i++) dot += qg[i] * LOAD(kj[i]);                                        \
            sc[g][j - j0] = dot * scale + HEAD_ADD(g);                                                         \
        }                                                                                                      \
    }
#if KV_AVX2
#define IMP_DOTS_AVX2(LD8, GC)                                                                                 \
    for (int64_t j = j0; j < j1; j++) {                                                                       \
        const int32_t dj = drow[j];                                                                            \
        if (IMP_SKIP(dj)) {                                                                                    \
            if (dj >= n || dj < -1) { _Pragma("omp atomic") bad |= 1; }                                        \
            for (int64_t g = 0; g < (GC); g++) sc[g][j - j0] = -INFINITY;                                      \
            continue;                                                                                          \
        }                                                                                                      \
        const T *kj = kr + j * D;                                                                              \
        _Pragma("GCC unroll 8")              /* the key 16 slots ahead on its way to L1: no stall at each chunk */ \
        for (int64_t o = 0; o < D * (int64_t)sizeof(T); o += 64) _mm_prefetch((const char *)(kj + 16 * D) + o, _MM_HINT_T0);\
        __m256 acc[KV_MAXG], acc2[KV_MAXG];          /* two chains per query: half the FMA latency per key */  \
        for (int64_t g = 0; g < (GC); g++) acc[g] = acc2[g] = _mm256_setzero_ps();                             \
        int64_t i = 0;                                                                                         \
        for (; i + 16 <= D; i += 16) {                                                                         \
            const __m256 x = LD8(kj + i), y = LD8(kj + i + 8);                                                 \
            for (int64_t g = 0; g < (GC); g++) {                                                               \
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + i), x, acc[g]);                          \
                acc2[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + i + 8), y, acc2[g]);                    \
            }                                                                                                  \
        }                                                                                                      \
        for (; i < D; i += 8) {                                                                                \
            const __m256 x = LD8(kj + i);                                                                      \
            for (int64_t g = 0; g < (GC); g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + i), x, acc[g]);\
        }                                                                                                      \
        for (int64_t g = 0; g < (GC); g++) sc[g][j - j0] = hsum8(_mm256_add_ps(acc[g], acc2[g])) * scale + HEAD_ADD(g);\
    }
#define IMP_DOTS_VEC(LD8) BY_G(IMP_DOTS_AVX2, LD8)
#else
#define IMP_DOTS_VEC(LD8)
#endif

#define IMPORTANCE_BODY(LOAD, LD8)                                                                             \
    const int64_t nch = (N + KV_CHUNK - 1) / KV_CHUNK, total = B * Hkv * nch, W = n + 1;                      \
    const int vec = KV_AVX2 && D % 8 == 0;                                                                    \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                                        \
    for (int64_t idx = 0; idx < total; idx++) {                                                               \
        const int64_t c = idx % nch, h = (idx / nch) % Hkv, b = idx / (nch * Hkv);                             \
        const int64_t j0 = c * KV_CHUNK, j1 = j0 + KV_CHUNK < N ? j0 + KV_CHUNK : N, nj = j1 - j0;            \
        const float *qh = q + (b * Hkv * G + h * G) * D;                                                      \
        const T *kr = k + b * kb + h * kh;                                                                     \
        const int32_t *drow = doc + (Bs > 1 ? b : 0) * N;                                                      \
        const float *mhd = mask ? mask + (Bm > 1 ? b : 0) * Hm * N : 0;                                        \
        float sc[KV_MAXG][KV_CHUNK];                                                                           \
        if (vec) { IMP_DOTS_VEC(LD8) } else { IMP_DOTS_SCALAR(LOAD) }                                               \
        float *wk = work + idx * G * W;                                                                        \
        int64_t ra[KV_CHUNK], re[KV_CHUNK], nr = 0;  /* the chunk's runs of slots of one document, found once */\
        int32_t rd[KV_CHUNK];                                                                                  \
        for (int64_t j = 0; j < nj;) {                                                                         \
            const int32_t dj = drow[j0 + j];                                                                   \
            int64_t e = j + 1;                                                                                 \
            while (e < nj && drow[j0 + e] == dj) e++;                                                          \
            if (!IMP_SKIP(dj)) { ra[nr] = j; re[nr] = e; rd[nr++] = dj; }                                      \
            j = e;                                                                                             \
        }                                                                                                      \
        for (int64_t g = 0; g < G; g++) {                                                                      \
            float *sums = wk + g * W + 1;                                                                      \
            const float m = run_max(sc[g], nj);                                                                \
            wk[g * W] = m;                                                                                     \
            for (int64_t d = 0; d < n; d++) sums[d] = 0.0f;                                                    \
            if (m == -INFINITY) continue;                                                                      \
            int64_t j = 0;                                                                                     \
            KV_EXP_VEC                                                                                         \
            for (; j < nj; j++) sc[g][j] = expf(sc[g][j] - m);                                                 \
            for (int64_t i = 0; i < nr; i++) sums[rd[i]] += run_sum(sc[g] + ra[i], re[i] - ra[i]);             \
        }                                                                                                      \
    }                                                                                                          \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                                        \
    for (int64_t r = 0; r < B * Hkv * G; r++) {                                                               \
        const int64_t g = r % G, bh = r / G;                                                                  \
        float M = -INFINITY, L = 0.0f, *o = out + r * n;                                                       \
        for (int64_t c = 0; c < nch; c++) {                                                                   \
            const float mc = work[((bh * nch + c) * G + g) * W];                                              \
            M = mc > M ? mc : M;                                                                               \
        }                                                                                                      \
        for (int64_t d = 0; d < n; d++) o[d] = 0.0f;                                                           \
        if (M == -INFINITY) continue;                                                                          \
        for (int64_t c = 0; c < nch; c++) {                                                                   \
            const float *wc = work + ((bh * nch + c) * G + g) * W;                                            \
            if (wc[0] == -INFINITY) continue;                                                                  \
            const float f = expf(wc[0] - M);                                                                   \
            for (int64_t d = 0; d < n; d++) o[d] += f * wc[1 + d];                                             \
        }                                                                                                      \
        for (int64_t d = 0; d < n; d++) L += o[d];                                                             \
        for (int64_t d = 0; d < n; d++) o[d] /= L;                                                             \
    }

#define IMPORTANCE_ARGS const float *q, const void *kp, const int32_t *doc, const float *mask, float *out,            \
                        float *work, int64_t B, int64_t Hkv, int64_t G, int64_t N, int64_t D, int64_t n, int64_t Bs, \
                        int64_t Bm, int64_t Hm, int64_t kb, int64_t kh, float scale, int nthreads
/* returns 0, or 1 when a document index was outside [-1, n) (those slots were skipped: the caller discards out) */
int kvpos_importance_f32(IMPORTANCE_ARGS) {
    typedef float T; const T *k = kp; int bad = 0; IMPORTANCE_BODY(IDENT, ld8_f32) return bad; }
int kvpos_importance_bf16(IMPORTANCE_ARGS) {
    typedef uint16_t T; const T *k = kp; int bad = 0; IMPORTANCE_BODY(bf16_load, ld8_bf16) return bad; }

/* PINE-lite's decode step in one call (integrations/pine.py), one query row per batch row: the query unrotated
   (angles qpos * inv_freq in double, divided by the attention scaling ascale), each document's importance by
   kvpos_importance_* (mass / size), the documents sorted by importance (descending, ties by index), the most
   important ending at end[b], the next right before it (shift = new start - start, written to shift [B, Hq, n]
   int64), one query variant per document (the query turned back by its shift, in registers of double angles), and
   kvpos_decode_heads_* over the slot tables cs / sn [Bc, N, R/2] (scaled, as the plain kernel's) with each key
   scored by its document's variant. imask float32 additive [Bm, N] or NULL: what the query sees (the importance
   too); window > 0: a sliding window over the positions keys are READ at (qpos - (kpos + its document's shift) <
   window, kpos int64 [Bc, N]), one mask row per query head. doc int32 [Bs, N] in [-1, n); start, size int64 [B, n];
   end, qpos int64 [B]. Returns 0, or bit 1 (a document index outside [-1, n)), bit 4 (out of memory): the caller
   discards out. Float64 reference: kvpos.reference.segment_mass_ref + kvpos.posmap.pine_shifts +
   kvpos.reference.decode_heads_ref. */
typedef struct { float imp; int64_t d; } pine_rank;
static int pine_rank_cmp(const void *a, const void *b) {
    const pine_rank *x = a, *y = b;
    if (x->imp != y->imp) return x->imp > y->imp ? -1 : 1;
    return x->d < y->d ? -1 : (x->d > y->d);
}
/* cos / sin [R/2] of the angles t * inv_freq (t an integer position or distance); angle_f32: the angle computed in
   float32 (the spec's angle dtype, as transformers computes it) and its cos / sin in float32, else all in double */
static void pine_angles(double t, const double *inv_freq, int64_t h2, int angle_f32, float *c, float *s) {
    for (int64_t i = 0; i < h2; i++) {
        if (angle_f32) {
            const float a = (float)t * (float)inv_freq[i];
            c[i] = cosf(a); s[i] = sinf(a);
        } else {
            const double a = t * inv_freq[i];
            c[i] = (float)cos(a); s[i] = (float)sin(a);
        }
    }
}
/* x (D floats) turned BACK by the angles of (c, s) into y (the conjugate rotation), rotary dims times `mul`,
   pass-through dims copied */
static void pine_turn(const float *x, float *y, const float *c, const float *s, int64_t D, int64_t R, int layout,
                      float mul) {
    const int64_t h2 = R / 2;
    for (int64_t i = 0; i < h2; i++) {
        const int64_t ia = layout == 0 ? i : 2 * i, ie = layout == 0 ? i + h2 : 2 * i + 1;
        y[ia] = (x[ia] * c[i] + x[ie] * s[i]) * mul;
        y[ie] = (x[ie] * c[i] - x[ia] * s[i]) * mul;
    }
    for (int64_t i = R; i < D; i++) y[i] = x[i];
}
#define PINE_ARGS const float *q, const void *kp, const void *vp, const float *cs, const float *sn,                \
                  const double *inv_freq, const int32_t *doc, const int64_t *start, const int64_t *size,            \
                  const int64_t *end, const int64_t *kpos, const int64_t *qpos, const float *imask, float *out,     \
                  int64_t *shift, int64_t B, int64_t Hkv, int64_t G, int64_t N, int64_t D, int64_t R, int64_t n,    \
                  int64_t Bc, int64_t Bs, int64_t Bm, int64_t kb, int64_t kh, int64_t vb, int64_t vh,              \
                  int64_t window, float scale, float ascale, int layout, int angle_f32, int nthreads
#define PINE_BODY(SUFFIX)                                                                                      \
    const int64_t Hq = Hkv * G, V = n + 1, nch = (N + KV_CHUNK - 1) / KV_CHUNK;                               \
    const int64_t wn = G * (n + 1 > D + 2 ? n + 1 : D + 2) * B * Hkv * nch;                                    \
    float *qr = malloc(B * Hq * D * sizeof(float)), *mass = malloc(B * Hq * n * sizeof(float));               \
    float *qv = malloc(B * Hq * V * D * sizeof(float)), *work = malloc(wn * sizeof(float));                   \
    float *mask = window > 0 ? malloc(B * Hq * N * sizeof(float)) : 0;                                         \
    int32_t *seg = malloc(Bs * N * sizeof(int32_t));                                                           \
    int64_t *zero = calloc(Hq, sizeof(int64_t));                                                               \
    pine_rank *rank = malloc(n * sizeof(pine_rank));                                                           \
    float *ang = malloc(2 * (n + 1) * (R / 2 + 1) * sizeof(float));  /* cos / sin per document (+ the query) */\
    int64_t *last = malloc(n * sizeof(int64_t));                      /* the shift each document's angles hold */\
    int bad = 0;                                                                                               \
    if (!qr || !mass || !qv || !work || (window > 0 && !mask) || !seg || !zero || !rank || !ang || !last) bad = 4;\
    if (!bad) {                                                                                                \
        const int64_t h2 = R / 2;                                                                              \
        float *qc = ang + 2 * n * h2, *qs = qc + h2;                                                           \
        for (int64_t r = 0; r < B * Hq; r++) {                                                                 \
            if (r % Hq == 0) pine_angles((double)qpos[r / Hq], inv_freq, h2, angle_f32, qc, qs);               \
            pine_turn(q + r * D, qr + r * D, qc, qs, D, R, layout, 1.0f / ascale);                             \
        }                                                                                                      \
        for (int64_t d = 0; d < n; d++) last[d] = INT64_MIN;                                                   \
        bad |= kvpos_importance_##SUFFIX(qr, kp, doc, imask, mass, work, B, Hkv, G, N, D, n, Bs, Bm, 1, kb, kh,\
                                         scale, nthreads);                                                     \
        for (int64_t r = 0; r < B * Hq; r++) {                                                                 \
            const int64_t b = r / Hq;                                                                          \
            for (int64_t d = 0; d < n; d++) rank[d] = (pine_rank){mass[r * n + d] / (float)size[b * n + d], d};\
            qsort(rank, n, sizeof(pine_rank), pine_rank_cmp);                                                  \
            int64_t new_end = end[b];                                                                          \
            for (int64_t i = 0; i < n; i++) {                                                                  \
                const int64_t d = rank[i].d, ns = new_end - size[b * n + d];                                   \
                shift[r * n + d] = ns - start[b * n + d];                                                      \
                new_end = ns;                                                                                  \
            }                                                                                                  \
            memcpy(qv + r * V * D, q + r * D, D * sizeof(float));                                              \
            for (int64_t d = 0; d < n; d++) {                                                                  \
                float *c = ang + 2 * d * h2, *sv = c + h2;       /* kept while the document's shift repeats */ \
                if (shift[r * n + d] != last[d]) {                                                             \
                    pine_angles((double)shift[r * n + d], inv_freq, h2, angle_f32, c, sv);                     \
                    last[d] = shift[r * n + d];                                                                \
                }                                                                                              \
                pine_turn(q + r * D, qv + (r * V + d + 1) * D, c, sv, D, R, layout, 1.0f);                     \
            }                                                                                                  \
        }                                                                                                      \
        for (int64_t j = 0; j < Bs * N; j++) seg[j] = doc[j] >= 0 && doc[j] < n ? doc[j] + 1 : 0;             \
        if (window > 0)                                                                                        \
            for (int64_t r = 0; r < B * Hq; r++) {                                                             \
                const int64_t b = r / Hq;                                                                      \
                const int32_t *drow = doc + (Bs > 1 ? b : 0) * N;                                              \
                const int64_t *prow = kpos + (Bc > 1 ? b : 0) * N;                                             \
                for (int64_t j = 0; j < N; j++) {                                                              \
                    const int32_t d = drow[j];                                                                 \
                    const int64_t at = prow[j] + (d >= 0 && d < n ? shift[r * n + d] : 0);                     \
                    const float m = imask ? imask[(Bm > 1 ? b : 0) * N + j] : 0.0f;                            \
                    mask[r * N + j] = qpos[b] - at < window ? m : -INFINITY;                                   \
                }                                                                                              \
            }                                                                                                  \
        bad |= kvpos_decode_heads_##SUFFIX(qv, kp, vp, cs, sn, zero, seg, 0, 0, 0, window > 0 ? mask : imask, out,\
                                           work, B, Hkv, G, V, N, D, R, Bc, Bs, window > 0 ? B : Bm,           \
                                           window > 0 ? Hq : 1, kb, kh, vb, vh, scale, layout, nthreads);      \
    }                                                                                                          \
    free(qr); free(mass); free(qv); free(work); free(mask); free(seg); free(zero); free(rank); free(ang);      \
    free(last);                                                                                                \
    return bad;
int kvpos_pine_decode_f32(PINE_ARGS) { PINE_BODY(f32) }
int kvpos_pine_decode_bf16(PINE_ARGS) { PINE_BODY(bf16) }
