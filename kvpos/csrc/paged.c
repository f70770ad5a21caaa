#include "common.h"

/* Decode attention over RAW keys held in paged blocks (rotate on read; nothing materialised). One query token per
   row. kv: float32 base of one layer's block pool; block b, kv head h starts at kv + b * blk_stride + h *
   head_stride; inside it key element (slot o, dim d) sits at kbase + o * kso + d * ksd and value element at
   vbase + o * vso + d * vsd (any affine layout: vLLM's CPU "vec" layout has keys [D, bs], values [bs, D]).
   table int64 [B, maxb]: row b's blocks in token order; lens int64 [B]: its tokens. q float32 [B, Hkv * G, D]
   contiguous, rotated at the query's position; cs, sn float32 [B, D / 2, smax] contiguous (slot-minor): cos / sin
   of each slot's position, already multiplied by the RoPE attention scaling; half layout, every dim rotating.
   out float32 [B, Hkv * G, D]; query head h * G + g reads kv head h. A row with no tokens gives 0.
   Per (row, kv head): blocks in order, the G queries' scores against the block's keys (each key element read once
   per query, turned by its slot's angle in the same expression), online softmax, value sums. Plain C written for the
   compiler's vectoriser (-O3 -march=native): the inner loops run over slots (keys, contiguous when kso == 1) and
   dims (values, contiguous when vsd == 1). Float64 reference: kvpos.reference.decode_paged_ref. */
#define PG_MAXG 16
#define PG_MAXD 256
#define PG_MAXBS 256

void kvpos_decode_paged_f32(const float *q, const float *kv, const int64_t *table, const int64_t *lens,
                            const float *cs, const float *sn, float *out, int64_t B, int64_t Hkv, int64_t G,
                            int64_t D, int64_t bs, int64_t maxb, int64_t smax, int64_t blk_stride,
                            int64_t head_stride, int64_t kbase, int64_t kso, int64_t ksd, int64_t vbase,
                            int64_t vso, int64_t vsd, float scale, int nthreads) {
    const int64_t h2 = D / 2;
    _Pragma("omp parallel for schedule(dynamic) num_threads(nthreads)")
    for (int64_t bh = 0; bh < B * Hkv; bh++) {
        const int64_t b = bh / Hkv, h = bh % Hkv, len = lens[b];
        float m[PG_MAXG], l[PG_MAXG], acc[PG_MAXG][PG_MAXD], sc[PG_MAXBS], qa[PG_MAXD], p[PG_MAXBS];
        for (int64_t g = 0; g < G; g++) {
            m[g] = -INFINITY; l[g] = 0.0f;
            for (int64_t d = 0; d < D; d++) acc[g][d] = 0.0f;
        }
        const float *crow = cs + b * h2 * smax, *nrow = sn + b * h2 * smax;
        for (int64_t j = 0; j * bs < len; j++) {
            const int64_t n = len - j * bs < bs ? len - j * bs : bs, t0 = j * bs;
            const float *blk = kv + table[b * maxb + j] * blk_stride + h * head_stride;
            const float *kb = blk + kbase, *vb = blk + vbase;
            for (int64_t g = 0; g < G; g++) {
                const float *qv = q + ((b * Hkv + h) * G + g) * D;
                for (int64_t d = 0; d < D; d++) qa[d] = qv[d];
                for (int64_t o = 0; o < n; o++) sc[o] = 0.0f;
                for (int64_t i = 0; i < h2; i++) {
                    const float a = qa[i], e = qa[i + h2];
                    const float *ki = kb + i * ksd, *ke = kb + (i + h2) * ksd;
                    const float *c = crow + i * smax + t0, *s = nrow + i * smax + t0;
                    for (int64_t o = 0; o < n; o++)
                        sc[o] += ki[o * kso] * (a * c[o] + e * s[o]) + ke[o * kso] * (e * c[o] - a * s[o]);
                }
                float mx = m[g];
                for (int64_t o = 0; o < n; o++) { sc[o] *= scale; mx = sc[o] > mx ? sc[o] : mx; }
                const float corr = expf(m[g] - mx);
                float sum = 0.0f;
                for (int64_t o = 0; o < n; o++) { p[o] = expf(sc[o] - mx); sum += p[o]; }
                l[g] = l[g] * corr + sum;
                m[g] = mx;
                float *ag = acc[g];
                for (int64_t d = 0; d < D; d++) ag[d] *= corr;
                for (int64_t o = 0; o < n; o++) {
                    const float po = p[o], *vo = vb + o * vso;
                    for (int64_t d = 0; d < D; d++) ag[d] += po * vo[d * vsd];
                }
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float *og = out + ((b * Hkv + h) * G + g) * D;
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
            for (int64_t d = 0; d < D; d++) og[d] = acc[g][d] * inv;
        }
    }
}
