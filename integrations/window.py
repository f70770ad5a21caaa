"""Windowed-RoPE retrieval attention: one unrotated key store serves every query position.

Letters: B batch · H kv heads · Hq query heads (g = Hq / H) · q queries · N cached keys · D head_dim · F far slots.

For a query at position p (A²ATS, arXiv 2502.12665; InfLLM / ReRoPE use the same fixed-distance idea):

    sinks  = the first `sinks` slots            exact score at true positions
    window = the last `window` slots before it  exact score at true positions
    far    = the rest                           score as if the key sat r positions before the query:
             q_h . (s R_{p-r} k_raw) = s * (R_{r-p} q_h) . k_raw      (only the query is rotated)
             these windowed scores SELECT the far keys; the selected keys are attended with their true-position
             scores (far_scores="exact", A²ATS) or with the windowed ones (far_scores="windowed", InfLLM /
             ReRoPE style, which never shows the model a distance > r: for contexts beyond the training window)

Far scores need the RAW keys, which PositionedCache already keeps: the same store serves every query position and
can be indexed, compressed and offloaded once. Of the far slots only the top `budget` (a fraction of F, or an
int) are attended, per layer and KV head (the score of a key for a KV head = max over its query heads). The exact
part (sinks + window) and the far part are merged through their log-sum-exps.

Selectors:  "all"    every far slot (no retrieval; with true_distance=True this is full attention)
            "exact"  exact windowed scores of all far raw keys, top-k
            "index"  top-k by scores against an int8 copy of the raw keys (per-token absmax scale): the index
                     reads 1/4 of the fp32 key bytes (fused C scoring kernel), recall ~0.98 of the exact top-k
            "blocks" per-block min/max bounds of raw keys (Quest-style), top blocks; kept for comparison: its
                     recall on SmolLM2 keys is low (~0.15-0.3)
            "none"   sinks + window only (StreamingLLM without its re-positioning)
Plugged in as the transformers attention "kvpos_window" with a registered mask function.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvpos._checks import fail
from kvpos._kernels import score_int8_kernel, topk_indices, transpose_int8_blocks
from kvpos.rope import RopeSpec, _apply, cos_sin
from kvpos.integrations.hf import PositionedCache, active_cache, extend, generate

__all__ = ["NAME", "WindowConfig", "windowed_attend", "far_query", "use_window", "window_extend", "window_generate",
           "BlockIndex", "FarStore", "sparse_decode_attention", "index_recall"]

NAME = "kvpos_window"
SELECTORS = ("all", "exact", "index", "blocks", "none")


@dataclass(frozen=True)
class WindowConfig:
    """sinks/window in slots, distance r in positions, budget = fraction of far slots (float) or a count (int)."""

    sinks: int = 8
    window: int = 64
    distance: int = 2048
    budget: float | int = 0.05
    selector: str = "exact"
    block: int = 16
    true_distance: bool = False   # score far keys at their real positions (testing: equals full attention)
    far_scores: str = "exact"     # attention logits of the SELECTED far keys: "exact" (true positions, A²ATS) or
    #                               "windowed" (fixed distance r, InfLLM/ReRoPE style: no distance > r is ever seen)
    dense_layers: int = 0         # the first n layers attend densely (Quest and A²ATS leave layers 0-1 dense)

    def __post_init__(self) -> None:
        for what in ("sinks", "window", "distance", "block", "dense_layers"):
            v = getattr(self, what)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if what == "block" else 0):
                fail(f"WindowConfig.{what}", "an int >= 0" if what != "block" else "an int >= 1", v)
        if self.selector not in SELECTORS:
            fail("WindowConfig.selector", f"one of {SELECTORS}", repr(self.selector))
        if self.far_scores not in ("exact", "windowed"):
            fail("WindowConfig.far_scores", "'exact' or 'windowed'", repr(self.far_scores))
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or b < 0 or (isinstance(b, float) and b > 1):
            fail("WindowConfig.budget", "a fraction in [0, 1] or an int count >= 0", b)

    def k_for(self, n_far: int) -> int:
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


def _regions(N: int, Lq: int, cfg: WindowConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """exact [q, N] and far [q, N] bool masks for query rows at slots N-Lq .. N-1 (causal)."""
    qs = torch.arange(N - Lq, N, device=device)[:, None]
    ks = torch.arange(N, device=device)[None]
    causal = ks <= qs
    exact = causal & ((ks < cfg.sinks) | (ks > qs - cfg.window))
    return exact, causal & ~exact


def windowed_attend(q_h: torch.Tensor, layer: Any, q_pos: torch.Tensor, cfg: WindowConfig, sm_scale: float,
                    allowed: torch.Tensor | None = None, stats: dict | None = None) -> torch.Tensor:
    """Windowed-RoPE attention of q_h [B, Hq, q, D] (the last q slots of `layer`) over all N slots of `layer`.

    Dense formulation (any q): scores for exact and far parts, top-k over far per (row, KV head), LSE merge.
    allowed: optional [B|1, 1, q, N] bool (padding / hidden slots). Returns [B, Hq, q, D] in q_h's dtype.
    """
    B, Hq, Lq, D = q_h.shape
    k_rot, k_raw, v = layer.keys, layer.raw_keys, layer.values
    H, N = k_rot.shape[1], k_rot.shape[2]
    g = Hq // H
    exact, far = _regions(N, Lq, cfg, q_h.device)
    ex, fa = exact.view(1, 1, 1, Lq, N), far.view(1, 1, 1, Lq, N)          # broadcast to [B, H, g, q, N]
    if allowed is not None:
        al = allowed.reshape(allowed.shape[0], 1, 1, Lq, N)
        ex, fa = ex & al, fa & al
    qg = q_h.float().reshape(B, H, g * Lq, D)
    s_true = (qg @ k_rot.float().transpose(-1, -2)).view(B, H, g, Lq, N) * sm_scale   # true-position scores
    s_exact = s_true
    qf = q_h.float().reshape(B, H, g * Lq, D)
    if cfg.true_distance:
        s_far = s_exact
    else:
        qf = far_query(q_h, q_pos, layer.spec, cfg.distance).reshape(B, H, g * Lq, D)
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


def _topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of the k largest entries along the last dim (-inf entries are never picked when k allows)."""
    keep = torch.zeros_like(scores, dtype=torch.bool)
    if k > 0:
        keep.scatter_(-1, scores.topk(k, -1).indices, True)
    return keep & torch.isfinite(scores)


