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

__all__ = ["rope_kernel_available", "kernel_status", "rope_apply_kernel", "decode_raw_kernel", "decode_heads_kernel",
           "segment_mass_kernel", "pine_decode_kernel", "decode_paged_kernel",
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
        fn.argtypes = [vp] * 8 + [i64] + [vp] * 3 + [i64] * 15 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
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


def _head_mask(mask: torch.Tensor | None, B: int, Hq: int, N: int, what: str) -> torch.Tensor | None:
    """An additive mask [N], [Bm, N] or [Bm, Hm, N] (Bm in {1, B}, Hm in {1, Hq}) as the kernels read it: float32
    [Bm, Hm, N] contiguous, or None; any other shape is refused naming `what`."""
    if mask is None:
        return None
    want = f"additive float [1 or B={B}, N={N}] or [1 or B, 1 or Hq={Hq}, N]"
    if not 1 <= mask.dim() <= 3:
        fail(f"{what} mask", want, list(mask.shape))
    m = mask.to(torch.float32).reshape(mask.shape[0] if mask.dim() > 1 else 1, -1, mask.shape[-1]).contiguous()
    if m.shape[0] not in (1, B) or m.shape[1] not in (1, Hq) or m.shape[2] != N:
        fail(f"{what} mask", want, list(mask.shape))
    return m


def decode_heads_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        head_table: torch.Tensor, seg: torch.Tensor | None, mask: torch.Tensor | None, scale: float,
                        rotary_dim: int, interleaved: bool, fpos: torch.Tensor | None = None
                        ) -> torch.Tensor | None:
    """`decode_raw_kernel` under read-time position maps: [B, Hq, D] float32.

    q [B, Hq, V, D]: V rotated variants of each query head (any float dtype); k, v [B, Hkv, N, D] raw keys and
    values as decode_raw_kernel; cos / sin [Rt, Bc, N, R/2] float32 (Bc in {1, B}): Rt rotation tables of the slots,
    already multiplied by the RoPE attention scaling; head_table [Hq] int64 in [0, Rt): the table query head h
    rotates keys with; seg [Bs, N] int (Bs in {1, B}) in [0, V) or None: the variant of the query each key is scored
    with (None: variant 0); mask None or additive float32 [Bm, N] or [Bm, Hm, N] (Bm in {1, B}, Hm in {1, Hq}: one
    row for all heads, or one per query head). Per-head position scales (Ms-PoE) are tables; per-(head, segment)
    offsets (PINE) are query variants. With fpos [Bc, N] int64 (the slots' integer positions) the tables are
    factored instead (`kvpos.posmap.factored_tables`): cos / sin [Rt, NT, R/2], the angle of position t the sum of
    row t mod 64 (unscaled) and row 64 + t // 64 (times the attention scaling), multiplied in registers: tables of a
    few KB where full ones take Rt * N rows. None where the kernel cannot serve; ValueError on indices outside the tables
    or variants (found by the kernel, which never reads them). Float64 reference:
    `kvpos.reference.decode_heads_ref`."""
    if torch.compiler.is_compiling():
        return None
    B, Hkv, N, D = k.shape
    if (q.dim() != 4 or k.device.type != "cpu" or k.dtype not in (torch.float32, torch.bfloat16)
            or v.dtype != k.dtype or v.shape != k.shape or k.stride(3) != 1 or k.stride(2) != D
            or v.stride(3) != 1 or v.stride(2) != D or k.requires_grad or v.requires_grad
            or cos.dim() != (4 if fpos is None else 3)
            or cos.shape != sin.shape or cos.dtype != torch.float32 or sin.dtype != torch.float32):
        return None
    Hq, V = q.shape[1], q.shape[2]
    if fpos is None:
        Rt, Bc, Nc, h2 = cos.shape
        NT, fp = 0, None
        if Nc != N or h2 != rotary_dim // 2 or Bc not in (1, B):
            fail("decode_heads_kernel cos/sin", f"[Rt, 1 or B={B}, N={N}, R/2={rotary_dim // 2}]", list(cos.shape))
    else:
        Rt, NT, h2 = cos.shape
        fp = fpos.to(torch.int64).reshape(-1, N).contiguous()
        Bc = fp.shape[0]
        if h2 != rotary_dim // 2 or NT <= 64 or Bc not in (1, B):
            fail("decode_heads_kernel factored cos/sin, fpos", f"[Rt, NT > 64, R/2={rotary_dim // 2}], [1 or B, N]",
                 f"{list(cos.shape)}, {list(fpos.shape)}")
    ht = head_table.to(torch.int64).contiguous()
    rows = ht.tolist() if ht.dim() == 1 else []
    if len(rows) != Hq or min(rows) < 0 or max(rows) >= Rt:
        fail("decode_heads_kernel head_table", f"[Hq={Hq}] ints in [0, {Rt})", f"{list(ht.shape)}: {rows}")
    sg = None if seg is None else seg.to(torch.int32).reshape(-1, N).contiguous()   # range: checked by the kernel
    if sg is not None and sg.shape[0] not in (1, B):
        fail("decode_heads_kernel seg", f"[1 or B={B}, N={N}] ints", list(seg.shape))
    m = _head_mask(mask, B, Hq, N, "decode_heads_kernel")
    if Hq % Hkv or Hq // Hkv > 16 or D > 256 or N == 0 or q.shape[0] != B or q.shape[3] != D:
        return None
    lib = _get()
    if lib is None:
        return None
    G = Hq // Hkv
    work = torch.empty(B * Hkv * ((N + 127) // 128) * G * (D + 2), dtype=torch.float32)
    out = torch.empty(B, Hq, D, dtype=torch.float32)
    qc = q.to(torch.float32).contiguous()
    cs, sn = cos.contiguous(), sin.contiguous()
    fn = lib.kvpos_decode_heads_f32 if k.dtype == torch.float32 else lib.kvpos_decode_heads_bf16
    bad = fn(qc.data_ptr(), k.data_ptr(), v.data_ptr(), cs.data_ptr(), sn.data_ptr(), ht.data_ptr(),
             0 if sg is None else sg.data_ptr(), 0 if fp is None else fp.data_ptr(), NT,
             0 if m is None else m.data_ptr(), out.data_ptr(), work.data_ptr(),
             B, Hkv, G, V, N, D, rotary_dim, Bc, 1 if sg is None else sg.shape[0], 1 if m is None else m.shape[0],
             1 if m is None else m.shape[1], k.stride(0), k.stride(1), v.stride(0), v.stride(1), float(scale),
             1 if interleaved else 0, max(1, torch.get_num_threads()))
    if bad & 1:
        fail("decode_heads_kernel seg", f"ints in [0, V={V}) (the query variants)",
             f"range [{int(sg.min())}, {int(sg.max())}]")
    if bad & 2:
        fail("decode_heads_kernel fpos", f"positions in [0, {64 * (NT - 64)}) (the factored tables' span)",
             f"range [{int(fp.min())}, {int(fp.max())}]", "build the tables for the largest position")
    return out


def segment_mass_kernel(q: torch.Tensor, k: torch.Tensor, doc: torch.Tensor, n: int, mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor | None:
    """PINE's importance numerator for one query row, WITHOUT RoPE: [B, Hq, n] float32, for query head h the softmax
    of scale * q.k + mask over the slots of documents, summed per document (a row with no visible document slot:
    zeros). q [B, Hq, D] unrotated queries (any float dtype); k [B, Hkv, N, D] raw keys (fp32 or bf16, unit stride
    on D, stride D on slots; query head h reads kv head h // (Hq / Hkv)); doc [B|1, N] ints in [-1, n): each slot's
    document, -1 for the others; mask None or additive float32 [B|1, N] or [B|1, 1|Hq, N]. None where the kernel
    cannot serve; ValueError on document indices outside [-1, n) (found by the kernel, which skips them). Float64
    reference: `kvpos.reference.segment_mass_ref`."""
    if torch.compiler.is_compiling():
        return None
    B, Hkv, N, D = k.shape
    if (q.dim() != 3 or k.device.type != "cpu" or k.dtype not in (torch.float32, torch.bfloat16)
            or k.stride(3) != 1 or k.stride(2) != D or k.requires_grad):
        return None
    Hq = q.shape[1]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        fail("segment_mass_kernel n", "an int >= 1 (the number of documents)", repr(n))
    dc = doc.to(torch.int32).reshape(-1, N).contiguous() if doc.numel() % max(N, 1) == 0 else None
    if dc is None or doc.dim() > 2 or dc.shape[0] not in (1, B):
        fail("segment_mass_kernel doc", f"[1 or B={B}, N={N}] ints", list(doc.shape))
    m = _head_mask(mask, B, Hq, N, "segment_mass_kernel")
    if Hq % Hkv or Hq // Hkv > 16 or N == 0 or q.shape[0] != B or q.shape[2] != D:
        return None
    lib = _get()
    if lib is None:
        return None
    G = Hq // Hkv
    work = torch.empty(B * Hkv * ((N + 127) // 128) * G * (n + 1), dtype=torch.float32)
    out = torch.empty(B, Hq, n, dtype=torch.float32)
    qc = q.to(torch.float32).contiguous()
    fn = lib.kvpos_importance_f32 if k.dtype == torch.float32 else lib.kvpos_importance_bf16
    bad = fn(qc.data_ptr(), k.data_ptr(), dc.data_ptr(), 0 if m is None else m.data_ptr(), out.data_ptr(),
             work.data_ptr(), B, Hkv, G, N, D, n, dc.shape[0], 1 if m is None else m.shape[0],
             1 if m is None else m.shape[1], k.stride(0), k.stride(1), float(scale), max(1, torch.get_num_threads()))
    if bad:
        fail("segment_mass_kernel doc", f"ints in [-1, n={n}) (each slot's document, -1 for none)",
             f"range [{int(dc.min())}, {int(dc.max())}]")
    return out


def pine_decode_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       inv_freq: torch.Tensor, doc: torch.Tensor, start: torch.Tensor, size: torch.Tensor,
                       end: torch.Tensor, kpos: torch.Tensor, qpos: torch.Tensor, mask: torch.Tensor | None,
                       scale: float, attention_scaling: float, rotary_dim: int, interleaved: bool,
                       window: int | None = None, angle_f32: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
    """PINE-lite's decode step in one kernel call (integrations/pine.py): (out [B, Hq, D] float32, shift [B, Hq, n]
    int64), or None where the kernel cannot serve.

    q [B, Hq, D] the model's rotated query (one row per batch row, at qpos [B] int64); k, v [B, Hkv, N, D] raw keys
    and values as decode_raw_kernel; cos / sin [B|1, N, R/2] float32: the slots' tables times the attention scaling
    (as decode_raw_kernel's); inv_freq [R/2] (the spec's); doc [B|1, N] ints in [-1, n) (-1: not a document slot);
    start, size [B, n] int64 (each document's first position and slot count, every size >= 1); end [B] int64 (where
    the documents end); kpos [B|1, N] int64 (the slots' positions); mask None or additive float32 [B|1, N] (what the
    query sees, the importance too); window: a sliding window applied at the positions keys are READ at; angle_f32:
    angles computed in float32 (the spec's angle dtype, as transformers does) rather than float64. The
    kernel computes segment_importance without RoPE, pine_shifts, one query variant per document and
    decode_heads_kernel with per-key variants (and per-head window masks); ValueError on document indices outside
    [-1, n). Float64 references: `kvpos.reference.segment_mass_ref`, `kvpos.posmap.pine_shifts`,
    `kvpos.reference.decode_heads_ref`."""
    if torch.compiler.is_compiling():
        return None
    B, Hkv, N, D = k.shape
    if (q.dim() != 3 or q.shape[0] != B or q.shape[2] != D or k.device.type != "cpu"
            or k.dtype not in (torch.float32, torch.bfloat16) or v.dtype != k.dtype or v.shape != k.shape
            or k.stride(3) != 1 or k.stride(2) != D or v.stride(3) != 1 or v.stride(2) != D or k.requires_grad
            or v.requires_grad or cos.dtype != torch.float32 or sin.shape != cos.shape):
        return None
    Hq, h2 = q.shape[1], rotary_dim // 2
    if Hq % Hkv or Hq // Hkv > 16 or D > 256 or N == 0:
        return None
    n = size.shape[-1]
    if start.shape != (B, n) or size.shape != (B, n) or end.shape != (B,) or qpos.shape != (B,) or n < 1:
        fail("pine_decode_kernel start / size / end / qpos", f"[B={B}, n], [B, n], [B], [B] with n >= 1",
             f"{list(start.shape)}, {list(size.shape)}, {list(end.shape)}, {list(qpos.shape)}")
    if bool((size < 1).any()):
        fail("pine_decode_kernel size", "every document >= 1 slot", size.tolist())
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        fail("pine_decode_kernel window", "None or an int >= 1 (the layer's sliding window)", repr(window))
    cs, sn = cos.reshape(-1, N, h2).contiguous(), sin.reshape(-1, N, h2).contiguous()
    kp = kpos.to(torch.int64).reshape(-1, N).contiguous()
    dc = doc.to(torch.int32).reshape(-1, N).contiguous()
    m = _head_mask(mask, B, 1, N, "pine_decode_kernel")
    if cs.shape[0] not in (1, B) or kp.shape[0] != cs.shape[0] or dc.shape[0] not in (1, B):
        fail("pine_decode_kernel cos / kpos / doc", f"[1 or B={B}, N={N}, ...], kpos with the tables' rows",
             f"{list(cs.shape)}, {list(kp.shape)}, {list(dc.shape)}")
    lib = _get()
    if lib is None:
        return None
    out = torch.empty(B, Hq, D, dtype=torch.float32)
    shift = torch.empty(B, Hq, n, dtype=torch.int64)
    qc = q.to(torch.float32).contiguous()
    inv = inv_freq.to(torch.float64).contiguous()
    st, sz = start.to(torch.int64).contiguous(), size.to(torch.int64).contiguous()
    en, qp = end.to(torch.int64).contiguous(), qpos.to(torch.int64).contiguous()
    fn = lib.kvpos_pine_decode_f32 if k.dtype == torch.float32 else lib.kvpos_pine_decode_bf16
    bad = fn(qc.data_ptr(), k.data_ptr(), v.data_ptr(), cs.data_ptr(), sn.data_ptr(), inv.data_ptr(), dc.data_ptr(),
             st.data_ptr(), sz.data_ptr(), en.data_ptr(), kp.data_ptr(), qp.data_ptr(),
             0 if m is None else m.data_ptr(), out.data_ptr(), shift.data_ptr(), B, Hkv, Hq // Hkv, N, D,
             rotary_dim, n, cs.shape[0], dc.shape[0], 1 if m is None else m.shape[0], k.stride(0), k.stride(1),
             v.stride(0), v.stride(1), 0 if window is None else window, float(scale), float(attention_scaling),
             1 if interleaved else 0, 1 if angle_f32 else 0, max(1, torch.get_num_threads()))
    if bad & 4:
        raise MemoryError("pine_decode_kernel: the kernel could not allocate its scratch buffers")
    if bad & 1:
        fail("pine_decode_kernel doc", f"ints in [-1, n={n}) (each slot's document, -1 for none)",
             f"range [{int(dc.min())}, {int(dc.max())}]")
    return out, shift


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
