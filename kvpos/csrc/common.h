/* Shared by the kvpos kernels: bf16 load/store (round to nearest even, NaN kept), the AVX2 include.
   Built with the other sources into one library by kvpos/_kernels.py. */
#ifndef KVPOS_COMMON_H
#define KVPOS_COMMON_H
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

#define IDENT(v) (v)

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#endif
