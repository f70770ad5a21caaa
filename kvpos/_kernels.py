"""Fused CPU kernels (C, OpenMP), built once with the system C compiler and loaded with ctypes: RoPE rotation,
decode attention over raw keys (each key rotated in registers while it is scored: rotate-on-read storage never
materialises rotated keys), int8 scoring and top-k for windowed retrieval.

Why: a RoPE rotation in torch eager is 4+ elementwise passes over the keys (results/bench_rotate.md); one fused
loop reads each raw key once and writes each rotated key once. The C sources live in kvpos/csrc/ (rope.c, decode.c,
window.c, common.h); this module builds them and holds the Python signatures. The kernel is optional: without a C compiler (or on
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

from ._checks import fail

__all__ = ["rope_kernel_available", "kernel_status", "rope_apply_kernel", "decode_raw_kernel",
           "decode_paged_kernel",
           "decode_q8_kernel", "score_int8_kernel",
           "topk_indices", "transpose_int8_blocks"]

# the C sources: kvpos/csrc/*.c (and common.h), shipped as package data, compiled together into one library
_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = ("rope.c", "decode.c", "window.c", "paged.c")
_HEADERS = ("common.h",)

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
    missing = [n for n in _SOURCES + _HEADERS if not os.path.isfile(os.path.join(_CSRC, n))]
    if missing:
        return None, f"kernel sources missing from {_CSRC}: {', '.join(missing)} (reinstall kvpos with its package data)"
    text = "".join(open(os.path.join(_CSRC, n)).read() for n in _SOURCES + _HEADERS)
    key = hashlib.sha256((text + " ".join(_FLAGS) + _cpu_id() + platform.machine()).encode()).hexdigest()[:16]
    root = os.environ.get("KVPOS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvpos")
    os.makedirs(root, exist_ok=True)
    so = os.path.join(root, f"kvpos_{key}.so")
    if not os.path.exists(so):
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            out = os.path.join(tmp, "kvpos.so")
            srcs = [os.path.join(_CSRC, n) for n in _SOURCES]
            res = subprocess.run([cc, *_FLAGS, *srcs, "-o", out, "-lm"], capture_output=True, text=True)
            if res.returncode != 0:
                return None, f"{cc} failed: {res.stderr.strip()[:500]}"
            os.replace(out, so)  # atomic: concurrent builders leave one valid file
    lib = ctypes.CDLL(so)
    i64, vp, fp = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p
    for name in ("kvpos_rope_f32", "kvpos_rope_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [vp, vp, fp, fp] + [i64] * 7 + [vp] * 6 + [ctypes.c_int, ctypes.c_int]
        fn.restype = None
    for name in ("kvpos_rope_tok_f32", "kvpos_rope_tok_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [vp, vp, fp, fp] + [i64] * 12 + [ctypes.c_int, ctypes.c_int]
        fn.restype = None
    lib.kvpos_score_int8.argtypes = [vp, vp, vp, vp] + [i64] * 5 + [ctypes.c_int]
    lib.kvpos_score_int8.restype = None
    lib.kvpos_topk.argtypes = [vp] + [i64] * 3 + [vp, vp, vp, ctypes.c_int]
    lib.kvpos_topk.restype = None
    for name in ("kvpos_decode_raw_f32", "kvpos_decode_raw_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [vp] * 8 + [i64] * 12 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        fn.restype = None
    for name in ("kvpos_decode_heads_f32", "kvpos_decode_heads_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [vp] * 8 + [i64] * 2 + [vp] * 3 + [i64] * 15 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
    for name in ("kvpos_importance_f32", "kvpos_importance_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [vp] * 6 + [i64] * 11 + [ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
    for name in ("kvpos_pine_decode_f32", "kvpos_pine_decode_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [vp] * 15 + [i64] * 15 + [ctypes.c_float, ctypes.c_float] + [ctypes.c_int] * 3
        fn.restype = ctypes.c_int
    lib.kvpos_decode_paged_f32.argtypes = [vp] * 7 + [i64] * 15 + [ctypes.c_float, ctypes.c_int]
    lib.kvpos_decode_paged_f32.restype = None
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
    """CPU fp32/bf16 tensors of one shape, unit stride on D and a stride of at least D on S (tokens do not overlap);
    in place only with equal strides.
    Strides and pointers come precomputed (one call each per tensor: this runs on every re-positioning)."""
    shape, dtype = xs[0].shape, xs[0].dtype
    if len(shape) != 4 or dtype not in (torch.float32, torch.bfloat16) or cos.dtype != torch.float32:
        return False
    D = shape[3]
    for x, o, a, b, pa, pb in zip(xs, outs, xst, ost, xp, op):
        if (x.device.type != "cpu" or o.device.type != "cpu" or x.dtype != dtype or o.dtype != dtype
                or x.shape != shape or o.shape != shape or x.requires_grad
                or a[3] != 1 or b[3] != 1 or a[2] < D or b[2] < D or (pa == pb and a != b)):
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
    if len(outs) != len(xs):
        return False
    if not _eligible(xs, outs, cos, xst, ost, xp, op):
        return _rope_tokens_kernel(xs, cos, sin, rotary_dim, interleaved, outs, xst, ost, xp, op)
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
       ints(*[a[0] for a in xst]), ints(*[a[1] for a in xst]), ints(*[a[2] for a in xst]),
       ints(*[b[0] for b in ost]), ints(*[b[1] for b in ost]), ints(*[b[2] for b in ost]),
       1 if interleaved else 0, max(1, torch.get_num_threads()))
    return True


def _rope_tokens_kernel(xs: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                        interleaved: bool, outs: list[torch.Tensor], xst: list[tuple], ost: list[tuple],
                        xp: list[int], op: list[int]) -> bool:
    """rope_apply_kernel for one tensor whose tokens are contiguous (unit stride on S, a stride of at least S on D:
    vLLM's CPU blocks); cos / sin [B|1, 1, S, R/2] are read transposed ([B|1, R/2, S]; no copy when they are views
    of that layout). False where it cannot serve."""
    x, o = xs[0], outs[0]
    B, H, S, D = x.shape
    a, b = xst[0], ost[0]
    if (len(xs) != 1 or x.dtype not in (torch.float32, torch.bfloat16) or o.dtype != x.dtype or o.shape != x.shape
            or cos.dtype != torch.float32 or x.device.type != "cpu" or o.device.type != "cpu" or x.requires_grad
            or a[2] != 1 or b[2] != 1 or a[3] < S or b[3] < S or (xp[0] == op[0] and a != b)):
        return False
    lib = _get()
    if lib is None:
        return False
    ct = cos.reshape(cos.shape[0], S, rotary_dim // 2).transpose(1, 2).contiguous()      # [B|1, R/2, S]
    nt = sin.reshape(sin.shape[0], S, rotary_dim // 2).transpose(1, 2).contiguous()
    if ct.shape[0] not in (1, B):
        return False
    fn = lib.kvpos_rope_tok_f32 if x.dtype == torch.float32 else lib.kvpos_rope_tok_bf16
    fn(xp[0], op[0], ct.data_ptr(), nt.data_ptr(), B, H, S, D, rotary_dim, ct.shape[0], a[0], a[1], a[3],
       b[0], b[1], b[3], 1 if interleaved else 0, max(1, torch.get_num_threads()))
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


def decode_paged_kernel(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, scale: float, kmap: tuple[int, int, int],
                        vmap: tuple[int, int, int]) -> torch.Tensor | None:
    """Decode attention of one query per row over raw keys held in paged blocks, each key rotated as it is read:
    [B, Hq, D] float32.

    q [B, Hq, D] (rotated at each row's query position, any float dtype); kv float32 [blocks, Hkv, ...] one
    layer's block pool, contiguous: block b, head h is the run kv[b, h] flattened, holding key element (slot o, dim
    d) at kmap = (base, so, sd) as base + o * so + d * sd, and value elements at vmap; table [B, maxb] int64 the
    rows' blocks in token order; lens [B] int64 their tokens; cos / sin float32 [B, D / 2, smax] (slot-minor, smax
    >= every len) of the slots' positions, already multiplied by the RoPE attention scaling; half layout with every
    dim rotating. None where the kernel cannot serve (the caller reads the blocks and attends in torch). Float64
    reference: `kvpos.reference.decode_rows_ref`."""
    if torch.compiler.is_compiling():
        return None
    B, Hq, D = q.shape if q.dim() == 3 else (0, 0, 0)
    if (q.dim() != 3 or kv.device.type != "cpu" or kv.dtype != torch.float32 or not kv.is_contiguous()
            or kv.dim() < 3 or D % 2 or D > 256 or Hq % kv.shape[1] or Hq // kv.shape[1] > 16
            or table.dtype != torch.long or lens.dtype != torch.long or table.dim() != 2 or table.shape[0] != B
            or lens.shape != (B,) or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or cos.shape != sin.shape or cos.dim() != 3 or cos.shape[:2] != (B, D // 2)):
        return None
    per_head = kv[0, 0].numel()
    bs = max(1, per_head // (2 * D))
    if bs > 256 or (B and int(lens.max()) > min(cos.shape[2], table.shape[1] * bs)):
        return None
    lib = _get()
    if lib is None:
        return None
    qc = q.to(torch.float32).contiguous()
    out = torch.empty(B, Hq, D, dtype=torch.float32)
    tb, ln = table.contiguous(), lens.contiguous()
    cs, sn = cos.contiguous(), sin.contiguous()
    Hkv = kv.shape[1]
    lib.kvpos_decode_paged_f32(qc.data_ptr(), kv.data_ptr(), tb.data_ptr(), ln.data_ptr(), cs.data_ptr(),
                               sn.data_ptr(), out.data_ptr(), B, Hkv, Hq // Hkv, D, bs, tb.shape[1], cs.shape[2],
                               kv.stride(0), kv.stride(1), *kmap, *vmap, float(scale),
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