def _blocks_keep(qf: torch.Tensor, k_raw: torch.Tensor, scale: float, far: torch.Tensor, cfg: WindowConfig,
                k: int) -> torch.Tensor:
    """Quest-style selection on raw keys: blocks of cfg.block slots from cfg.sinks on, upper bound
    relu(q).max + min(q,0).min per block (max over the group), top ceil(k / block) blocks that lie in the far
    region of each query row. qf [B, H, g, q, D]; returns keep [B, H, 1, q, N] (far slots of the chosen blocks)."""
    B, H, g, Lq, D = qf.shape
    N = k_raw.shape[2]
    s0, blk = cfg.sinks, cfg.block
    nb = (N - s0) // blk
    keep = torch.zeros(B, H, 1, Lq, N, dtype=torch.bool, device=qf.device)
    if nb == 0:
        return keep
    kb = k_raw[:, :, s0:s0 + nb * blk].float().reshape(B, H, nb, blk, D) * scale
    mins, maxs = kb.amin(3), kb.amax(3)                                   # [B, H, nb, D]
    qp = qf.clamp_min(0).reshape(B, H, g * Lq, D)
    ub = qp @ maxs.transpose(-1, -2) + (qf.reshape(B, H, g * Lq, D) - qp) @ mins.transpose(-1, -2)
    ub = ub.view(B, H, g, Lq, nb).amax(2)                                  # [B, H, q, nb]
    in_far = far[..., s0:s0 + nb * blk].reshape(far.shape[0], 1, Lq, nb, blk).any(-1)   # block touches far region
    ub = ub.masked_fill(~in_far, float("-inf"))
    nsel = max(1, min(nb, math.ceil(k / blk)))
    sel = _topk_mask(ub, nsel)                                             # [B, H, q, nb]
    tok = sel[..., None].expand(B, H, Lq, nb, blk).reshape(B, H, Lq, nb * blk)
    keep[:, :, 0, :, s0:s0 + nb * blk] = tok
    return keep & far


