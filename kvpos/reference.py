"""Float64 oracles: slow on purpose, written from the formulas, for tests and debugging. Never used on a fast path.

Letters: B batch · H kv heads · Hq query heads · T keys · S queries · D head_dim · R rotary_dim.
"""
from __future__ import annotations

import math

import torch

from .rope import RopeLayout, RopeSpec

__all__ = ["rotation_matrix_ref", "rotate_ref", "unrotate_ref", "attend_ref", "decode_raw_ref", "decode_rows_ref",
           "dequant_q8_ref", "decode_q8_ref", "ape_merge_ref", "windowed_score_ref", "distance_attend_ref", "scaled_attend_ref",
           "decode_heads_ref", "segment_mass_ref"]


def rotation_matrix_ref(p: int, spec: RopeSpec) -> torch.Tensor:
    """Return the [D, D] float64 matrix s * R_p of position p (pairs per spec.layout, pass-through dims = identity)."""
    D, R = spec.head_dim, spec.rotary_dim
    M = torch.eye(D, dtype=torch.float64)
    inv = spec.inv_freq.double()
    for i in range(R // 2):
        a, b = (i, i + R // 2) if spec.layout is RopeLayout.HALF else (2 * i, 2 * i + 1)
        th = float(p) * float(inv[i])
        c, s = math.cos(th), math.sin(th)
        M[a, a], M[a, b], M[b, a], M[b, b] = c, -s, s, c
    M[:R, :R] *= spec.attention_scaling
    return M


def rotate_ref(x: torch.Tensor, pos: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """x [B, H, S, D] (any dtype) -> float64 s * R_pos x, pos [S] or [B, S]; one explicit matrix per position."""
    return _per_position_ref(x, pos, lambda p: rotation_matrix_ref(p, spec))


def unrotate_ref(x: torch.Tensor, pos: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Inverse of rotate_ref via the explicit matrix inverse."""
    return _per_position_ref(x, pos, lambda p: torch.linalg.inv(rotation_matrix_ref(p, spec)))


def _per_position_ref(x: torch.Tensor, pos: torch.Tensor, matrix) -> torch.Tensor:
    """x [B, H, S, D] -> float64 x @ matrix(pos).T per (batch, position); pos [S] or [B, S]; matrix(int) -> [D, D]."""
    x = x.double()
    B, H, S, D = x.shape
    pos = (pos if pos.dim() == 2 else pos[None]).expand(B, S)
    out = torch.empty_like(x)
    for b in range(B):
        for j in range(S):
            out[b, :, j] = x[b, :, j] @ matrix(int(pos[b, j])).T
    return out


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None,
               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float64. q [B, Hq, S, D], k/v [B, H, T, D] (GQA: Hq % H == 0), allowed [B|1, 1|Hq, S, T].

    Returns (out [B, Hq, S, D], lse [B, Hq, S]) where lse = log sum_j exp(score_j) over allowed keys.
    """
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    w = torch.exp(s - lse[..., None])
    return w @ v, lse


def decode_raw_ref(q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, spec: RopeSpec,
                   allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    """What the fused raw-key decode kernel computes, in float64: q [B, Hq, D] (one rotated query per row) attending
    raw keys k_raw [B, H, T, D] rotated to pos [B, T] by explicit matrices, values v; allowed [B, T] bool or None.
    Returns [B, Hq, D]."""
    k = rotate_ref(k_raw, pos, spec)
    out, _ = attend_ref(q[:, :, None], k, v, None if allowed is None else allowed[:, None, None], scale)
    return out[:, :, 0]


def decode_rows_ref(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], poss: list[torch.Tensor],
                    spec: RopeSpec, scale: float) -> torch.Tensor:
    """What the paged raw-key decode kernel computes, in float64: row b's query q[b] [Hq, D] (rotated) attending its
    raw keys ks[b] [H, s_b, D] rotated to poss[b] [s_b] by explicit matrices, values vs[b] (rows of any lengths; a
    row without tokens gives 0). Returns [B, Hq, D]."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, (k, v, pos) in enumerate(zip(ks, vs, poss)):
        if pos.numel():
            out[b] = decode_raw_ref(q[b:b + 1], k[None], v[None], pos[None], spec, None, scale)[0]
    return out


def dequant_q8_ref(codes: torch.Tensor, rows: torch.Tensor, ks: torch.Tensor, kt: torch.Tensor, nq: int,
                   vcodes: torch.Tensor, vs: torch.Tensor, vt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [B, H, N, D] float64 of int8 storage: slot j < nq has key codes[j] * ks[rows[j]] and value
    vcodes[j] * vs[j]; a tail slot j >= nq has key kt[j - nq] and value vt[j - nq] (one slot at a time)."""
    N = codes.shape[2]
    k = torch.empty(codes.shape, dtype=torch.float64)
    v = torch.empty(vcodes.shape, dtype=torch.float64)
    for j in range(N):
        if j < nq:
            k[:, :, j] = codes[:, :, j].double() * ks[:, :, int(rows[j])].double()
            v[:, :, j] = vcodes[:, :, j].double() * vs[:, :, j].double()
        else:
            k[:, :, j], v[:, :, j] = kt[:, :, j - nq].double(), vt[:, :, j - nq].double()
    return k, v


def decode_q8_ref(q: torch.Tensor, codes: torch.Tensor, rows: torch.Tensor, ks: torch.Tensor, kt: torch.Tensor,
                  nq: int, vcodes: torch.Tensor, vs: torch.Tensor, vt: torch.Tensor, pos: torch.Tensor,
                  spec: RopeSpec, allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    """What the int8 decode kernel computes, in float64: `dequant_q8_ref` then `decode_raw_ref`. Shapes as
    `kvpos._kernels.decode_q8_kernel`."""
    k, v = dequant_q8_ref(codes, rows, ks, kt, nq, vcodes, vs, vt)
    return decode_raw_ref(q.double(), k, v, pos, spec, allowed, scale)


def ape_merge_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_ctx: torch.Tensor, allowed: torch.Tensor,
                  temperature: float, scale: float, sm_scale: float | None = None) -> torch.Tensor:
    """APE attention written from the formula, float64.

    Context part: scores / T -> (O_C, LSE_C); other part: plain scores -> (O_O, LSE_O);
    [w_C, w_O] = softmax([S * T * LSE_C, LSE_O]); out = w_C O_C + w_O O_O.
    is_ctx: [T] or [B, T] bool (which keys are context slots); allowed: [B|1, 1, S, T] bool.
    """
    sm = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    c = is_ctx.reshape(-1, 1, 1, is_ctx.shape[-1])
    ctx, oth = allowed & c, allowed & ~c
    o_c, lse_c = attend_ref(q, k, v, ctx, sm / temperature)
    o_o, lse_o = attend_ref(q, k, v, oth, sm)
    w = torch.softmax(torch.stack([scale * temperature * lse_c, lse_o]), 0)   # [2, B, Hq, S]
    w = torch.nan_to_num(w)
    return w[0][..., None] * torch.nan_to_num(o_c) + w[1][..., None] * torch.nan_to_num(o_o)


def windowed_score_ref(q_raw: torch.Tensor, k_raw: torch.Tensor, r: int, spec: RopeSpec) -> torch.Tensor:
    """Score of far keys at fixed distance r: q^T (s R_r)^T ... written as (s R_{t} q)^T (s R_{t-r} k) with t = r.

    q_raw [Hq, D] unrotated query, k_raw [T, H, D]... simplified to q_raw [D], k_raw [T, D]: returns [T] float64
    = (s R_r q) . (s R_0 k), i.e. the score the query at position p would give a key at p - r, for any p.
    """
    qr = rotation_matrix_ref(r, spec) @ q_raw.double()
    k0 = k_raw.double() @ rotation_matrix_ref(0, spec).T
    return k0 @ qr


def distance_attend_ref(q_raw: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor, dist: torch.Tensor,
                        keep: torch.Tensor, spec: RopeSpec, scale: float) -> torch.Tensor:
    """Attention with an explicit distance per (query, key): score = scale * (s R_d q) . (s R_0 k), the score of the
    key placed d positions before the query, softmax over `keep`. q_raw [B, Hq, S, D] unrotated queries, k_raw /
    v [B, H, T, D] (GQA: Hq % H == 0), dist [B|1, S, T] int64, keep [B|1, S, T] bool. Returns float64 [B, Hq, S, D]
    (rows with nothing kept are 0)."""
    q, k, v = q_raw.double(), k_raw.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    B, Hq, S, _ = q.shape
    dist, keep = dist.expand(B, S, k.shape[2]), keep.expand(B, S, k.shape[2])
    k0 = k @ rotation_matrix_ref(0, spec).T
    s = torch.full((B, Hq, S, k.shape[2]), float("-inf"), dtype=torch.float64)
    for d in torch.unique(dist[keep]).tolist():
        at = (dist == d) & keep                                              # [B, S, T]
        qd = q @ rotation_matrix_ref(int(d), spec).T
        s = torch.where(at[:, None], (qd @ k0.transpose(-1, -2)) * scale, s)
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v


def scaled_attend_ref(q_raw: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      k_pos: torch.Tensor, ratios: torch.Tensor, spec: RopeSpec, scale: float,
                      allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head position scales in float64, from explicit rotation matrices: query head h rotates its query at
    q_pos / ratios[h] and its group's key at k_pos / ratios[h]. q_raw [B, Hq, S, D], k_raw / v [B, H, T, D],
    q_pos [B, S], k_pos [B, T], ratios [Hq], allowed [B|1, 1, S, T]. Returns float64 [B, Hq, S, D]."""
    q, k, v = q_raw.double(), k_raw.double(), v.double()
    B, Hq, S, _ = q.shape
    g = Hq // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    qr, kr = torch.empty_like(q), torch.empty_like(k)
    for b in range(B):
        for h in range(Hq):
            r = float(ratios[h])
            for i in range(S):
                qr[b, h, i] = rotation_matrix_ref(float(q_pos[b, i]) / r, spec) @ q[b, h, i]
            for j in range(k.shape[2]):
                kr[b, h, j] = rotation_matrix_ref(float(k_pos[b, j]) / r, spec) @ k[b, h, j]
    s = (qr @ kr.transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def decode_heads_ref(q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor, kpos: torch.Tensor,
                     head_table: torch.Tensor, seg: torch.Tensor | None, spec: RopeSpec,
                     allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    """What the read-time position-map decode kernel computes, in float64, one explicit matrix per (head, key):
    query head h rotates key j of its group to the (possibly fractional) position kpos[head_table[h], b, j] and
    scores it with its query variant q[b, h, seg[b, j]]. q [B, Hq, V, D] rotated, k_raw / v [B, H, N, D],
    kpos [Rt, B|1, N] float, head_table [Hq] ints, seg [B|1, N] ints or None (variant 0), allowed [B, N] or
    [B, Hq, N] (per query head) bool or None. Returns [B, Hq, D]."""
    B, Hq, V, D = q.shape
    H, N = k_raw.shape[1], k_raw.shape[2]
    g = Hq // H
    out = torch.zeros(B, Hq, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            t = int(head_table[h])
            s = torch.empty(N, dtype=torch.float64)
            for j in range(N):
                p = float(kpos[t, b if kpos.shape[1] > 1 else 0, j])
                kj = rotation_matrix_ref(p, spec) @ k_raw[b, h // g, j].double()
                var = 0 if seg is None else int(seg[b if seg.shape[0] > 1 else 0, j])
                s[j] = float(q[b, h, var].double() @ kj) * scale
            if allowed is not None:
                s = s.masked_fill(~(allowed[b, h] if allowed.dim() == 3 else allowed[b]), float("-inf"))
            if bool(torch.isinf(s).all()):
                continue
            out[b, h] = torch.softmax(s, -1) @ v[b, h // g].double()
    return out


def segment_mass_ref(q_raw: torch.Tensor, k_raw: torch.Tensor, doc: torch.Tensor, n: int,
                     allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    """What the importance kernel computes, in float64, one query row at a time: for query head h (reading kv head
    h // (Hq / H)) the softmax of scale * q.k (no rotation) over the slots j with doc[b, j] >= 0 that `allowed`
    shows, summed per document. q_raw [B, Hq, D], k_raw [B, H, N, D], doc [B|1, N] ints in [-1, n), allowed
    [B, N] or [B, Hq, N] bool or None. Returns [B, Hq, n] float64 (rows that see no document slot: zeros)."""
    B, Hq, D = q_raw.shape
    H, N = k_raw.shape[1], k_raw.shape[2]
    g = Hq // H
    out = torch.zeros(B, Hq, n, dtype=torch.float64)
    for b in range(B):
        d = doc[b if doc.shape[0] > 1 else 0].long()
        for h in range(Hq):
            ok = d >= 0
            if allowed is not None:
                ok = ok & (allowed[b, h] if allowed.dim() == 3 else allowed[b])
            if not bool(ok.any()):
                continue
            s = (k_raw[b, h // g].double() @ q_raw[b, h].double()) * scale
            p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1)
            for j in range(N):
                if bool(ok[j]):
                    out[b, h, int(d[j])] += p[j]
    return out
