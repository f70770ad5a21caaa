"""Fused CPU kernels (C, OpenMP), built once with the system C compiler and loaded with ctypes: RoPE rotation,
decode attention over raw keys (each key rotated in registers while it is scored: rotate-on-read storage never
materialises rotated keys), int8 scoring and top-k for windowed retrieval.

Why: a RoPE rotation in torch eager is 4+ elementwise passes over the keys (results/bench_rotate.md); one fused
loop reads each raw key once and writes each rotated key once. The kernel is optional: without a C compiler (or on
CUDA tensors, fp16, odd strides) `kvpos.rope` uses the torch path, which computes the same numbers (float32 math,
one rounding to the key dtype). Set KVPOS_NO_KERNEL=1 to force the torch path.

The build lands in $KVPOS_CACHE (default ~/.cache/kvpos), keyed by a hash of the source, the compiler flags and the
CPU model, so a cache directory shared between different machines never serves a foreign binary.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

import torch

__all__ = ["rope_kernel_available", "kernel_status", "rope_apply_kernel", "decode_raw_kernel", "decode_q8_kernel", "score_int8_kernel",
           "topk_indices", "transpose_int8_blocks"]

_SRC = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_load(uint16_t v) { uint32_t u = ((uint32_t)v) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t bf16_store(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    const uint32_t rne = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;                   /* round to nearest even */
    const uint32_t nan = (u >> 16) | 0x40u;                                         /* quiet NaN stays NaN */
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rne);
}

/* L layers at once. xs[l], outs[l]: [B, H, S, D] with unit stride on D and stride D on S; the B and H strides of
   layer l are xsb[l], xsh[l] (outs: osb[l], osh[l]), in elements. cs, sn: float32 [Bc, S, R/2] contiguous, Bc in
   {1, B}, already multiplied by the scale. layout 0 = half (pair i = (i, i + R/2)), 1 = interleaved (pair i =
   (2i, 2i + 1)). Dims R..D-1 are copied. In place (outs[l] == xs[l]) is allowed: each pair is read before written. */
#define ROPE_BLOCK 32
#define ROPE_BODY(LOAD, STORE)                                                                                 \
    const int64_t h2 = R / 2;                                                                                  \
    const int64_t nblk = (S + ROPE_BLOCK - 1) / ROPE_BLOCK, total = B * nblk;                                 \
    /* work item = (batch row, block of ROPE_BLOCK tokens); inside it every layer and head, so the block's     \
       cos/sin (ROPE_BLOCK * R floats) stay in L1 instead of being streamed again for each (layer, head) */    \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                                        \
    for (int64_t idx = 0; idx < total; idx++) {                                                               \
        const int64_t blk = idx % nblk, b = idx / nblk;                                                       \
        const int64_t s0 = blk * ROPE_BLOCK, s1 = s0 + ROPE_BLOCK < S ? s0 + ROPE_BLOCK : S;                  \
        const float *crow = cs + (Bc > 1 ? b : 0) * S * h2, *nrow = sn + (Bc > 1 ? b : 0) * S * h2;           \
        for (int64_t l = 0; l < L; l++) for (int64_t hh = 0; hh < H; hh++) {                                   \
            const T *xrow = (const T *)xs[l] + b * xsb[l] + hh * xsh[l];                                      \
            T *orow = (T *)outs[l] + b * osb[l] + hh * osh[l];                                                \
            for (int64_t s = s0; s < s1; s++) {                                                                \
                const T *xv = xrow + s * D;                                                                    \
                T *ov = orow + s * D;                                                                          \
                const float *c = crow + s * h2, *n = nrow + s * h2;                                            \
                if (layout == 0) {                                                                             \
                    _Pragma("GCC ivdep")                                                                       \
                    for (int64_t i = 0; i < h2; i++) {                                                         \
                        const float a = LOAD(xv[i]), e = LOAD(xv[i + h2]);                                     \
                        ov[i] = STORE(a * c[i] - e * n[i]);                                                    \
                        ov[i + h2] = STORE(e * c[i] + a * n[i]);                                               \
                    }                                                                                          \
                } else {                                                                                       \
                    _Pragma("GCC ivdep")                                                                       \
                    for (int64_t i = 0; i < h2; i++) {                                                         \
                        const float a = LOAD(xv[2 * i]), e = LOAD(xv[2 * i + 1]);                              \
                        ov[2 * i] = STORE(a * c[i] - e * n[i]);                                                \
                        ov[2 * i + 1] = STORE(e * c[i] + a * n[i]);                                            \
                    }                                                                                          \
                }                                                                                              \
                for (int64_t i = R; i < D; i++) ov[i] = xv[i];                                                 \
            }                                                                                                  \
        }                                                                                                      \
    }

#define IDENT(v) (v)
#define ARGS const void *const *xs, void *const *outs, const float *cs, const float *sn, int64_t L, int64_t B,     \
             int64_t H, int64_t S, int64_t D, int64_t R, int64_t Bc, const int64_t *xsb, const int64_t *xsh,     \
             const int64_t *osb, const int64_t *osh, int layout, int nthreads
void kvpos_rope_f32(ARGS) { typedef float T; ROPE_BODY(IDENT, IDENT) }
void kvpos_rope_bf16(ARGS) { typedef uint16_t T; ROPE_BODY(bf16_load, bf16_store) }

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

#define DECODE_BODY(LOAD, LD8)                                                                                 \
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
        if (vec) { KV_SCORES_VEC(LD8) } else { SCORES_SCALAR(LOAD) }                                           \
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
"""

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None) or (None, why it could not be built)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        return None, "no C compiler (gcc/cc) on PATH"
    key = hashlib.sha256((_SRC + " ".join(_FLAGS) + _cpu_id() + platform.machine()).encode()).hexdigest()[:16]
    root = os.environ.get("KVPOS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvpos")
    os.makedirs(root, exist_ok=True)
    so = os.path.join(root, f"rope_{key}.so")
    if not os.path.exists(so):
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            src = os.path.join(tmp, "rope.c")
            with open(src, "w") as f:
                f.write(_SRC)
            out = os.path.join(tmp, "rope.so")
            res = subprocess.run([cc, *_FLAGS, src, "-o", out, "-lm"], capture_output=True, text=True)
            if res.returncode != 0:
                return None, f"{cc} failed: {res.stderr.strip()[:500]}"
            os.replace(out, so)  # atomic: concurrent builders leave one valid file
    lib = ctypes.CDLL(so)
    i64, vp, fp = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p
    for name in ("kvpos_rope_f32", "kvpos_rope_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [vp, vp, fp, fp] + [i64] * 7 + [vp] * 4 + [ctypes.c_int, ctypes.c_int]
        fn.restype = None
    lib.kvpos_score_int8.argtypes = [vp, vp, vp, vp] + [i64] * 5 + [ctypes.c_int]
    lib.kvpos_score_int8.restype = None
    lib.kvpos_topk.argtypes = [vp] + [i64] * 3 + [vp, vp, vp, ctypes.c_int]
    lib.kvpos_topk.restype = None
    for name in ("kvpos_decode_raw_f32", "kvpos_decode_raw_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [vp] * 8 + [i64] * 12 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        fn.restype = None
    for name in ("kvpos_decode_q8_f32", "kvpos_decode_q8_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [vp] * 13 + [i64] * 20 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        fn.restype = None
    return lib, None


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """Build/load the library once per process (a write-once memo; KVPOS_NO_KERNEL=1 disables it)."""
    if os.environ.get("KVPOS_NO_KERNEL"):
        return None, "disabled by KVPOS_NO_KERNEL"
    try:
        return _build()
    except Exception as e:  # noqa: BLE001 - any build/load failure means the torch path, reported by kernel_status
        return None, f"{type(e).__name__}: {e}"


def _get() -> ctypes.CDLL | None:
    return _load()[0]


def rope_kernel_available() -> bool:
    """True when the fused C kernel is built and loaded (see `kernel_status` otherwise)."""
    return _get() is not None


def kernel_status() -> str:
    """'built' or why the C kernels are not in use (the torch path computes the same numbers)."""
    lib, err = _load()
    return "built" if lib is not None else str(err)


def _eligible(xs: list[torch.Tensor], outs: list[torch.Tensor], cos: torch.Tensor, xst: list[tuple],
              ost: list[tuple], xp: list[int], op: list[int]) -> bool:
    """CPU fp32/bf16 tensors of one shape, unit stride on D and stride D on S; in place only with equal strides.
    Strides and pointers come precomputed (one call each per tensor: this runs on every re-positioning)."""
    shape, dtype = xs[0].shape, xs[0].dtype
    if len(shape) != 4 or dtype not in (torch.float32, torch.bfloat16) or cos.dtype != torch.float32:
        return False
    D = shape[3]
    for x, o, a, b, pa, pb in zip(xs, outs, xst, ost, xp, op):
        if (x.device.type != "cpu" or o.device.type != "cpu" or x.dtype != dtype or o.dtype != dtype
                or x.shape != shape or o.shape != shape or x.requires_grad
                or a[3] != 1 or b[3] != 1 or a[2] != D or b[2] != D or (pa == pb and a != b)):
            return False
    return True


def rope_apply_kernel(xs: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                      interleaved: bool, outs: list[torch.Tensor]) -> bool:
    """outs[l] = rotate(xs[l]) for every l, with scaled cos/sin [B|1, 1, S, R/2] (float32), in one call.

    All xs share shape [B, H, S, D] and dtype. Returns False (doing nothing) when the kernel cannot serve these
    tensors; the caller then uses the torch path.
    """
    if not xs:
        return True
    if torch.compiler.is_compiling():
        return False       # inside torch.compile: the torch path, which the compiler traces and fuses (ctypes it cannot)
    shape, dtype = xs[0].shape, xs[0].dtype
    xst, ost = [x.stride() for x in xs], [o.stride() for o in outs]
    xp, op = [x.data_ptr() for x in xs], [o.data_ptr() for o in outs]
    if len(outs) != len(xs) or not _eligible(xs, outs, cos, xst, ost, xp, op):
        return False
    lib = _get()
    if lib is None:
        return False
    B, H, S, D = shape
    cs = cos.reshape(cos.shape[0], S, rotary_dim // 2).contiguous()
    sn = sin.reshape(sin.shape[0], S, rotary_dim // 2).contiguous()
    if cs.shape[0] not in (1, B):
        return False
    L = len(xs)
    ptrs = (ctypes.c_void_p * L)
    ints = (ctypes.c_int64 * L)
    fn = lib.kvpos_rope_f32 if dtype == torch.float32 else lib.kvpos_rope_bf16
    fn(ptrs(*xp), ptrs(*op), cs.data_ptr(), sn.data_ptr(),
       L, B, H, S, D, rotary_dim, cs.shape[0],
       ints(*[a[0] for a in xst]), ints(*[a[1] for a in xst]),
       ints(*[b[0] for b in ost]), ints(*[b[1] for b in ost]),
       1 if interleaved else 0, max(1, torch.get_num_threads()))
    return True


def _decode_inputs(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                   shape: tuple[int, int, int, int], nch: int, rotary_dim: int) -> tuple | None:
    """What both decode kernels take besides the cache, for keys of `shape` (B, Hkv, N, D) in `nch` chunks: (library,
    q float32, cos, sin [B|1, N, R/2], additive mask [B|1, N] or None, output [B, Hq, D] float32, split-K work
    space, G), or None where they cannot serve."""
    B, Hkv, N, D = shape
    Hq = q.shape[1]
    if (q.dim() != 3 or q.shape[0] != B or q.shape[2] != D or Hq % Hkv or Hq // Hkv > 16 or D > 256 or N == 0
            or cos.dtype != torch.float32):
        return None
    h2 = rotary_dim // 2
    cs, sn = cos.reshape(-1, N, h2).contiguous(), sin.reshape(-1, N, h2).contiguous()
    m = None if mask is None else mask.reshape(-1, N).to(torch.float32).contiguous()
    if cs.shape[0] not in (1, B) or (m is not None and m.shape[0] not in (1, B)):
        return None
    lib = _get()
    if lib is None:
        return None
    G = Hq // Hkv
    work = torch.empty(B * Hkv * nch * G * (D + 2), dtype=torch.float32)
    return lib, q.to(torch.float32).contiguous(), cs, sn, m, torch.empty(q.shape, dtype=torch.float32), work, G


def decode_raw_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      mask: torch.Tensor | None, scale: float, rotary_dim: int, interleaved: bool
                      ) -> torch.Tensor | None:
    """Attention of one query token per row over raw keys rotated on the fly: [B, Hq, D] float32.

    q [B, Hq, D] (rotated, any float dtype); k, v [B, Hkv, N, D] (raw keys, values; fp32 or bf16, unit stride on D,
    stride D on slots); cos/sin [B|1, N, R/2] float32, already multiplied by the RoPE attention scaling; mask None or
    an additive float32 [B|1, N]. Hq must be a multiple of Hkv (query head h*G+g reads kv head h). Returns None when
    the kernel cannot serve these tensors (the caller then rotates into a buffer and runs SDPA: same numbers up to
    float rounding). Float64 reference: `kvpos.reference.decode_raw_ref`."""
    if torch.compiler.is_compiling():
        return None
    B, Hkv, N, D = k.shape
    if (k.device.type != "cpu" or k.dtype not in (torch.float32, torch.bfloat16) or v.dtype != k.dtype
            or v.shape != k.shape or k.stride(3) != 1 or k.stride(2) != D or v.stride(3) != 1 or v.stride(2) != D
            or k.requires_grad or v.requires_grad):
        return None
    prep = _decode_inputs(q, cos, sin, mask, tuple(k.shape), (N + 127) // 128, rotary_dim)
    if prep is None:
        return None
    lib, qc, cs, sn, m, out, work, G = prep
    fn = lib.kvpos_decode_raw_f32 if k.dtype == torch.float32 else lib.kvpos_decode_raw_bf16
    fn(qc.data_ptr(), k.data_ptr(), v.data_ptr(), cs.data_ptr(), sn.data_ptr(), 0 if m is None else m.data_ptr(),
       out.data_ptr(), work.data_ptr(), B, Hkv, G, N, D, rotary_dim, cs.shape[0], 1 if m is None else m.shape[0],
       k.stride(0), k.stride(1), v.stride(0), v.stride(1), float(scale), 1 if interleaved else 0,
       max(1, torch.get_num_threads()))
    return out


def decode_q8_kernel(q: torch.Tensor, codes: torch.Tensor, rows: torch.Tensor, ks: torch.Tensor, kt: torch.Tensor,
                     nq: int, vcodes: torch.Tensor, vs: torch.Tensor, vt: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, mask: torch.Tensor | None, scale: float, rotary_dim: int, interleaved: bool
                     ) -> torch.Tensor | None:
    """`decode_raw_kernel` over int8 storage (`kvpos.cache.QuantSlotLayer`): [B, Hq, D] float32.

    codes [B, Hkv, N, D] int8 (slots [0, nq) hold codes; row-stride D), rows [N] int32 (each sealed slot's scale
    row), ks [B, Hkv, R, D] scales, kt [B, Hkv, >= N - nq, D] the unquantized tail (slots nq..N-1), vcodes
    [B, Hkv, N, D] int8, vs [B, Hkv, N, 1] per-token value scales (slots [0, nq)), vt the tail's values (kt's
    shape and strides); ks / kt / vs / vt fp32 or bf16 (one dtype). Other arguments as decode_raw_kernel. None
    where the kernel cannot serve. Float64 reference: `kvpos.reference.decode_q8_ref`."""
    if torch.compiler.is_compiling():
        return None
    B, Hkv, N, D = codes.shape
    sd = ks.dtype
    contiguous_rows = all(t.stride(3) == 1 and t.stride(2) == D for t in (codes, ks, kt, vcodes, vt))
    if (codes.device.type != "cpu" or codes.dtype != torch.int8 or vcodes.dtype != torch.int8
            or sd not in (torch.float32, torch.bfloat16) or kt.dtype != sd or vs.dtype != sd or vt.dtype != sd
            or vt.shape != kt.shape or vt.stride() != kt.stride()
            or rows.dtype != torch.int32 or rows.dim() != 1 or rows.shape[0] != N or not rows.is_contiguous()
            or vcodes.shape != codes.shape or ks.shape[:2] != (B, Hkv) or ks.shape[3] != D
            or kt.shape[:2] != (B, Hkv) or kt.shape[3] != D or kt.shape[2] < N - nq or not 0 <= nq <= N
            or tuple(vs.shape) != (B, Hkv, N, 1) or vs.stride(2) != 1 or not contiguous_rows):
        return None
    prep = _decode_inputs(q, cos, sin, mask, tuple(codes.shape), (nq + 127) // 128 + (N - nq + 127) // 128,
                          rotary_dim)
    if prep is None:
        return None
    lib, qc, cs, sn, m, out, work, G = prep
    fn = lib.kvpos_decode_q8_f32 if sd == torch.float32 else lib.kvpos_decode_q8_bf16
    fn(qc.data_ptr(), codes.data_ptr(), rows.data_ptr(), ks.data_ptr(), kt.data_ptr(), vcodes.data_ptr(),
       vs.data_ptr(), vt.data_ptr(), cs.data_ptr(), sn.data_ptr(), 0 if m is None else m.data_ptr(), out.data_ptr(),
       work.data_ptr(), B, Hkv, G, N, nq, D, rotary_dim, cs.shape[0], 1 if m is None else m.shape[0],
       codes.stride(0), codes.stride(1), ks.stride(0), ks.stride(1), ks.stride(2), kt.stride(0), kt.stride(1),
       vcodes.stride(0), vcodes.stride(1), vs.stride(0), vs.stride(1), float(scale), 1 if interleaved else 0,
       max(1, torch.get_num_threads()))
    return out


def transpose_int8_blocks(k: torch.Tensor) -> torch.Tensor:
    """int8 keys [H, F, D] -> [H, ceil(F/16), D, 16] (zero padded): the layout `score_int8_kernel` reads."""
    H, F, D = k.shape
    nb = (F + 15) // 16
    pad = torch.zeros(H, nb * 16, D, dtype=torch.int8)
    pad[:, :F] = k
    return pad.view(H, nb, 16, D).transpose(2, 3).contiguous()


def score_int8_kernel(q: torch.Tensor, kt: torch.Tensor, scale: torch.Tensor, F: int) -> torch.Tensor | None:
    """out [H, F] = scale * max over g of q[h, g] . k[h, j] for q float32 [H, G, D] (G <= 16), kt int8 from
    transpose_int8_blocks, scale float32 [H, F] contiguous. Returns None when the kernel cannot serve the tensors
    (the caller computes the same with torch)."""
    if not (q.device.type == "cpu" and kt.dtype == torch.int8 and kt.dim() == 4 and kt.is_contiguous()
            and kt.shape[3] == 16 and scale.dtype == torch.float32 and scale.is_contiguous() and q.shape[1] <= 16):
        return None
    lib = _get()
    if lib is None:
        return None
    H, nb, D, _ = kt.shape
    qc = q.float().contiguous()
    out = torch.empty(H, nb * 16, dtype=torch.float32)
    lib.kvpos_score_int8(qc.data_ptr(), kt.data_ptr(), scale.data_ptr(), out.data_ptr(), H, qc.shape[1], F, D, nb,
                         max(1, torch.get_num_threads()))
    return out[:, :F]


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [H, k] (unordered) of the k largest scores per row of a float32 [H, F] tensor: C quickselect (O(F))
    when the kernel is built, torch.topk otherwise."""
    H, F = scores.shape
    k = max(1, min(k, F))
    lib = _get()
    if lib is None or scores.device.type != "cpu" or scores.dtype != torch.float32:
        return scores.topk(k, -1, sorted=False).indices
    s = scores.contiguous()
    out = torch.empty(H, k, dtype=torch.long)
    wv = torch.empty(H, F, dtype=torch.float32)
    wi = torch.empty(H, F, dtype=torch.long)
    lib.kvpos_topk(s.data_ptr(), H, F, k, out.data_ptr(), wv.data_ptr(), wi.data_ptr(), max(1, torch.get_num_threads()))
    return out