def quantize_keys(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 keys and float32 per-token absmax scales: raw [..., T, D] -> (q [..., T, D] int8, scale [..., T])."""
    amax = raw.float().abs().amax(-1).clamp_min(1e-12)
    scale = amax / 127.0
    return torch.round(raw.float() / scale[..., None]).clamp(-127, 127).to(torch.int8), scale


def _quant_keep(qf: torch.Tensor, k_raw: torch.Tensor, scale: float, far: torch.Tensor, cfg: WindowConfig,
                k: int) -> torch.Tensor:
    """Top-k far slots by scores against int8-quantized raw keys (max over the group). Returns [B, H, 1, q, N]."""
    B, H, g, Lq, D = qf.shape
    kq, ks = quantize_keys(k_raw)
    approx = (qf.reshape(B, H, g * Lq, D) @ kq.float().transpose(-1, -2)) * ks[:, :, None]
    approx = approx.view(B, H, g, Lq, -1).amax(2, keepdim=True).masked_fill(~far, float("-inf"))
    return _topk_mask(approx, k)


def window_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention "kvpos_window": windowed-RoPE retrieval over the active PositionedCache; plain sdpa
    when the cache carries no WindowConfig."""
    cache = active_cache()
    cfg = getattr(cache, "window_cfg", None) if isinstance(cache, PositionedCache) else None
    if cfg is None or cache.table.n != key.shape[2] or module.layer_idx < cfg.dense_layers:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer = cache.layers[module.layer_idx]
    B, Hq, Lq, D = query.shape
    N = key.shape[2]
    q_pos = cache.table.pos[:, N - Lq:].to(query.device)
    allowed = None
    if attention_mask is not None:
        am = attention_mask[..., -N:]
        allowed = am if am.dtype == torch.bool else am > torch.finfo(am.dtype).min / 2
        if bool(allowed.all()):
            allowed = None
    sm = scaling if scaling is not None else 1.0 / math.sqrt(D)
    out = windowed_attend(query, layer, q_pos, cfg, sm, allowed, stats=getattr(cache, "window_stats", None))
    return out.transpose(1, 2).contiguous(), None


def _window_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, window_attention)
AttentionMaskInterface.register(NAME, _window_mask)


@contextlib.contextmanager
def use_window(model: torch.nn.Module, cache: PositionedCache, cfg: WindowConfig | None = None, **kw: Any
               ) -> Iterator[WindowConfig]:
    """Within the block `model` attends with windowed-RoPE retrieval over `cache` (cfg or WindowConfig(**kw))."""
    cfg = cfg if cfg is not None else WindowConfig(**kw)
    if kw and cfg is not None:
        cfg = replace(cfg, **kw)
    if not isinstance(cache, PositionedCache):
        fail("use_window cache", "a PositionedCache", type(cache).__name__, exc=TypeError)
    prev = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    cache.window_cfg = cfg
    try:
        yield cfg
    finally:
        cache.window_cfg = None
        model.set_attn_implementation(prev)


def window_extend(model: torch.nn.Module, cache: PositionedCache, ids: torch.Tensor, cfg: WindowConfig | None = None,
                  positions: Any = None, **kw: Any) -> torch.Tensor:
    """`extend` with windowed attention for the new tokens; returns logits [B, S, V]."""
    with use_window(model, cache, cfg, **kw):
        return extend(model, cache, ids, positions=positions)


