"""Windowed-RoPE retrieval attention as pure functions: one unrotated key store serves every query position.

Letters: B batch · H kv heads · Hq query heads (G = Hq / H) · q queries · N cached keys · D head_dim · F far slots ·
W local slots (sinks + window).

For a query at position p (A²ATS, arXiv 2502.12665; InfLLM / ReRoPE use the same fixed-distance idea):

    sinks  = the first `sinks` slots            exact score at true positions
    window = the last `window` slots before it  exact score at true positions
    far    = the rest                           score as if the key sat r positions before the query:
             q_h . (s R_{p-r} k_raw) = s * (R_{r-p} q_h) . k_raw      (only the query is rotated)
             these windowed scores SELECT the far keys; the selected keys are attended with their true-position
             scores (far_scores="exact", A²ATS) or with the windowed ones (far_scores="windowed", InfLLM /
             ReRoPE style, which never shows the model a distance > r: for contexts beyond the training window)

Of the far slots only the top `budget` (a fraction of F, or an int) are attended, per KV head (the score of a key
for a KV head = max over its query heads). The exact part and the far part are merged through their log-sum-exps.

Selectors:  "all"    every far slot (no retrieval; with true_distance=True this is full attention)
            "exact"  exact windowed scores of all far raw keys, top-k
            "index"  top-k by scores against an int8 copy of the raw keys (per-token absmax scale): one pass over
                     1 byte per key dim (fused C scoring kernel when built)
            "blocks" per-block min/max bounds of raw keys (Quest-style), top blocks
            "none"   sinks + window only (StreamingLLM without its re-positioning)
            "store"  like "index"; decode steps of the engine glue read a compact FarStore (needs far_scores="windowed")
Compact form for decode: `FarStore` (int8 raw keys + fp16 values of the far slots, which double as the index) and
`sparse_decode_attention` (one query: local exact + top-k far, one softmax). Recall and quality: results/.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import fail
from .quant import int8_codes
from ._kernels import score_int8_kernel, topk_indices, transpose_int8_blocks
from .rope import RopeSpec, _apply, cos_sin

__all__ = ["WindowConfig", "SELECTORS", "lm_infinite", "streaming_llm", "string_shift", "far_query", "window_regions", "windowed_attend", "quantize_keys",
           "int8_scores", "block_bounds", "block_upper_bounds", "BlockIndex", "FarStore", "sparse_decode_attention",
           "index_recall"]

SELECTORS = ("all", "exact", "index", "blocks", "none", "store")


@dataclass(frozen=True)
class WindowConfig:
    """sinks/window in slots, distance r in positions, budget = fraction of far slots (float) or a count (int).

    true_distance: score far keys at their real positions (testing: equals full attention).
    far_scores: attention logits of the SELECTED far keys, "exact" (true positions, A²ATS) or "windowed" (fixed
        distance r, InfLLM/ReRoPE style: no distance > r is ever seen).
    dense_layers: the first n layers attend densely (Quest and A²ATS leave layers 0-1 dense).
    sink_distance: the distance sinks OUTSIDE a query's window are scored at: None (their true one), an int L (every
        sink at distance L: LM-Infinite's distance ceiling), or "renumbered" (sink j at sinks + window - 1 - j, its
        distance once the middle is evicted and the cache renumbered: StreamingLLM). Sinks inside the window and
        the window's keys keep their true distances.
    shift: with far_scores="shifted", far keys are scored AND attended at their true distance minus `shift` (STRING:
        window = S, shift = S - W, so a distance d >= S is read as d - S + W).
    The length policies are named constructors: lm_infinite(), streaming_llm(), string_shift().
    """

    sinks: int = 8
    window: int = 64
    distance: int = 2048
    budget: float | int = 0.05
    selector: str = "exact"
    block: int = 16
    true_distance: bool = False
    far_scores: str = "exact"
    dense_layers: int = 0
    sink_distance: int | str | None = None
    shift: int = 0

    def __post_init__(self) -> None:
        for what in ("sinks", "window", "distance", "block", "dense_layers"):
            v = getattr(self, what)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if what == "block" else 0):
                fail(f"WindowConfig.{what}", "an int >= 0" if what != "block" else "an int >= 1", v)
        if self.selector not in SELECTORS:
            fail("WindowConfig.selector", f"one of {SELECTORS}", repr(self.selector))
        if self.far_scores not in ("exact", "windowed", "shifted"):
            fail("WindowConfig.far_scores", "'exact', 'windowed' or 'shifted'", repr(self.far_scores))
        if self.far_scores == "shifted" and self.selector not in ("all", "exact", "none"):
            fail("WindowConfig.selector", "'all', 'exact' or 'none' with far_scores='shifted' (the index selectors "
                 "score raw keys at a fixed distance)", repr(self.selector))
        if not isinstance(self.shift, int) or isinstance(self.shift, bool) or self.shift < 0:
            fail("WindowConfig.shift", "an int >= 0", self.shift)
        d = self.sink_distance
        if d is not None and d != "renumbered" and (not isinstance(d, int) or isinstance(d, bool) or d < 0):
            fail("WindowConfig.sink_distance", "None, an int >= 0 or 'renumbered'", repr(d))
        if self.selector == "store" and self.far_scores != "windowed":
            fail("WindowConfig.far_scores", "'windowed' with selector='store' (the far store attends the selected keys "
                 "at the fixed distance)", repr(self.far_scores))
        if not isinstance(self.true_distance, bool):
            fail("WindowConfig.true_distance", "a bool", type(self.true_distance).__name__, exc=TypeError)
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or b < 0 or (isinstance(b, float) and b > 1):
            fail("WindowConfig.budget", "a fraction in [0, 1] or an int count >= 0", b)

    def k_for(self, n_far: int) -> int:
        """How many of n_far far slots are attended."""
        if self.selector == "all":
            return n_far
        if self.selector == "none":
            return 0
        k = int(math.ceil(self.budget * n_far)) if isinstance(self.budget, float) else int(self.budget)
        return max(0, min(k, n_far))


def far_query(q_h: torch.Tensor, q_pos: torch.Tensor, spec: RopeSpec, distance: int) -> torch.Tensor:
    """The query turned by r - p (rotary dims times the attention scaling s, pass-through dims as they are): its
    dot product with a RAW key k equals the score of k placed `distance` positions before the query,
    s^2 (R_r q)_rot . k_rot + q_pass . k_pass. q_h [B, Hq, q, D] rotated at q_pos [B, q]; returns float32."""
    c, s = cos_sin((distance - q_pos).to(torch.long), spec)     # angles may be negative: cos/sin handle it
    return _apply(q_h.float(), c[:, None], s[:, None], spec, spec.attention_scaling)


def lm_infinite(local: int, n_global: int = 10, distance: int | None = None, top_k: float | int = 0
                ) -> WindowConfig:
    """LM-Infinite: a Lambda-shaped mask (the first `n_global` tokens and the last `local` ones) with the global
    tokens outside the window scored at distance `distance` (default `local`, the trained length); top_k > 0 adds
    that many (or that fraction of) middle tokens, chosen and scored at the same fixed distance."""
    d = local if distance is None else distance
    return WindowConfig(sinks=n_global, window=local, sink_distance=d, distance=d, budget=top_k,
                        selector="exact" if top_k else "none", far_scores="windowed")


def streaming_llm(window: int, sinks: int = 4) -> WindowConfig:
    """StreamingLLM: `sinks` first tokens + the last `window`, the middle not attended (evictable: nothing reads it),
    the sinks at the distance they would have once the cache is renumbered (window keys keep theirs; on a cache whose
    slots hold consecutive positions that is exactly StreamingLLM's renumbering)."""
    return WindowConfig(sinks=sinks, window=window, sink_distance="renumbered", selector="none")


def string_shift(shifted_offset: int, local: int = 128) -> WindowConfig:
    """STRING: every key at distance d >= shifted_offset is read at d - shifted_offset + local (well-trained
    distances reused for far keys), nearer keys at their own; all keys attended, no sinks. (STRING's logit
    temperature, x1.14, is not applied.)"""
    if not isinstance(local, int) or isinstance(local, bool) or not 0 <= local <= shifted_offset:
        fail("string_shift local", f"an int in [0, shifted_offset={shifted_offset}]", local)
    return WindowConfig(sinks=0, window=shifted_offset, far_scores="shifted", shift=shifted_offset - local,
                        selector="all")


def _turned(q_h: torch.Tensor, by: int, spec: RopeSpec) -> torch.Tensor:
    """q_h [B, Hq, q, D] turned by `by` positions (no scaling): float32."""
    c, s = cos_sin(torch.full(q_h.shape[:1] + q_h.shape[2:3], by, dtype=torch.long, device=q_h.device), spec)
    return _apply(q_h.float(), c[:, None], s[:, None], spec, 1.0)


def _sink_scores_(s: torch.Tensor, q_h: torch.Tensor, k_raw: torch.Tensor, q_pos: torch.Tensor, spec: RopeSpec,
                  cfg: WindowConfig, sm_scale: float, n_slots: int) -> None:
    """Rescore in place the sink columns (the first cfg.sinks) of s [B, H, G, q, C] for rows whose window does not
    reach them, at cfg.sink_distance (WindowConfig's docstring); the q rows are the last of `n_slots` slots."""
    B, H, g, Lq, _ = s.shape
    rows = torch.arange(n_slots - Lq, n_slots, device=s.device)
    by_distance: dict[int, torch.Tensor] = {}
    for j in range(min(cfg.sinks, n_slots)):
        out = (rows - j) >= cfg.window                                        # [q] this sink is outside the window
        if not bool(out.any()):
            continue
        d = cfg.sinks + cfg.window - 1 - j if cfg.sink_distance == "renumbered" else cfg.sink_distance
        if d not in by_distance:
            by_distance[d] = far_query(q_h, q_pos, spec, d).reshape(B, H, g * Lq, -1)
        sj = (by_distance[d] @ k_raw[:, :, j:j + 1].float().transpose(-1, -2)).view(B, H, g, Lq) * sm_scale
        s[..., j] = torch.where(out, sj, s[..., j])


def window_regions(N: int, Lq: int, cfg: WindowConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """exact [q, N] and far [q, N] bool masks for query rows at slots N-q .. N-1 (causal)."""
    qs = torch.arange(N - Lq, N, device=device)[:, None]
    ks = torch.arange(N, device=device)[None]
    causal = ks <= qs
    exact = causal & ((ks < cfg.sinks) | (ks > qs - cfg.window))
    return exact, causal & ~exact


def quantize_keys(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 keys and float32 per-token absmax scales: raw [..., T, D] -> (q [..., T, D] int8, scale [..., T])."""
    amax = raw.float().abs().amax(-1).clamp_min(1e-12)
    scale = amax / 127.0
    return int8_codes(raw, scale[..., None]), scale


def int8_scores(q: torch.Tensor, kq: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """Scores of float queries q [..., R, D] against int8 keys kq [..., F, D] with per-key scales [..., F]:
    [..., R, F]."""
    return (q.float() @ kq.float().transpose(-1, -2)) * k_scale.unsqueeze(-2)


def block_bounds(k_raw: torch.Tensor, block: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise (min, max) of keys [..., F, D] (times `scale`) over full blocks of `block` slots:
    each [..., F // block, D]."""
    F, D = k_raw.shape[-2], k_raw.shape[-1]
    nb = F // block
    kb = k_raw[..., : nb * block, :].float().reshape(*k_raw.shape[:-2], nb, block, D) * scale
    return kb.amin(-2), kb.amax(-2)


def block_upper_bounds(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> torch.Tensor:
    """Upper bound of q . k over each block: sum_d max(q_d min_d, q_d max_d) = relu(q) . max + min(q, 0) . min.
    q [..., R, D], mins/maxs [..., nb, D] -> [..., R, nb]."""
    qp = q.float().clamp_min(0)
    return qp @ maxs.transpose(-1, -2) + (q.float() - qp) @ mins.transpose(-1, -2)


def _topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of the k largest entries along the last dim (-inf entries are never picked when k allows)."""
    keep = torch.zeros_like(scores, dtype=torch.bool)
    if k > 0:
        keep.scatter_(-1, scores.topk(k, -1).indices, True)
    return keep & torch.isfinite(scores)


def _blocks_keep(qf: torch.Tensor, k_raw: torch.Tensor, scale: float, far: torch.Tensor, cfg: WindowConfig,
                 k: int) -> torch.Tensor:
    """Quest-style selection: blocks of cfg.block slots from cfg.sinks on, ranked by their upper bound (max over
    the group), top ceil(k / block) blocks that touch the far region of each query row.
    qf [B, H, G, q, D]; returns keep [B, H, 1, q, N] (far slots of the chosen blocks)."""
    B, H, g, Lq, D = qf.shape
    N = k_raw.shape[2]
    s0, blk = cfg.sinks, cfg.block
    nb = (N - s0) // blk
    keep = torch.zeros(B, H, 1, Lq, N, dtype=torch.bool, device=qf.device)
    if nb == 0:
        return keep
    mins, maxs = block_bounds(k_raw[:, :, s0:], blk, scale)                      # [B, H, nb, D]
    ub = block_upper_bounds(qf.reshape(B, H, g * Lq, D), mins, maxs).view(B, H, g, Lq, nb).amax(2)
    in_far = far[..., s0:s0 + nb * blk].reshape(far.shape[0], 1, Lq, nb, blk).any(-1)
    ub = ub.masked_fill(~in_far, float("-inf"))
    sel = _topk_mask(ub, max(1, min(nb, math.ceil(k / blk))))                    # [B, H, q, nb]
    tok = sel[..., None].expand(B, H, Lq, nb, blk).reshape(B, H, Lq, nb * blk)
    keep[:, :, 0, :, s0:s0 + nb * blk] = tok
    return keep & far


def _quant_keep(qf: torch.Tensor, k_raw: torch.Tensor, scale: float, far: torch.Tensor, cfg: WindowConfig,
                k: int) -> torch.Tensor:
    """Top-k far slots by scores against int8-quantized raw keys (max over the group). Returns [B, H, 1, q, N]."""
    B, H, g, Lq, D = qf.shape
    kq, ks = quantize_keys(k_raw)
    approx = int8_scores(qf.reshape(B, H, g * Lq, D), kq, ks)
    approx = approx.view(B, H, g, Lq, -1).amax(2, keepdim=True).masked_fill(~far, float("-inf"))
    return _topk_mask(approx, k)


def _band_attend(q_h: torch.Tensor, k_rot: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor, spec: RopeSpec,
                 q_pos: torch.Tensor, cfg: WindowConfig, sm_scale: float, ex: torch.Tensor, fa: torch.Tensor,
                 stats: dict | None) -> torch.Tensor:
    """windowed_attend with no far slot attended (selector="none"): scores of the sinks and of the window band of
    the q rows only (not of the N - sinks - window - q slots no row reads). ex / fa: [B|1, 1, 1, q, N] regions."""
    B, Hq, Lq, D = q_h.shape
    H, N = k_rot.shape[1], k_rot.shape[2]
    g = Hq // H
    lo = max(cfg.sinks, N - Lq - cfg.window + 1)
    dev = q_h.device
    cols = torch.cat([torch.arange(min(cfg.sinks, N), device=dev), torch.arange(lo, N, device=dev)]) \
        if lo > cfg.sinks else torch.arange(N, device=dev)
    s = (q_h.float().reshape(B, H, g * Lq, D) @ k_rot[:, :, cols].float().transpose(-1, -2))
    s = s.view(B, H, g, Lq, cols.numel()) * sm_scale
    if cfg.sink_distance is not None and not cfg.true_distance:
        _sink_scores_(s, q_h, k_raw, q_pos, spec, cfg, sm_scale, N)
    s = s.masked_fill(~ex[..., cols], float("-inf"))
    if stats is not None:
        stats["far_slots"] = int(fa.sum(-1).max()) if fa.numel() else 0
        stats["selected"] = 0
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = p.reshape(B, H, g * Lq, cols.numel()) @ v[:, :, cols].float()
    return out.view(B, Hq, Lq, -1).to(q_h.dtype)


def windowed_attend(q_h: torch.Tensor, k_rot: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor,
                    spec: RopeSpec, q_pos: torch.Tensor, cfg: WindowConfig, sm_scale: float,
                    allowed: torch.Tensor | None = None, stats: dict | None = None) -> torch.Tensor:
    """Windowed-RoPE attention of q_h [B, Hq, q, D] (the queries of the last q of N slots) over all N slots.

    k_rot/k_raw/v [B, H, N, D]: rotated keys, raw keys and values of the slots; q_pos [B, q] the queries' positions.
    Dense formulation (any q): scores for exact and far parts, top-k over far per (row, KV head), LSE merge.
    allowed: optional [B|1, 1, q, N] bool (padding / hidden slots). stats (optional dict) receives "far_slots",
    "selected" and, for the index selectors, "recall" (vs the exact top-k). Returns [B, Hq, q, D] in q_h's dtype.
    """
    B, Hq, Lq, D = q_h.shape
    H, N = k_rot.shape[1], k_rot.shape[2]
    g = Hq // H
    exact, far = window_regions(N, Lq, cfg, q_h.device)
    ex, fa = exact.view(1, 1, 1, Lq, N), far.view(1, 1, 1, Lq, N)          # broadcast to [B, H, G, q, N]
    if allowed is not None:
        al = allowed.reshape(allowed.shape[0], 1, 1, Lq, N)
        ex, fa = ex & al, fa & al
    qg = q_h.float().reshape(B, H, g * Lq, D)
    if cfg.selector == "none":
        return _band_attend(q_h, k_rot, k_raw, v, spec, q_pos, cfg, sm_scale, ex, fa, stats)
    s_true = (qg @ k_rot.float().transpose(-1, -2)).view(B, H, g, Lq, N) * sm_scale   # true-position scores
    s_exact = s_true
    if cfg.sink_distance is not None and not cfg.true_distance:
        s_exact = s_true.clone()
        _sink_scores_(s_exact, q_h, k_raw, q_pos, spec, cfg, sm_scale, N)
    qf = qg
    if cfg.true_distance:
        s_far = s_true
    elif cfg.far_scores == "shifted":
        qf = _turned(q_h, -cfg.shift, spec).reshape(B, H, g * Lq, D)
        s_far = (qf @ k_rot.float().transpose(-1, -2)).view(B, H, g, Lq, N) * sm_scale
    else:
        qf = far_query(q_h, q_pos, spec, cfg.distance).reshape(B, H, g * Lq, D)
        s_far = (qf @ k_raw.float().transpose(-1, -2)).view(B, H, g, Lq, N) * sm_scale
    neg = torch.tensor(float("-inf"), device=q_h.device)
    s_exact = s_exact.masked_fill(~ex, neg)
    s_far = s_far.masked_fill(~fa, neg)
    n_far = int(fa.sum(-1).max()) if fa.numel() else 0
    k = cfg.k_for(n_far)
    if k < n_far:
        agg = s_far.amax(2, keepdim=True)                      # [B, H, 1, q, N] max over the group's query heads
        exact_keep = _topk_mask(agg, k)
        if cfg.selector in ("index", "blocks"):
            sel = _quant_keep if cfg.selector == "index" else _blocks_keep
            keep = sel(qf.view(B, H, g, Lq, D), k_raw, sm_scale, fa, cfg, k)
            if stats is not None and k > 0:                    # recall of the index vs the exact top-k
                hit = (keep & exact_keep).sum(-1).float() / k
                stats.setdefault("recall", []).append(float(hit.mean()))
        else:
            keep = exact_keep
        s_far = s_far.masked_fill(~keep, neg)
    if cfg.far_scores == "exact":      # selection by the windowed scores, attention with the true positions
        s_far = s_true.masked_fill(~torch.isfinite(s_far), neg)
    if stats is not None:
        stats["far_slots"] = n_far
        stats["selected"] = k
    lse = torch.logsumexp(torch.stack([torch.logsumexp(s_exact, -1), torch.logsumexp(s_far, -1)]), 0)
    p = torch.exp(s_exact - lse[..., None]).nan_to_num(0.0) + torch.exp(s_far - lse[..., None]).nan_to_num(0.0)
    out = p.reshape(B, H, g * Lq, N) @ v.float()
    return out.view(B, Hq, Lq, -1).to(q_h.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# compact far store + a fused sparse decode step (q = 1), for speed
# ---------------------------------------------------------------------------------------------------------------------

class BlockIndex:
    """Per-block elementwise min/max of raw keys (times `scale`), [H, nb, D] each, for far slots
    [start, start + nb * block). Position independent: built once, valid under any re-positioning."""

    def __init__(self, raw_k: torch.Tensor, start: int, block: int, scale: float = 1.0) -> None:
        """raw_k [H, F, D] (one batch row); full blocks only."""
        self.mins, self.maxs = block_bounds(raw_k, block, scale)
        self.start, self.block, self.nb = start, block, self.mins.shape[1]

    def nbytes(self) -> int:
        return 2 * self.mins.numel() * 4

    def upper_bounds(self, qf: torch.Tensor) -> torch.Tensor:
        """qf [H, G, D] far queries -> [H, nb] upper bound of q . k over each block (max over the group)."""
        return block_upper_bounds(qf, self.mins, self.maxs).amax(1)

    def select(self, qf: torch.Tensor, k_tokens: int) -> torch.Tensor:
        """[H, n_blocks_selected] block ids with the highest bounds (enough blocks for k_tokens)."""
        nsel = max(1, min(self.nb, math.ceil(k_tokens / self.block)))
        return self.upper_bounds(qf).topk(nsel, -1).indices


class FarStore:
    """Far slots in compact form: int8 raw keys (absmax scale per token and head) + fp16 values, [H, F, D].

    The int8 keys double as the retrieval index (`scores`): one pass over 1 byte per key dim. `append` adds slots
    that moved out of the local window (decode)."""

    def __init__(self, raw_k: torch.Tensor, v: torch.Tensor, key_bits: int = 8) -> None:
        if key_bits not in (8, 16):
            fail("FarStore key_bits", "8 or 16", key_bits)
        if raw_k.dim() != 3 or v.dim() != 3 or raw_k.shape[:2] != v.shape[:2]:
            fail("FarStore raw_k / v", "[H, F, D] each with the same H and F",
                 f"{tuple(raw_k.shape)} / {tuple(v.shape)}")
        self.key_bits = key_bits
        self.k = self.k_scale = self.kt = None
        self.v = v.to(torch.float16)
        self._set_keys(raw_k)

    def _set_keys(self, raw_k: torch.Tensor) -> None:
        if self.key_bits == 8:
            self.k, self.k_scale = quantize_keys(raw_k)           # [H, F, D] int8, [H, F] float32
            self.k_scale = self.k_scale.contiguous()
            self.kt = transpose_int8_blocks(self.k)              # the index layout the scoring kernel reads
        else:
            self.k = raw_k.to(torch.float16)

    @property
    def num_slots(self) -> int:
        return int(self.k.shape[1])

    def append(self, raw_k: torch.Tensor, v: torch.Tensor) -> None:
        """Add far slots raw_k / v [H, S, D] after the stored ones."""
        if raw_k.shape[1] == 0:
            return
        if self.key_bits == 8:
            kq, sc = quantize_keys(raw_k)
            self.k = torch.cat([self.k, kq], 1)
            self.k_scale = torch.cat([self.k_scale, sc], 1).contiguous()
            self.kt = transpose_int8_blocks(self.k)
        else:
            self.k = torch.cat([self.k, raw_k.to(torch.float16)], 1)
        self.v = torch.cat([self.v, v.to(torch.float16)], 1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale) if t is not None)

    def index_bytes(self) -> int:
        """Bytes of the resident index read to score every far key: the blocked int8 keys and their scales."""
        kt = self.kt if self.kt is not None else self.k
        return kt.numel() * kt.element_size() + (self.k_scale.numel() * 4 if self.k_scale is not None else 0)

    def scores(self, qf: torch.Tensor) -> torch.Tensor:
        """qf [H, G, D] far queries -> [H, F] approximate scores (max over the group) from the stored keys."""
        if self.key_bits == 8:
            out = score_int8_kernel(qf, self.kt, self.k_scale, self.num_slots)
            if out is not None:
                return out
            return int8_scores(qf, self.k, self.k_scale).amax(1)
        return (qf.float() @ self.k.float().transpose(-1, -2)).amax(1)

    def gather(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """idx [H, k] far-slot indices -> (raw keys [H, k, D] float32, values [H, k, D] float32): row gathers."""
        H, F, D = self.k.shape
        flat = (idx + torch.arange(H)[:, None] * F).reshape(-1)
        k = self.k.reshape(H * F, D).index_select(0, flat).view(H, -1, D).float()
        if self.k_scale is not None:
            k = k * self.k_scale.reshape(-1).index_select(0, flat).view(H, -1, 1)
        v = self.v.reshape(H * F, -1).index_select(0, flat).view(H, -1, self.v.shape[-1]).float()
        return k, v


def sparse_decode_attention(q_h: torch.Tensor, q_far: torch.Tensor, local_k: torch.Tensor, local_v: torch.Tensor,
                            store: FarStore, k_tokens: int, sm_scale: float, blocks: BlockIndex | None = None
                            ) -> torch.Tensor:
    """One decode step (one query, one batch row) for one layer: exact attention over the resident local slots
    (sinks + window, rotated keys) + the top `k_tokens` far slots of the compact store, LSE-merged (one softmax).
    The selected far keys are attended with their windowed scores (far_scores="windowed").

    Selection: by the store's int8 key scores (default), or by a BlockIndex's top blocks when `blocks` is given.
    q_h [Hq, D] rotated query; q_far [Hq, D] = far_query(...); local_k/local_v [H, W, D]. Returns [Hq, D]."""
    H, W, D = local_k.shape
    g = q_h.shape[0] // H
    qg = q_h.view(H, g, D).float()
    qfg = q_far.view(H, g, D).float()
    s_loc = (qg @ local_k.float().transpose(-1, -2)) * sm_scale                  # [H, G, W]
    if store.num_slots == 0 or k_tokens <= 0:
        p = torch.softmax(s_loc, -1)
        return (p @ local_v.float()).reshape(H * g, -1)
    if blocks is not None:
        sel = blocks.select(qfg, k_tokens)                                     # [H, nb_sel]
        tok = (sel[..., None] * blocks.block + torch.arange(blocks.block)).reshape(H, -1)
    else:
        tok = topk_indices(store.scores(qfg), k_tokens)                       # [H, k]
    fk, fv = store.gather(tok)
    s_far = (qfg @ fk.transpose(-1, -2)) * sm_scale                            # [H, G, k]
    p = torch.softmax(torch.cat([s_loc, s_far], -1), -1)
    out = p[..., :W] @ local_v.float() + p[..., W:] @ fv
    return out.reshape(H * g, -1)


def index_recall(q_far: torch.Tensor, raw_far: torch.Tensor, index: BlockIndex, k_tokens: int) -> float:
    """Fraction of the exact top-k far slots (score = max over the group of q_far . k) that the index's selected
    blocks contain. q_far [Hq, D], raw_far [H, F, D] (already times attention scaling)."""
    H = raw_far.shape[0]
    g = q_far.shape[0] // H
    F = index.nb * index.block
    sc = (q_far.view(H, g, -1) @ raw_far[:, :F].float().transpose(-1, -2)).amax(1)     # [H, F]
    k = max(1, min(k_tokens, F))
    exact = sc.topk(k, -1).indices
    sel = index.select(q_far.view(H, g, -1), k)
    got = torch.zeros(H, index.nb, dtype=torch.bool)
    got.scatter_(1, sel, True)
    return float(got.gather(1, exact // index.block).float().mean())

