"""Read-time position maps: per (layer, query head) scales of positions (Ms-PoE), applied to raw keys on read.

Letters: B batch · H kv heads · Hq query heads (G = Hq / H) · q queries · N keys · D head_dim · R rotary dims ·
L layers.

Query head h of a layer with ratio r_h reads a query at position p and a key at position t as

    s^2 (R_{p / r_h} q)_rot . (R_{t / r_h} k)_rot + q_pass . k_pass          (s: the spec's attention scaling)

that is, at the fractional distance (p - t) / r_h (every RoPE frequency of that head divided by r_h). Each query
head rotates its own copy of its group's raw key head, so grouped-query attention stays exact (Ms-PoE's released
code rotates a shared key head with one query head's ratio); the copies live in one call's scratch, never in the
cache. r_h = 1 is plain RoPE. Float64 oracle: kvpos.reference.scaled_attend_ref.

Ms-PoE ("Found in the Middle", NeurIPS 2024): ratios r_min + (r_max - r_min) * k / Hq for k = 0 .. Hq-1 on layers
>= 2, the ratio index of each head set by its position-awareness score (`position_awareness`: the share of keys the
last prompt row, scored without RoPE, attends to more than 3x the mean). Which head gets which index is
`assign_ratios`; see its docstring for the released code's gather.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import fail
from .rope import RopeSpec, _pairs, cos_sin
from .window import WindowConfig

__all__ = ["HeadScales", "ms_poe_scales", "scaled_cos_sin", "turned_cos_sin", "factored_tables", "factor_bits",
           "rotate_heads", "scaled_attend", "position_awareness", "assign_ratios", "segment_importance", "pine_shifts",
           "offset_attend", "shifted_window", "softmax_mass", "pair_importance", "pair_shifts", "window_decode_map",
           "MS_POE_MIN", "MS_POE_MAX", "MS_POE_FIRST_LAYER"]

MS_POE_MIN, MS_POE_MAX, MS_POE_FIRST_LAYER = 1.2, 1.8, 2       # the released scripts' values


@dataclass(frozen=True)
class HeadScales:
    """Position scale ratios r [L, Hq] (float, > 0): query head h of layer l reads positions p / r[l, h]."""

    ratios: torch.Tensor

    def __post_init__(self) -> None:
        r = self.ratios
        if not isinstance(r, torch.Tensor) or not r.is_floating_point() or r.dim() != 2:
            got = f"{r.dtype} tensor of shape {list(r.shape)}" if isinstance(r, torch.Tensor) else type(r).__name__
            fail("HeadScales ratios", "a float tensor [L, Hq] (per layer and query head)", got, exc=TypeError)
        if not bool(torch.isfinite(r).all()) or not bool((r > 0).all()):
            fail("HeadScales ratios", "finite entries > 0", f"min {float(r.min()):.3g}, max {float(r.max()):.3g}")
        object.__setattr__(self, "ratios", r.detach().double().clone())

    def check(self, layers: int, q_heads: int) -> "HeadScales":
        """Raises unless the ratios are [layers, q_heads]."""
        if tuple(self.ratios.shape) != (layers, q_heads):
            fail("HeadScales ratios", f"shape [{layers}, {q_heads}] (the model's layers, query heads)",
                 list(self.ratios.shape))
        return self

    def for_layer(self, i: int) -> torch.Tensor:
        """[Hq] float64 ratios of layer i."""
        return self.ratios[i]

    def is_identity(self, i: int | None = None) -> bool:
        """Whether every ratio (of layer i, or of all layers) is exactly 1."""
        r = self.ratios if i is None else self.ratios[i]
        return bool((r == 1).all())


def ms_poe_scales(layers: int, q_heads: int, r_min: float = MS_POE_MIN, r_max: float = MS_POE_MAX,
                  first_layer: int = MS_POE_FIRST_LAYER, index: torch.Tensor | None = None) -> HeadScales:
    """Ms-PoE's ratio table: on layers >= first_layer, head h gets r_min + (r_max - r_min) * index[h] / q_heads;
    index: [Hq] or [L, Hq] ints, a permutation of 0..Hq-1 per layer (default: the head's own number). Layers
    below first_layer keep 1."""
    for what, v in (("layers", layers), ("q_heads", q_heads), ("first_layer", first_layer)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if what == "first_layer" else 1):
            fail(f"ms_poe_scales {what}", "an int >= 0" if what == "first_layer" else "an int >= 1", v)
    if not (isinstance(r_min, (int, float)) and isinstance(r_max, (int, float)) and 0 < r_min <= r_max
            and math.isfinite(r_max)):
        fail("ms_poe_scales r_min, r_max", "finite floats with 0 < r_min <= r_max", (r_min, r_max))
    idx = torch.arange(q_heads) if index is None else torch.as_tensor(index)
    idx = idx.expand(layers, q_heads) if idx.dim() == 1 else idx
    if tuple(idx.shape) != (layers, q_heads) or idx.is_floating_point() or not bool(
            (idx.sort(-1).values == torch.arange(q_heads)).all()):
        fail("ms_poe_scales index", f"a permutation of 0..{q_heads - 1} ([Hq] or [L, Hq] ints)",
             f"{idx.dtype} tensor of shape {list(idx.shape)}")
    r = r_min + (r_max - r_min) * idx.double() / q_heads
    r[:first_layer] = 1.0
    return HeadScales(r)


def scaled_cos_sin(pos: torch.Tensor, ratios: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, Hq, S, R/2] float32 of the angles (pos / r_h) * inv_freq, computed in float64; pos [B, S]
    int64, ratios [Hq]."""
    inv = spec.inv_freq.to(device=pos.device, dtype=torch.float64)
    scaled = pos.to(torch.float64)[:, None, :] / ratios.to(device=pos.device, dtype=torch.float64)[None, :, None]
    ang = scaled[..., None] * inv
    return ang.cos().float(), ang.sin().float()


def turned_cos_sin(pos: torch.Tensor, ratios: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, Hq, S, R/2] float32 that turn a query the model rotated at pos (its angles pos * inv_freq in
    the spec's angle dtype, as transformers computes them) to pos / r_h in one rotation (scale 1: the attention
    scaling stays as the model applied it): the angles (pos / r_h) * inv_freq minus the model's, in float64. One
    rotation where unrotating and rotating again at the scaled positions (scaled_cos_sin) took two. pos [B, S]
    int64, ratios [Hq]."""
    inv = spec.inv_freq.to(device=pos.device, dtype=torch.float64)
    scaled = pos.to(torch.float64)[:, None, :] / ratios.to(device=pos.device, dtype=torch.float64)[None, :, None]
    model = (pos.to(spec.angle_dtype)[..., None] * spec.inv_freq.to(device=pos.device, dtype=spec.angle_dtype))
    ang = scaled[..., None] * inv - model.to(torch.float64)[:, None]
    return ang.cos().float(), ang.sin().float()


def factor_bits(rotary_dim: int) -> int:
    """log2 of the rows F of the factored tables' low part for rotary width R: a key turns by row t mod F, the query
    back by row F + t // F (once per run of F keys). 3 (F = 8) for R <= 64, 4 (F = 16) above: the fastest on
    SmolLM2's R = 64 and Gemma 3's R = 256 (bench/bench_posmap.py; 64 rows left SmolLM2's group of 3 heads reading
    48 KB of low rows per key, past a core's L1)."""
    return 3 if rotary_dim <= 64 else 4


def factored_tables(ratios: torch.Tensor, positions: int, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The factored rotation tables of the position-map decode kernel (`kvpos._posmap_kernels.decode_heads_kernel` with
    fpos) for positions 0 .. positions-1 at scales p -> p / r, F = 2 ** factor_bits(R): cos, sin
    [Rt, F + ceil(positions / F), R/2] float32, row l < F the angle (l / r) * inv_freq, row F + m the angle
    (F m / r) * inv_freq times the attention scaling (computed in float64, rounded once). ratios [Rt] > 0."""
    if not isinstance(positions, int) or positions < 1:
        fail("factored_tables positions", "an int >= 1 (one past the largest slot position)", positions)
    F = 1 << factor_bits(spec.rotary_dim)
    r = torch.as_tensor(ratios, dtype=torch.float64).reshape(-1, 1, 1)
    inv = spec.inv_freq.to(torch.float64)
    steps = torch.cat([torch.arange(F, dtype=torch.float64),
                       float(F) * torch.arange((positions + F - 1) // F, dtype=torch.float64)])
    ang = steps[None, :, None] / r * inv
    s = torch.ones(steps.shape[0], 1, dtype=torch.float64)
    s[F:] = spec.attention_scaling
    return (ang.cos() * s).float(), (ang.sin() * s).float()


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec, scale: float
                 ) -> torch.Tensor:
    """x [B, Hq, S, D] turned per head by cos/sin [B|1, Hq, S, R/2], rotary dims times `scale`: float32, new."""
    xf = x.float()
    out = xf.clone()
    a, b = _pairs(xf, spec)
    oa, ob = _pairs(out, spec)
    oa.copy_((a * cos - b * sin) * scale)
    ob.copy_((b * cos + a * sin) * scale)
    return out


def scaled_attend(q_raw: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                  k_pos: torch.Tensor, ratios: torch.Tensor, spec: RopeSpec, sm_scale: float,
                  allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of raw queries q_raw [B, Hq, q, D] at q_pos [B, q] over raw keys k_raw / values v [B, H, N, D] at
    k_pos [B, N], query head h at positions / ratios[h] (module docstring). allowed: [B|1, 1, q, N] bool or None.
    Returns float32 [B, Hq, q, Dv]; rows with no allowed key are 0."""
    B, Hq, Lq, _ = q_raw.shape
    H = k_raw.shape[1]
    if Hq % H or ratios.shape != (Hq,):
        fail("scaled_attend", f"Hq divisible by H and ratios [Hq={Hq}]",
             f"H={H}, ratios of shape {list(ratios.shape)}")
    g = Hq // H
    s = spec.attention_scaling
    q = rotate_heads(q_raw, *scaled_cos_sin(q_pos, ratios, spec), spec, s)
    k = rotate_heads(k_raw.repeat_interleave(g, 1), *scaled_cos_sin(k_pos, ratios, spec), spec, s)
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float().repeat_interleave(g, 1),
                                                           attn_mask=allowed, scale=sm_scale)   # fused, no [q, N]
    return out if allowed is None else out.nan_to_num(0.0) * allowed.any(-1, keepdim=True)


def position_awareness(q_raw_last: torch.Tensor, k_raw: torch.Tensor, allowed_last: torch.Tensor | None = None,
                       sm_scale: float | None = None) -> torch.Tensor:
    """Ms-PoE's head score: the share of keys that the last prompt row attends to more than 3x the mean, with the
    scores taken WITHOUT RoPE. q_raw_last [B, Hq, D], k_raw [B, H, N, D], allowed_last [B, N] bool. Returns
    [B, Hq] float32 in [0, 1] (the released code negates it and sorts ascending: highest share first)."""
    B, Hq, D = q_raw_last.shape
    g = Hq // k_raw.shape[1]
    sm = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    s = (q_raw_last.float()[:, :, None] @ k_raw.float().repeat_interleave(g, 1).transpose(-1, -2))[:, :, 0] * sm
    ok = torch.ones(B, 1, s.shape[-1], dtype=torch.bool) if allowed_last is None else allowed_last[:, None]
    a = torch.softmax(s.masked_fill(~ok, float("-inf")), -1)
    mean = a.sum(-1, keepdim=True) / ok.sum(-1, keepdim=True)
    return ((a > 3 * mean) & ok).sum(-1).float() / ok.sum(-1).float()


def assign_ratios(score: torch.Tensor, rule: str = "rank") -> torch.Tensor:
    """Ratio index [.., Hq] (a permutation) per head from position-awareness scores [.., Hq].

    "rank": the head with the highest score gets index 0 (the smallest ratio, nearest plain RoPE), the next index 1,
    and so on: the paper's description (heads that use positions most keep them most). "released": Ms-PoE's
    released code, which gathers the ratio table with the argsort itself (head i gets index order[i], order =
    heads by descending score), not with its inverse."""
    order = torch.argsort(-score, dim=-1, stable=True)
    if rule == "released":
        return order
    if rule != "rank":
        fail("assign_ratios rule", "'rank' or 'released'", repr(rule))
    return torch.argsort(order, dim=-1)


# ---------------------------------------------------------------------------------------------------------------------
# per-(head, query, segment) offsets: PINE's importance-sorted document positions
# ---------------------------------------------------------------------------------------------------------------------
def segment_importance(q_raw: torch.Tensor, k_raw: torch.Tensor, doc: torch.Tensor, n_docs: int, sm_scale: float,
                       allowed: torch.Tensor | None = None) -> torch.Tensor:
    """PINE's importance of each document to each query row and head, WITHOUT RoPE: the softmax of raw q.k over the
    document slots only, summed per document and divided by its size. q_raw [B, Hq, q, D], k_raw [B, H, N, D],
    doc [B, N] int64 (the document of each slot, -1 for the others), allowed [B|1, 1, q, N] or None. Returns
    float32 [B, Hq, q, n_docs]."""
    B, Hq, Lq, D = q_raw.shape
    H, N = k_raw.shape[1], k_raw.shape[2]
    g = Hq // H
    # the G query heads of a group read their shared key head in one product (no G-fold key copy)
    s = (q_raw.float().reshape(B, H, g * Lq, D) @ k_raw.float().transpose(-1, -2)).reshape(B, Hq, Lq, N) * sm_scale
    ok = (doc >= 0)[:, None, None, :]
    if allowed is not None:
        ok = ok & allowed
    a = torch.softmax(s.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0)
    onehot = torch.nn.functional.one_hot(doc.clamp_min(0), n_docs).float() * (doc >= 0)[..., None]   # [B, N, n]
    return (a @ onehot[:, None]) / onehot.sum(1)[:, None, None].clamp_min(1)


def pine_shifts(importance: torch.Tensor, start: torch.Tensor, size: torch.Tensor, end: torch.Tensor
                ) -> torch.Tensor:
    """How far each document's positions move for each query row and head: the documents sorted by importance
    (descending; ties by document index), the most important ending at `end`, the next right before it, and so on.
    importance [B, Hq, q, n]; start / size [B, n] int64 (each document's first position and token count, as
    stored); end [B] int64. Returns int64 [B, Hq, q, n]: new first position - start."""
    order = torch.argsort(-importance, dim=-1, stable=True)                              # rank -> document
    sz = size[:, None, None, :].expand_as(importance).gather(-1, order)                 # sizes in rank order
    new_end = end[:, None, None, None] - (torch.cumsum(sz, -1) - sz)                     # ends in rank order
    shift_by_rank = new_end - sz - start[:, None, None, :].expand_as(importance).gather(-1, order)
    return torch.empty_like(shift_by_rank).scatter_(-1, order, shift_by_rank)


def softmax_mass(q: torch.Tensor, k: torch.Tensor, group: torch.Tensor, n: int, sm_scale: float,
                 allowed: torch.Tensor) -> torch.Tensor:
    """Per query row and head, the softmax of sm_scale * q.k over the allowed keys that belong to a group, summed
    per group (segment_importance before its division by the sizes, for many rows). q [B, Hq, q, D] float32, k
    [B, Hq, N, D] float32, group [B, N] int64 in [-1, n) (-1: in no group, not in the softmax), allowed bool
    [B, 1|Hq, q, N] (a row with no allowed group key gives zeros). One fused attention (torch's
    scaled_dot_product_attention) with the groups' one-hot as the values, padded to the head width (the shape its
    fused kernel takes; no [q, N] score tensor is made). Float32 [B, Hq, q, n]; float64 reference:
    kvpos.reference.segment_mass_ref, row by row."""
    B, Hq, Lq, D = q.shape
    W = max(D, n)
    ok = allowed & (group >= 0)[:, None, None, :]
    onehot = torch.nn.functional.one_hot(group.clamp_min(0), W).float()                       # [B, N, W]
    mass = torch.nn.functional.scaled_dot_product_attention(
        q, k, onehot[:, None].expand(B, Hq, -1, W), attn_mask=ok, scale=sm_scale)[..., :n]
    return mass.nan_to_num(0.0) * ok.any(-1, keepdim=True)


def pair_importance(q_raw: torch.Tensor, k_raw: torch.Tensor, row_doc: torch.Tensor, key_doc: torch.Tensor, n_docs: int,
                    sm_scale: float) -> torch.Tensor:
    """PINE's document-phase importance, WITHOUT RoPE: each document row's softmax of raw q.k over the keys of the
    OTHER documents, averaged per key document (summed over its keys, divided by its size) and summed over the rows
    of each query document. q_raw [B, Hq, q, D] (row r of document row_doc[b, r], -1 for rows of no document),
    k_raw [B, H, N, D] with key_doc [B, N] (-1: not a document key). Returns float32 [B, Hq, n, n]: entry [i, j]
    how much the rows of document i read document j (0 on the diagonal). The softmax mass by `softmax_mass`."""
    Hq = q_raw.shape[1]
    g = Hq // k_raw.shape[1]
    other = (key_doc[:, None, :] >= 0) & (key_doc[:, None, :] != row_doc[:, :, None])          # [B, q, N]
    mass = softmax_mass(q_raw.float(), k_raw.float().repeat_interleave(g, 1), key_doc, n_docs, sm_scale,
                        other[:, None])                                                        # [B, Hq, q, n]
    size = torch.nn.functional.one_hot(key_doc.clamp_min(0), n_docs).mul((key_doc >= 0)[..., None]).sum(1)
    per_doc = mass / size[:, None, None].clamp_min(1)                                          # [B, Hq, q, n]
    rd = torch.nn.functional.one_hot(row_doc.clamp_min(0), n_docs).float() * (row_doc >= 0)[..., None]   # [B, q, n]
    return rd.transpose(1, 2)[:, None] @ per_doc                                              # [B, Hq, n, n]


def pair_shifts(importance: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """PINE's document phase: the rows of document i rank the documents, i itself first, the others by importance
    (descending; ties by document index), and document j's keys are read `shift[.., i, j]` positions earlier: the
    sizes of the documents ranked before j (0 for i). importance [B, Hq, n, n] (pair_importance), size [B, n]
    int64. Returns int64 [B, Hq, n, n]."""
    n = importance.shape[-1]
    eye = torch.eye(n, dtype=torch.bool, device=importance.device)
    order = torch.argsort(-importance.masked_fill(eye, float("inf")), dim=-1, stable=True)      # rank -> document
    sz = size[:, None, None, :].expand_as(importance).gather(-1, order)
    before = torch.cumsum(sz, -1) - sz
    return torch.empty_like(before).scatter_(-1, order, before)


def shifted_window(q_pos: torch.Tensor, k_pos: torch.Tensor, doc: torch.Tensor, shift: torch.Tensor,
                   window: int) -> torch.Tensor:
    """A sliding window over the positions keys are READ at, for per-head document shifts: key t is inside the
    window of query row r and head h when q_pos[b, r] - (k_pos[b, t] + shift[b, h, r, doc[b, t]]) < window
    (slots with doc -1 at their own positions), the rule transformers applies to slot distances. Under a
    re-positioning policy (PINE) the window must follow the positions the keys are read at, or which documents a
    sliding layer sees depends on their order in the cache. q_pos [B, q], k_pos [B, N] int64, doc [B, N] int64,
    shift [B, Hq, q, n] int64 (n >= 1), window >= 1. Returns bool [B, Hq, q, N]."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        fail("shifted_window window", "an int >= 1 (the layer's sliding window)", window)
    B, Hq, Lq, _ = shift.shape
    N = k_pos.shape[1]
    pick = doc.clamp_min(0)[:, None, None, :].expand(B, Hq, Lq, N)
    moved = torch.where((doc >= 0)[:, None, None, :], shift.gather(-1, pick), torch.zeros_like(pick))
    read_at = k_pos.long()[:, None, None, :] + moved
    return q_pos.long()[:, None, :, None] - read_at < window


def offset_attend(q_h: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor, doc: torch.Tensor, shift: torch.Tensor,
                  spec: RopeSpec, sm_scale: float, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of rotated queries q_h [B, Hq, q, D] over keys rotated at their slot positions k_rot / values v
    [B, H, N, D], document d's keys read `shift[b, h, row, d]` positions later (the query turned back by the shift
    instead: (R_{p - s} q) . (R_t k) is the score at distance p - (t + s)); slots with doc -1 at their own
    positions. doc [B, N] int64, shift [B, Hq, q, n] int64, allowed [B|1, 1, q, N]. Returns float32 [B, Hq, q, Dv]."""
    B, Hq, Lq, D = q_h.shape
    g = Hq // k_rot.shape[1]
    n = shift.shape[-1]
    k = k_rot.float().repeat_interleave(g, 1)
    qx = q_h.float()[:, :, :, None, :].expand(B, Hq, Lq, n, D).reshape(B, Hq, Lq * n, D)
    c, s = cos_sin((-shift).reshape(B, Hq, Lq * n), spec)
    turned = rotate_heads(qx, c, s, spec, 1.0)
    s_doc = (turned @ k.transpose(-1, -2)).view(B, Hq, Lq, n, -1)                       # [B, Hq, q, n, N]
    pick = doc.clamp_min(0)[:, None, None, None, :].expand(B, Hq, Lq, 1, doc.shape[1])
    scores = torch.where((doc >= 0)[:, None, None, :], s_doc.gather(3, pick)[:, :, :, 0],
                         q_h.float() @ k.transpose(-1, -2)) * sm_scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v.float().repeat_interleave(g, 1)


# ---------------------------------------------------------------------------------------------------------------------
# piecewise distance maps: a length policy's (position, kept) per key for one decode query
# ---------------------------------------------------------------------------------------------------------------------
def window_decode_map(cfg: WindowConfig, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For the decode query in the last of N slots (positions pos [B, N] int64, the query's pos[:, -1] = p): the
    position each key is read at and whether it is read, as `kvpos.window.windowed_attend` defines them, or None
    where the policy selects keys by score (a top-k over part of the far slots: not a fixed map).

    Window region (the first cfg.sinks slots and the last cfg.window): true positions, except sinks outside the
    window, read at p - sink_distance (an int: LM-Infinite's ceiling) or p - (sinks + window - 1 - j) for sink j
    ("renumbered": StreamingLLM). Far slots: unread (selector "none"); else at t + shift (far_scores "shifted":
    STRING), p - distance ("windowed") or t ("exact", every far key selected). true_distance: every position true.
    Returns (positions [B, N] int64, kept [B, N] bool); reading keys at these positions with plain attention is the
    policy (one rotation table per step, shared by the layers)."""
    B, N = pos.shape
    j = torch.arange(N, device=pos.device)
    exact = (j < cfg.sinks) | (j > N - 1 - cfg.window)
    n_far = int((~exact).sum())
    if cfg.selector != "none" and cfg.k_for(n_far) < n_far:
        return None
    p = pos[:, -1:]
    out = pos.clone()
    kept = torch.ones(B, N, dtype=torch.bool, device=pos.device)
    if cfg.true_distance:
        return out, kept
    far = ~exact
    if cfg.selector == "none":
        kept[:, far] = False
    elif cfg.far_scores == "shifted":
        out[:, far] = pos[:, far] + cfg.shift
    elif cfg.far_scores == "windowed":
        out[:, far] = (p - cfg.distance).expand(B, n_far)
    sink_far = (j < cfg.sinks) & (j <= N - 1 - cfg.window)
    d = cfg.sink_distance
    if d == "renumbered":
        out[:, sink_far] = p - (cfg.sinks + cfg.window - 1 - j[sink_far])
    elif d is not None:
        out[:, sink_far] = (p - d).expand(B, int(sink_far.sum()))
    return out, kept
