"""A fused CPU rotation kernel (C, OpenMP), built once with the system C compiler and loaded with ctypes.

Why: a RoPE rotation in torch eager is 4+ elementwise passes over the keys (~35% of memcpy bandwidth); one fused
loop reads each raw key once and writes each rotated key once. The kernel is optional: without a C compiler (or on
CUDA tensors, fp16, odd strides) `kvpos.rope` uses the torch path, which computes the same numbers (float32 math,
one rounding to the key dtype). Set KVPOS_NO_KERNEL=1 to force the torch path.

The build lands in $KVPOS_CACHE (default ~/.cache/kvpos), keyed by a hash of the source, the compiler flags and the
CPU model, so a cache directory shared between different machines never serves a foreign binary.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import torch

__all__ = ["rope_kernel_available", "rope_apply_kernel", "score_int8_kernel"]

_SRC = r"""
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
    const int64_t nblk = (S + ROPE_BLOCK - 1) / ROPE_BLOCK, total = L * B * H * nblk;                         \
    /* work item = (layer, batch row, head, block of ROPE_BLOCK tokens): index arithmetic once per block */   \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                                        \
    for (int64_t idx = 0; idx < total; idx++) {                                                               \
        const int64_t blk = idx % nblk, r1 = idx / nblk, hh = r1 % H, r2 = r1 / H, b = r2 % B, l = r2 / B;    \
        const int64_t s0 = blk * ROPE_BLOCK, s1 = s0 + ROPE_BLOCK < S ? s0 + ROPE_BLOCK : S;                  \
        const T *xrow = (const T *)xs[l] + b * xsb[l] + hh * xsh[l];                                          \
        T *orow = (T *)outs[l] + b * osb[l] + hh * osh[l];                                                    \
        const float *crow = cs + (Bc > 1 ? b : 0) * S * h2, *nrow = sn + (Bc > 1 ? b : 0) * S * h2;           \
        for (int64_t s = s0; s < s1; s++) {                                                                    \
            const T *xv = xrow + s * D;                                                                        \
            T *ov = orow + s * D;                                                                              \
            const float *c = crow + s * h2, *n = nrow + s * h2;                                                \
            if (layout == 0) {                                                                                 \
                _Pragma("GCC ivdep")                                                                           \
                for (int64_t i = 0; i < h2; i++) {                                                             \
                    const float a = LOAD(xv[i]), e = LOAD(xv[i + h2]);                                         \
                    ov[i] = STORE(a * c[i] - e * n[i]);                                                        \
                    ov[i + h2] = STORE(e * c[i] + a * n[i]);                                                   \
                }                                                                                              \
            } else {                                                                                           \
                _Pragma("GCC ivdep")                                                                           \
                for (int64_t i = 0; i < h2; i++) {                                                             \
                    const float a = LOAD(xv[2 * i]), e = LOAD(xv[2 * i + 1]);                                  \
                    ov[2 * i] = STORE(a * c[i] - e * n[i]);                                                    \
                    ov[2 * i + 1] = STORE(e * c[i] + a * n[i]);                                                \
                }                                                                                              \
            }                                                                                                  \
            for (int64_t i = R; i < D; i++) ov[i] = xv[i];                                                     \
        }                                                                                                      \
    }

#define IDENT(v) (v)
#define ARGS const void *const *xs, void *const *outs, const float *cs, const float *sn, int64_t L, int64_t B,     \
             int64_t H, int64_t S, int64_t D, int64_t R, int64_t Bc, const int64_t *xsb, const int64_t *xsh,     \
             const int64_t *osb, const int64_t *osh, int layout, int nthreads
void kvpos_rope_f32(ARGS) { typedef float T; ROPE_BODY(IDENT, IDENT) }
void kvpos_rope_bf16(ARGS) { typedef uint16_t T; ROPE_BODY(bf16_load, bf16_store) }

/* Scores of int8 keys for groups of queries: out[h, j] = scale[h, j] * max_g sum_d q[h, g, d] * k[h, j, d].
   q float32 [H, G, D] contiguous; k int8 [H, F, D] with head stride ksh (elements) and unit stride on D;
   scale float32 [H, F] (head stride ssh); out float32 [H, F] contiguous. */
