#include "common.h"

/* L layers at once. xs[l], outs[l]: [B, H, S, D] with unit stride on D; the B, H and S strides of layer l are
   xsb[l], xsh[l], xss[l] (outs: osb[l], osh[l], oss[l]), in elements, xss[l], oss[l] >= D (a token's D elements
   may sit inside a longer row, as keys beside values in vLLM's CPU blocks). cs, sn: float32 [Bc, S, R/2] contiguous, Bc in
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
                const T *xv = xrow + s * xss[l];                                                               \
                T *ov = orow + s * oss[l];                                                                     \
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

#define ARGS const void *const *xs, void *const *outs, const float *cs, const float *sn, int64_t L, int64_t B,     \
             int64_t H, int64_t S, int64_t D, int64_t R, int64_t Bc, const int64_t *xsb, const int64_t *xsh,     \
             const int64_t *xss, const int64_t *osb, const int64_t *osh, const int64_t *oss, int layout,         \
             int nthreads
void kvpos_rope_f32(ARGS) { typedef float T; ROPE_BODY(IDENT, IDENT) }
void kvpos_rope_bf16(ARGS) { typedef uint16_t T; ROPE_BODY(bf16_load, bf16_store) }

/* The same turn for tokens laid out contiguously (vLLM's CPU blocks hold each head's keys as [D, bs]): xs, outs:
   [B, H, S, D] with unit stride on S and strides xsb, xsh, xsd (outs: osb, osh, osd) in elements, xsd, osd >= S;
   ct, nt: float32 [Bc, R/2, S] contiguous (cos, sin transposed), already multiplied by the scale. One layer; in
   place allowed (outs == xs with equal strides). The inner loop runs over tokens: contiguous loads everywhere. */
#define ROPE_TOK_BODY(LOAD, STORE)                                                                             \
    const int64_t h2 = R / 2;                                                                                  \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                                        \
    for (int64_t b = 0; b < B; b++) {                                                                          \
        const float *cb = ct + (Bc > 1 ? b : 0) * h2 * S, *nb = nt + (Bc > 1 ? b : 0) * h2 * S;               \
        for (int64_t hh = 0; hh < H; hh++) {                                                                   \
            const T *xrow = (const T *)x + b * xsb + hh * xsh;                                                \
            T *orow = (T *)out + b * osb + hh * osh;                                                          \
            for (int64_t i = 0; i < h2; i++) {                                                                 \
                const int64_t ia = layout == 0 ? i : 2 * i, ie = layout == 0 ? i + h2 : 2 * i + 1;             \
                const T *xa = xrow + ia * xsd, *xe = xrow + ie * xsd;                                          \
                T *oa = orow + ia * osd, *oe = orow + ie * osd;                                                \
                const float *c = cb + i * S, *n = nb + i * S;                                                  \
                _Pragma("GCC ivdep")                                                                           \
                for (int64_t s = 0; s < S; s++) {                                                              \
                    const float a = LOAD(xa[s]), e = LOAD(xe[s]);                                              \
                    oa[s] = STORE(a * c[s] - e * n[s]);                                                        \
                    oe[s] = STORE(e * c[s] + a * n[s]);                                                        \
                }                                                                                              \
            }                                                                                                  \
            if (out != x || osd != xsd)                                                                        \
                for (int64_t i = R; i < D; i++)                                                                \
                    for (int64_t s = 0; s < S; s++) orow[i * osd + s] = xrow[i * xsd + s];                     \
        }                                                                                                      \
    }

#define TOK_ARGS const void *x, void *out, const float *ct, const float *nt, int64_t B, int64_t H, int64_t S,     \
                 int64_t D, int64_t R, int64_t Bc, int64_t xsb, int64_t xsh, int64_t xsd, int64_t osb,           \
                 int64_t osh, int64_t osd, int layout, int nthreads
void kvpos_rope_tok_f32(TOK_ARGS) { typedef float T; ROPE_TOK_BODY(IDENT, IDENT) }
void kvpos_rope_tok_bf16(TOK_ARGS) { typedef uint16_t T; ROPE_TOK_BODY(bf16_load, bf16_store) }