def window_generate(model: torch.nn.Module, cache: PositionedCache, ids: torch.Tensor,
                    cfg: WindowConfig | None = None, **gen_kwargs: Any) -> torch.Tensor:
    """`generate` with windowed attention (the config never reaches generate's kwarg validation)."""
    with use_window(model, cache, cfg):
        return generate(model, cache, ids, **gen_kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# index + compact far store + a fused sparse decode step (q = 1), for speed
# ---------------------------------------------------------------------------------------------------------------------

class BlockIndex:
    """Per-block elementwise min/max of raw keys (times `scale`), [H, nb, D] each, for far slots
    [start, start + nb * block). Position independent: built once, valid under any re-positioning."""

    def __init__(self, raw_k: torch.Tensor, start: int, block: int, scale: float = 1.0) -> None:
        """raw_k [H, F, D] (one batch row); full blocks only."""
        H, F, D = raw_k.shape
        nb = F // block
        kb = raw_k[:, : nb * block].float().reshape(H, nb, block, D) * scale
        self.mins, self.maxs = kb.amin(2), kb.amax(2)
        self.start, self.block, self.nb = start, block, nb

    def nbytes(self) -> int:
        return 2 * self.mins.numel() * 4

    def upper_bounds(self, qf: torch.Tensor) -> torch.Tensor:
        """qf [H, g, D] far queries -> [H, nb] upper bound of q . k over each block (max over the group).

        sum_d max(q_d min_d, q_d max_d) = relu(q) . max + min(q, 0) . min: two matmuls."""
        qp = qf.float().clamp_min(0)
        ub = qp @ self.maxs.transpose(-1, -2) + (qf.float() - qp) @ self.mins.transpose(-1, -2)   # [H, g, nb]
        return ub.amax(1)

    def select(self, qf: torch.Tensor, k_tokens: int) -> torch.Tensor:
        """[H, n_blocks_selected] block ids with the highest bounds (enough blocks for k_tokens)."""
        nsel = max(1, min(self.nb, math.ceil(k_tokens / self.block)))
        return self.upper_bounds(qf).topk(nsel, -1).indices


class FarStore:
    """Far slots in compact form: int8 raw keys (absmax scale per token and head) + fp16 values, [H, F, D].

    The int8 keys double as the retrieval index (`scores`): one pass over 1 byte per key dim."""

    def __init__(self, raw_k: torch.Tensor, v: torch.Tensor, key_bits: int = 8) -> None:
        if key_bits not in (8, 16):
            fail("FarStore key_bits", "8 or 16", key_bits)
        self.key_bits = key_bits
        if key_bits == 8:
            self.k, scale = quantize_keys(raw_k)
            self.k_scale_f32 = scale.contiguous()                  # [H, F]
            self.k_scale = scale[..., None]
            self.kt = transpose_int8_blocks(self.k)                # the index layout the scoring kernel reads
        else:
            self.k, self.k_scale = raw_k.to(torch.float16), None
        self.v = v.to(torch.float16)

    def nbytes(self) -> int:
        scale = getattr(self, "k_scale_f32", None)
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, scale) if t is not None)

    def index_bytes(self) -> int:
        """Bytes of the resident index read to score every far key: the blocked int8 keys and their scales."""
        kt = getattr(self, "kt", self.k)
        scale = getattr(self, "k_scale_f32", None)
        return kt.numel() * kt.element_size() + (scale.numel() * 4 if scale is not None else 0)

    def scores(self, qf: torch.Tensor) -> torch.Tensor:
        """qf [H, g, D] far queries -> [H, F] approximate scores (max over the group) from the int8 keys."""
        if self.key_bits == 8:
            out = score_int8_kernel(qf, self.kt, self.k_scale_f32, self.k.shape[1])
            if out is not None:
                return out
            s = qf.float() @ self.k.float().transpose(-1, -2) * self.k_scale_f32[:, None]
        else:
            s = qf.float() @ self.k.float().transpose(-1, -2)
        return s.amax(1)

    def gather(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """idx [H, k] far-slot indices -> (raw keys [H, k, D] float32, values [H, k, D] float32): row gathers."""
        H, F, D = self.k.shape
        flat = (idx + torch.arange(H)[:, None] * F).reshape(-1)
        k = self.k.reshape(H * F, D).index_select(0, flat).view(H, -1, D).float()
        if self.k_scale is not None:
            k = k * self.k_scale_f32.reshape(-1).index_select(0, flat).view(H, -1, 1)
        v = self.v.reshape(H * F, -1).index_select(0, flat).view(H, -1, self.v.shape[-1]).float()
        return k, v


def sparse_decode_attention(q_h: torch.Tensor, q_far: torch.Tensor, local_k: torch.Tensor, local_v: torch.Tensor,
                            store: FarStore, k_tokens: int, sm_scale: float, blocks: BlockIndex | None = None
                            ) -> torch.Tensor:
    """One decode step (one query, one batch row) for one layer: exact attention over the resident local slots
    (sinks + window, rotated keys) + the top `k_tokens` far slots of the compact store, LSE-merged (one softmax).
    The selected far keys are attended with their windowed scores (far_scores="windowed"); true-position scores
    would add one rotation of the k gathered keys.

    Selection: by the store's int8 key scores (default), or by a BlockIndex's top blocks when `blocks` is given.
    q_h [Hq, D] rotated query; q_far [Hq, D] = far_query(...); local_k/local_v [H, L, D]. Returns [Hq, D]."""
    H, L, D = local_k.shape
    g = q_h.shape[0] // H
    qg = q_h.view(H, g, D).float()
    qfg = q_far.view(H, g, D).float()
    s_loc = (qg @ local_k.float().transpose(-1, -2)) * sm_scale                  # [H, g, L]
    if blocks is not None:
        sel = blocks.select(qfg, k_tokens)                                     # [H, nb_sel]
        tok = (sel[..., None] * blocks.block + torch.arange(blocks.block)).reshape(H, -1)
    else:
        tok = topk_indices(store.scores(qfg), k_tokens)                       # [H, k]
    fk, fv = store.gather(tok)
    s_far = (qfg @ fk.transpose(-1, -2)) * sm_scale                            # [H, g, k]
    p = torch.softmax(torch.cat([s_loc, s_far], -1), -1)
    out = p[..., :L] @ local_v.float() + p[..., L:] @ fv
    return out.reshape(H * g, D)


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
