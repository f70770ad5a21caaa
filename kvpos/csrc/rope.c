#include "common.h"

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

#define ARGS const void *const *xs, void *const *outs, const float *cs, const float *sn, int64_t L, int64_t B,     \
             int64_t H, int64_t S, int64_t D, int64_t R, int64_t Bc, const int64_t *xsb, const int64_t *xsh,     \
             const int64_t *osb, const int64_t *osh, int layout, int nthreads
void kvpos_rope_f32(ARGS) { typedef float T; ROPE_BODY(IDENT, IDENT) }
void kvpos_rope_bf16(ARGS) { typedef uint16_t T; ROPE_BODY(bf16_load, bf16_store) }
