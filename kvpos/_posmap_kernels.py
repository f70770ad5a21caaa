"""The fused decode kernels under read-time position maps (kvpos.posmap), Python side: per-head rotation tables and
per-key query variants (Ms-PoE, PINE's offsets), PINE's importance without RoPE, and PINE-lite's whole decode step
in one call. The C lives in kvpos/csrc/decode.c; the library is built and loaded by kvpos._kernels."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ._checks import fail
from ._kernels import _get
from .posmap import factor_bits

__all__ = ["decode_heads_kernel", "segment_mass_kernel", "pine_decode_kernel", "PinePlan", "pine_plan"]


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


def _split_k(B: int, Hq: int, Hkv: int, N: int, width: int, out_width: int
             ) -> tuple[ctypes.CDLL, int, torch.Tensor, torch.Tensor] | None:
    """(library, G = Hq / Hkv, work float32 [B * Hkv * chunks * G * width], out float32 [B, Hq, out_width]) for a
    split-K kernel call over N slots in chunks of 128 (each chunk's partials `width` floats per query head), or None
    where the C library is not built."""
    lib = _get()
    if lib is None:
        return None
    G = Hq // Hkv
    work = torch.empty(B * Hkv * ((N + 127) // 128) * G * width, dtype=torch.float32)
    return lib, G, work, torch.empty(B, Hq, out_width, dtype=torch.float32)


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
    row t mod F (unscaled) and row F + t // F (times the attention scaling), F = 2 ** kvpos.posmap.factor_bits(R),
    multiplied in registers: tables of a few KB where full ones take Rt * N rows. None where the kernel cannot
    serve; ValueError on indices outside the tables or variants (found by the kernel, which never reads them).
    Float64 reference: `kvpos.reference.decode_heads_ref`."""
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
        NT, fp, fb = 0, None, 0
        if Nc != N or h2 != rotary_dim // 2 or Bc not in (1, B):
            fail("decode_heads_kernel cos/sin", f"[Rt, 1 or B={B}, N={N}, R/2={rotary_dim // 2}]", list(cos.shape))
    else:
        Rt, NT, h2 = cos.shape
        fb = factor_bits(rotary_dim)
        fp = fpos.to(torch.int64).reshape(-1, N).contiguous()
        Bc = fp.shape[0]
        if h2 != rotary_dim // 2 or NT <= (1 << fb) or Bc not in (1, B):
            fail("decode_heads_kernel factored cos/sin, fpos",
                 f"[Rt, NT > {1 << fb}, R/2={rotary_dim // 2}], [1 or B, N]",
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
    got = _split_k(B, Hq, Hkv, N, D + 2, D)
    if got is None:
        return None
    lib, G, work, out = got
    qc = q.to(torch.float32).contiguous()
    cs, sn = cos.contiguous(), sin.contiguous()
    fn = lib.kvpos_decode_heads_f32 if k.dtype == torch.float32 else lib.kvpos_decode_heads_bf16
    bad = fn(qc.data_ptr(), k.data_ptr(), v.data_ptr(), cs.data_ptr(), sn.data_ptr(), ht.data_ptr(),
             0 if sg is None else sg.data_ptr(), 0 if fp is None else fp.data_ptr(), NT, fb,
             0 if m is None else m.data_ptr(), out.data_ptr(), work.data_ptr(),
             B, Hkv, G, V, N, D, rotary_dim, Bc, 1 if sg is None else sg.shape[0], 1 if m is None else m.shape[0],
             1 if m is None else m.shape[1], k.stride(0), k.stride(1), v.stride(0), v.stride(1), float(scale),
             1 if interleaved else 0, max(1, torch.get_num_threads()))
    if bad & 1:
        fail("decode_heads_kernel seg", f"ints in [0, V={V}) (the query variants)",
             f"range [{int(sg.min())}, {int(sg.max())}]")
    if bad & 2:
        span = (1 << fb) * (NT - (1 << fb))
        fail("decode_heads_kernel fpos", f"positions in [0, {span}) (the factored tables' span)",
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
    got = _split_k(B, Hq, Hkv, N, n + 1, n)
    if got is None:
        return None
    lib, G, work, out = got
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
    [-1, n). `pine_plan(...).run(q, k, v, scale)` is the same call with the per-step arguments laid out once (the
    layers of a step share them). Float64 references: `kvpos.reference.segment_mass_ref`, `kvpos.posmap.pine_shifts`,
    `kvpos.reference.decode_heads_ref`."""
    if torch.compiler.is_compiling():
        return None
    plan = pine_plan(cos, sin, inv_freq, doc, start, size, end, kpos, qpos, mask, attention_scaling, rotary_dim,
                     interleaved, window, angle_f32)
    return plan.run(q, k, v, scale)


@dataclass(frozen=True)
class PinePlan:
    """pine_decode_kernel's per-step arguments, checked and laid out as the kernel reads them (contiguous, its
    dtypes): the layers of one decode step share them, so each layer pays for one kernel call only. Built by
    `pine_plan`; B rows, N slots, n documents."""

    cs: torch.Tensor          # [Bc, N, R/2] float32
    sn: torch.Tensor
    inv: torch.Tensor         # [R/2] float64
    dc: torch.Tensor          # [Bs, N] int32
    st: torch.Tensor          # [B, n] int64
    sz: torch.Tensor
    en: torch.Tensor          # [B] int64
    kp: torch.Tensor          # [Bc, N] int64
    qp: torch.Tensor          # [B] int64
    m: torch.Tensor | None    # [Bm, 1, N] float32 additive
    B: int
    N: int
    n: int
    window: int
    attention_scaling: float
    rotary_dim: int
    interleaved: bool
    angle_f32: bool

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """pine_decode_kernel over one layer's q [B, Hq, D], raw keys and values k, v [B, Hkv, N, D]: (out [B, Hq, D]
        float32, shift [B, Hq, n] int64), or None where the kernel cannot serve (see pine_decode_kernel)."""
        if torch.compiler.is_compiling():
            return None
        B, Hkv, N, D = k.shape
        if (q.dim() != 3 or q.shape[0] != B or q.shape[2] != D or k.device.type != "cpu"
                or k.dtype not in (torch.float32, torch.bfloat16) or v.dtype != k.dtype or v.shape != k.shape
                or k.stride(3) != 1 or k.stride(2) != D or v.stride(3) != 1 or v.stride(2) != D or k.requires_grad
                or v.requires_grad):
            return None
        Hq = q.shape[1]
        if Hq % Hkv or Hq // Hkv > 16 or D > 256 or N == 0:
            return None
        if (B, N) != (self.B, self.N):
            fail("PinePlan.run k", f"[B={self.B}, Hkv, N={self.N}, D] (the plan's rows and slots)", list(k.shape),
                 "build the plan with this layer's tables and documents")
        lib = _get()
        if lib is None:
            return None
        n = self.n
        out = torch.empty(B, Hq, D, dtype=torch.float32)
        shift = torch.empty(B, Hq, n, dtype=torch.int64)
        qc = q.to(torch.float32).contiguous()
        m = self.m
        fn = lib.kvpos_pine_decode_f32 if k.dtype == torch.float32 else lib.kvpos_pine_decode_bf16
        bad = fn(qc.data_ptr(), k.data_ptr(), v.data_ptr(), self.cs.data_ptr(), self.sn.data_ptr(), self.inv.data_ptr(),
                 self.dc.data_ptr(), self.st.data_ptr(), self.sz.data_ptr(), self.en.data_ptr(), self.kp.data_ptr(),
                 self.qp.data_ptr(), 0 if m is None else m.data_ptr(), out.data_ptr(), shift.data_ptr(), B, Hkv,
                 Hq // Hkv, N, D, self.rotary_dim, n, self.cs.shape[0], self.dc.shape[0],
                 1 if m is None else m.shape[0], k.stride(0), k.stride(1), v.stride(0), v.stride(1), self.window,
                 float(scale), float(self.attention_scaling), 1 if self.interleaved else 0,
                 1 if self.angle_f32 else 0, max(1, torch.get_num_threads()))
        if bad & 4:
            raise MemoryError("pine_decode_kernel: the kernel could not allocate its scratch buffers")
        if bad & 1:
            fail("pine_decode_kernel doc", f"ints in [-1, n={n}) (each slot's document, -1 for none)",
                 f"range [{int(self.dc.min())}, {int(self.dc.max())}]")
        return out, shift


def pine_plan(cos: torch.Tensor, sin: torch.Tensor, inv_freq: torch.Tensor, doc: torch.Tensor, start: torch.Tensor,
              size: torch.Tensor, end: torch.Tensor, kpos: torch.Tensor, qpos: torch.Tensor,
              mask: torch.Tensor | None, attention_scaling: float, rotary_dim: int, interleaved: bool,
              window: int | None = None, angle_f32: bool = True) -> PinePlan:
    """The per-step arguments of pine_decode_kernel (its docstring: shapes, meaning), checked once: B rows from
    start, N slots from the tables. ValueError on misshaped or out-of-range arguments, naming them."""
    B, n = start.shape if start.dim() == 2 else (-1, -1)
    N, h2 = cos.shape[-2] if cos.dim() >= 2 else -1, rotary_dim // 2
    if (start.dim() != 2 or size.shape != (B, n) or end.shape != (B,) or qpos.shape != (B,) or n < 1
            or cos.dim() < 2 or cos.dtype != torch.float32 or sin.shape != cos.shape or cos.shape[-1] != h2):
        fail("pine_decode_kernel start / size / end / qpos / cos / sin",
             f"[B, n], [B, n], [B], [B] with n >= 1; float32 tables [B|1, N, R/2={h2}]",
             f"{list(start.shape)}, {list(size.shape)}, {list(end.shape)}, {list(qpos.shape)}, "
             f"{list(cos.shape)} {cos.dtype}, {list(sin.shape)}")
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
    return PinePlan(cs, sn, inv_freq.to(torch.float64).contiguous(), dc, start.to(torch.int64).contiguous(),
                    size.to(torch.int64).contiguous(), end.to(torch.int64).contiguous(), kp,
                    qpos.to(torch.int64).contiguous(), m, B, N, n, 0 if window is None else window,
                    float(attention_scaling), rotary_dim, bool(interleaved), bool(angle_f32))