void kvpos_score_int8(const float *q, const int8_t *k, const float *scale, float *out, int64_t H, int64_t G,
                      int64_t F, int64_t D, int64_t ksh, int64_t ssh, int nthreads) {
    const int64_t nblk = (F + 255) / 256;
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")
    for (int64_t idx = 0; idx < H * nblk; idx++) {
        const int64_t h = idx / nblk, j0 = (idx % nblk) * 256, j1 = j0 + 256 < F ? j0 + 256 : F;
        const float *qh = q + h * G * D;
        for (int64_t j = j0; j < j1; j++) {
            const int8_t *kj = k + h * ksh + j * D;
            float best = -3.0e38f;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qh + g * D;
                float acc = 0.0f;
                for (int64_t d = 0; d < D; d++) acc += qg[d] * (float)kj[d];
                best = acc > best ? acc : best;
            }
            out[h * F + j] = best * scale[h * ssh + j];
        }
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
build_error: str | None = None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build() -> ctypes.CDLL | None:
    global build_error
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        build_error = "no C compiler (gcc/cc) on PATH"
        return None
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
            res = subprocess.run([cc, *_FLAGS, src, "-o", out], capture_output=True, text=True)
            if res.returncode != 0:
                build_error = f"{cc} failed: {res.stderr.strip()[:500]}"
                return None
            os.replace(out, so)  # atomic: concurrent builders leave one valid file
    lib = ctypes.CDLL(so)
    i64, vp, fp = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p
    for name in ("kvpos_rope_f32", "kvpos_rope_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [vp, vp, fp, fp] + [i64] * 7 + [vp] * 4 + [ctypes.c_int, ctypes.c_int]
        fn.restype = None
    lib.kvpos_score_int8.argtypes = [vp, vp, vp, vp] + [i64] * 6 + [ctypes.c_int]
    lib.kvpos_score_int8.restype = None
    return lib


def _get() -> ctypes.CDLL | None:
    global _lib, _tried, build_error
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("KVPOS_NO_KERNEL"):
                build_error = "disabled by KVPOS_NO_KERNEL"
            else:
                try:
                    _lib = _build()
                except Exception as e:  # noqa: BLE001 - any build/load failure falls back to torch, reported below
                    build_error = f"{type(e).__name__}: {e}"
                    _lib = None
            _tried = True
    return _lib


def rope_kernel_available() -> bool:
    """True when the fused C kernel is built and loaded (see `build_error` otherwise)."""
    return _get() is not None


def _eligible(x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> bool:
    return (
        x.device.type == "cpu" and out.device.type == "cpu" and x.dtype == dtype and out.dtype == dtype
        and dtype in (torch.float32, torch.bfloat16) and x.shape == shape and out.shape == shape
        and x.stride(3) == 1 and out.stride(3) == 1 and x.stride(2) == shape[3] and out.stride(2) == shape[3]
        and (out.data_ptr() != x.data_ptr() or x.stride() == out.stride())
        and cos.dtype == torch.float32 and not x.requires_grad
    )


def rope_apply_kernel(xs: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                      interleaved: bool, outs: list[torch.Tensor]) -> bool:
    """outs[l] = rotate(xs[l]) for every l, with scaled cos/sin [B|1, 1, S, R/2] (float32), in one call.

    All xs share shape [B, H, S, D] and dtype. Returns False (doing nothing) when the kernel cannot serve these
    tensors; the caller then uses the torch path.
    """
    if not xs:
        return True
    shape, dtype = xs[0].shape, xs[0].dtype
    if len(shape) != 4 or not all(_eligible(x, o, cos, shape, dtype) for x, o in zip(xs, outs)):
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
    fn(ptrs(*[x.data_ptr() for x in xs]), ptrs(*[o.data_ptr() for o in outs]), cs.data_ptr(), sn.data_ptr(),
       L, B, H, S, D, rotary_dim, cs.shape[0],
       ints(*[x.stride(0) for x in xs]), ints(*[x.stride(1) for x in xs]),
       ints(*[o.stride(0) for o in outs]), ints(*[o.stride(1) for o in outs]),
       1 if interleaved else 0, max(1, torch.get_num_threads()))
    return True


def score_int8_kernel(q: torch.Tensor, k: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """out [H, F] = scale * max over g of q[h, g] . k[h, j] for q float32 [H, G, D], k int8 [H, F, D], scale float32
    [H, F]. Returns None when the kernel cannot serve the tensors (the caller computes it with torch)."""
    if not (q.device.type == "cpu" and k.dtype == torch.int8 and k.dim() == 3 and k.stride(2) == 1
            and k.stride(1) == k.shape[2] and scale.dtype == torch.float32 and scale.stride(1) == 1):
        return None
    lib = _get()
    if lib is None:
        return None
    H, F, D = k.shape
    qc = q.float().contiguous()
    out = torch.empty(H, F, dtype=torch.float32)
    lib.kvpos_score_int8(qc.data_ptr(), k.data_ptr(), scale.data_ptr(), out.data_ptr(), H, qc.shape[1], F, D,
                         k.stride(0), scale.stride(0), max(1, torch.get_num_threads()))
    return out
