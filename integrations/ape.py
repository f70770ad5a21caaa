"""Adaptive Parallel Encoding (APE, ICLR 2025) as a transformers attention backend, CPU (torch) and CUDA (xformers).

Letters: B batch · H kv heads · Hq query heads (g = Hq / H) · q queries · N keys · D head_dim.

Chunks are encoded in parallel (layout="parallel": all share the positions after the shared anchor prefix). For the
question and generated tokens, attention is split by slot label (the cache's segment table, set by compose()):

    context slots C (segment >= SEG_CHUNK0):   scores / T          -> O_C, LSE_C
    other slots O (anchor, query, generated):  plain scores        -> O_O, LSE_O
    [w_C, w_O] = softmax([S * T * LSE_C, LSE_O]);   out = w_C * O_C + w_O * O_O

T = S = 1 is exactly plain attention over the same slots. Queries that are themselves context slots (chunk
encoding) always get plain attention.

Plugging in (no modeling code is edited):
  - `ape_attention` is registered in transformers' AttentionInterface as "kvpos_ape", AND a mask function is
    registered under the same name in AttentionMaskInterface (without it transformers passes attention_mask=None
    and the result is silently wrong);
  - `use_ape(model, cache, T, S)` switches the model to it and puts (T, S) on the cache (a side channel: generate's
    kwarg validation never sees them); `ape_extend` / `ape_generate` wrap extend / generate with it.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvpos._checks import fail
from kvpos.integrations.compose import SEG_CHUNK0, Anchor, encode_chunk
from kvpos.integrations.hf import PositionedCache, active_cache, extend, generate
from kvpos.store import ChunkKV, Fingerprint

__all__ = ["NAME", "DEFAULT_TEMPERATURE", "DEFAULT_SCALE", "ape_attend", "ape_attention", "use_ape", "ape_extend",
           "ape_generate", "block_diagonal_allowed", "encode_chunks_batched", "xformers_available", "ApeCalibration",
           "calibrate_ape"]

NAME = "kvpos_ape"
# chosen by the sweep `bench/rag_eval.py --ape --sweep --only parallel --passages 32 --n 20 --n-cont 0 --seed 2
# --grid-t 0.5 0.6 0.7 0.8 0.9 1.0 --grid-s 0.9 1.0` (results/ape_sweep_32.md: T=0.6-0.7 with S=1.0 keep 105.6% of
# full-prefill accuracy on 20 questions over 32 parallel passages, plain parallel 0%; T >= 0.9 falls off);
# the APE paper/repo default is T=S=0.9 (66.7% there)
DEFAULT_TEMPERATURE = 0.7
DEFAULT_SCALE = 1.0


def _check_ts(temperature: Any, scale: Any, shape: tuple[int, int] | None = None) -> tuple[Any, Any]:
    """Each knob is a float > 0, or (per layer and query head) a float tensor of `shape` [L, Hq] with entries > 0."""
    out = []
    for what, v in (("temperature", temperature), ("scale", scale)):
        if isinstance(v, torch.Tensor):
            if not v.is_floating_point() or (shape is not None and tuple(v.shape) != tuple(shape)):
                fail(f"APE {what}", f"a float or a float tensor of shape {list(shape) if shape else '[L, Hq]'} "
                     "(per layer and query head)", f"{v.dtype} tensor of shape {list(v.shape)}")
            if not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
                fail(f"APE {what}", "finite entries > 0", f"min {float(v.min()):.3g}, max {float(v.max()):.3g}")
            out.append(v.detach().float().clone())
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            fail(f"APE {what}", "a finite float > 0", v)
        out.append(float(v))
    return out[0], out[1]


def _per_row(x: Any, H: int, g: int, Lq: int, q_is_ctx: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A knob (float, or [Hq] per query head) as [B|1, H, g, q, 1] float; rows that are context slots get 1."""
    if isinstance(x, torch.Tensor):
        t = x.to(device=device, dtype=torch.float32).view(1, H, g, 1, 1).expand(1, H, g, Lq, 1)
    else:
        t = torch.full((1, 1, 1, Lq, 1), float(x), device=device)
    if q_is_ctx is not None:
        t = torch.where(q_is_ctx.to(device).view(q_is_ctx.shape[0], 1, 1, Lq, 1), 1.0, t)
    return t


def ape_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, is_ctx: torch.Tensor,
               sm_scale: float, temperature: float | torch.Tensor, scale: float | torch.Tensor,
               q_is_ctx: torch.Tensor | None = None) -> torch.Tensor:
    """APE attention, torch (CPU or GPU). Returns [B, Hq, q, D] in q's dtype.

    q [B, Hq, q, D] rotated queries; k/v [B, H, N, D]; allowed [B|1, 1, q, N] bool; is_ctx [B|1, N] bool;
    temperature / scale: floats, or [Hq] tensors (one value per query head);
    q_is_ctx [B|1, q] bool: those query rows get plain attention (T = S = 1).
    The merge is done in log space: key j gets logit s'_j + log w_G - LSE_G for its group G, so one softmax-free
    exp and one matmul give w_C O_C + w_O O_O.
    """
    B, Hq, Lq, D = q.shape
    H, N = k.shape[1], k.shape[2]
    g = Hq // H
    qg = q.reshape(B, H, g * Lq, D).float()
    s = (qg @ k.float().transpose(-1, -2)) * sm_scale                # [B, H, g*q, N]
    s = s.view(B, H, g, Lq, N)
    ctx = is_ctx.view(is_ctx.shape[0], 1, 1, 1, N)
    T = _per_row(temperature, H, g, Lq, q_is_ctx, s.device)
    Sc = _per_row(scale, H, g, Lq, q_is_ctx, s.device)
    ok = allowed.view(allowed.shape[0], 1, 1, Lq, N)
    neg = torch.tensor(float("-inf"), device=s.device)
    sp = torch.where(ctx, s / T, s).masked_fill(~ok, neg)              # s' (context scores tempered)
    lse_c = torch.logsumexp(sp.masked_fill(~ctx, neg), -1, keepdim=True)
    lse_o = torch.logsumexp(sp.masked_fill(ctx, neg), -1, keepdim=True)
    a, b = Sc * T * lse_c, lse_o
    lz = torch.logaddexp(a, b)
    off_c = torch.where(torch.isfinite(lse_c), a - lz - lse_c, torch.zeros_like(lse_c))
    off_o = torch.where(torch.isfinite(lse_o), b - lz - lse_o, torch.zeros_like(lse_o))
    p = torch.exp(sp + torch.where(ctx, off_c, off_o))                # rows sum to 1
    out = p.view(B, H, g * Lq, N) @ v.float()                          # [B, H, g*q, D]
    return out.view(B, Hq, Lq, -1).to(q.dtype)


def _allowed_from_mask(mask: torch.Tensor | None, B: int, Lq: int, N: int, device: torch.device) -> torch.Tensor:
    if mask is None:   # plain causal over physical slots (the query is the last Lq slots)
        i = torch.arange(Lq, device=device)[:, None] + (N - Lq)
        return (torch.arange(N, device=device)[None] <= i)[None, None]
    if mask.dtype == torch.bool:
        return mask[..., -N:]
    return mask[..., -N:] > torch.finfo(mask.dtype).min / 2


def ape_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function "kvpos_ape": APE over the active PositionedCache's context slots, plain sdpa
    whenever the cache carries no APE parameters or holds no context slots."""
    cache = active_cache()
    params = getattr(cache, "ape", None) if isinstance(cache, PositionedCache) else None
    N = key.shape[2]
    if params is None or cache.table.n != N:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    seg = cache.table.segment.to(key.device)
    is_ctx = seg >= SEG_CHUNK0
    if not bool(is_ctx.any()):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    B, Hq, Lq, D = query.shape
    allowed = _allowed_from_mask(attention_mask, B, Lq, N, key.device)
    sm = scaling if scaling is not None else 1.0 / math.sqrt(D)
    T, S = (x[module.layer_idx] if isinstance(x, torch.Tensor) else x for x in params)
    if _PROBE is not None:
        _PROBE.record_ape(module.layer_idx, query, key, allowed, is_ctx, sm, q_is_ctx=is_ctx[:, N - Lq:])
    if query.is_cuda and xformers_available():
        out = _ape_xformers(query, key, value, allowed, is_ctx, sm, T, S, q_is_ctx=is_ctx[:, N - Lq:])
    else:
        out = ape_attend(query, key, value, allowed, is_ctx, sm, T, S, q_is_ctx=is_ctx[:, N - Lq:])
    return out.transpose(1, 2).contiguous(), None


def _ape_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    kwargs["allow_is_causal_skip"] = False     # always a concrete mask: APE needs to know what each query may see
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, ape_attention)
AttentionMaskInterface.register(NAME, _ape_mask)


def _layers_heads(model: torch.nn.Module) -> tuple[int, int]:
    cfg = getattr(model.config, "text_config", model.config)
    return int(cfg.num_hidden_layers), int(cfg.num_attention_heads)


@contextlib.contextmanager
def use_ape(model: torch.nn.Module, cache: PositionedCache, temperature: float | torch.Tensor = DEFAULT_TEMPERATURE,
            scale: float | torch.Tensor = DEFAULT_SCALE) -> Iterator[None]:
    """Within the block, `model` attends with APE (T=temperature, S=scale) over `cache`'s context slots.

    Each knob is one float, or a [L, Hq] tensor (one value per layer and query head, e.g. from `calibrate_ape`)."""
    T, S = _check_ts(temperature, scale, _layers_heads(model))
    if not isinstance(cache, PositionedCache):
        fail("use_ape cache", "a PositionedCache (built by compose with layout='parallel')", type(cache).__name__,
             exc=TypeError)
    prev = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    cache.ape = (T, S)
    try:
        yield
    finally:
        cache.ape = None
        model.set_attn_implementation(prev)


def ape_extend(model: torch.nn.Module, cache: PositionedCache, ids: torch.Tensor,
               temperature: float = DEFAULT_TEMPERATURE, scale: float = DEFAULT_SCALE, **kw: Any) -> torch.Tensor:
    """`extend` with APE attention for the new tokens; returns logits [B, S, V]."""
    with use_ape(model, cache, temperature, scale):
        return extend(model, cache, ids, **kw)


def ape_generate(model: torch.nn.Module, cache: PositionedCache, ids: torch.Tensor,
                 temperature: float = DEFAULT_TEMPERATURE, scale: float = DEFAULT_SCALE, **gen_kwargs: Any
                 ) -> torch.Tensor:
    """`generate` with APE attention (T, S never reach generate's kwarg validation)."""
    with use_ape(model, cache, temperature, scale):
        return generate(model, cache, ids, **gen_kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# batched chunk prefill: every chunk of a request in one forward with a block-diagonal mask
# ---------------------------------------------------------------------------------------------------------------------

def block_diagonal_allowed(lengths: list[int], prefix: int = 0) -> torch.Tensor:
    """[sum L, prefix + sum L] bool: token t of chunk i sees the whole prefix and chunk i's tokens <= t.

    Same pattern as xformers' BlockDiagonalCausalMask (plus a shared prefix column block)."""
    if not lengths or any((not isinstance(x, int)) or x <= 0 for x in lengths):
        fail("block_diagonal_allowed lengths", "a non-empty list of positive ints", lengths)
    n = sum(lengths)
    allowed = torch.zeros(n, prefix + n, dtype=torch.bool)
    allowed[:, :prefix] = True
    s = 0
    for L in lengths:
        allowed[s:s + L, prefix + s:prefix + s + L] = torch.tril(torch.ones(L, L, dtype=torch.bool))
        s += L
    return allowed


@torch.no_grad()
def encode_chunks_batched(model: torch.nn.Module, anchor: Anchor, chunks: list[torch.Tensor],
                          fingerprint: Fingerprint) -> list[ChunkKV]:
    """Encode all `chunks` after `anchor` in ONE forward (block-diagonal mask, every chunk at positions A..);
    equals encoding them one by one (`encode_chunk`)."""
    ids = [torch.as_tensor(c, dtype=torch.long).flatten() for c in chunks]
    A = anchor.length
    lengths = [int(c.numel()) for c in ids]
    window = getattr(model.config, "sliding_window", None)
    if window and "sliding_attention" in (getattr(model.config, "layer_types", None) or []) \
            and A + max(lengths) > window:
        fail("encode_chunks_batched", f"anchor + longest chunk <= sliding_window={window}",
             A + max(lengths), "one 4-D mask serves every layer and cannot express the sliding window; "
             "encode the chunks one by one (encode_chunk)")
    cache = anchor.cache.copy()
    pos = torch.cat([torch.arange(A, A + L) for L in lengths])
    allowed = block_diagonal_allowed(lengths, A)[None, None]
    extend(model, cache, torch.cat(ids)[None], positions=pos, attention_mask=allowed)
    out, s = [], A
    for c, L in zip(ids, lengths):
        keys = torch.stack([l.raw_k[0, :, s:s + L] for l in cache.layers]).contiguous()
        values = torch.stack([l.v[0, :, s:s + L] for l in cache.layers]).contiguous()
        out.append(ChunkKV(c.clone(), keys, values, A, fingerprint))
        s += L
    return out


# ---------------------------------------------------------------------------------------------------------------------
# CUDA path: xformers memory_efficient_attention per group + LSE merge (optional extra kvpos[xformers])
# ---------------------------------------------------------------------------------------------------------------------

def xformers_available() -> bool:
    """True when CUDA is present and xformers imports (never touches CUDA at import time of kvpos)."""
    if not torch.cuda.is_available():
        return False
    try:
        import xformers.ops  # noqa: F401
    except Exception:  # noqa: BLE001 - any import problem means: use the torch path
        return False
    return True


def _ape_xformers(q, k, v, allowed, is_ctx, sm, T, S, q_is_ctx=None):
    """Two memory_efficient_attention calls (context with queries / T, others plain) returning LSEs, merged as
    APE; T and S are floats or [Hq] tensors. Masks are dense additive biases (the question/generation phase has
    few queries)."""
    import xformers.ops as xops

    B, Hq, Lq, D = q.shape
    H, N = k.shape[1], k.shape[2]
    g = Hq // H
    kx = k.repeat_interleave(g, 1).transpose(1, 2)          # [B, N, Hq, D]
    vx = v.repeat_interleave(g, 1).transpose(1, 2)
    qx = q.transpose(1, 2)                                   # [B, q, Hq, D]
    ctx = is_ctx.view(-1, 1, 1, N)

    def part(mask, qq, scale):
        bias = torch.zeros(B, Hq, Lq, N, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        o, lse = xops.memory_efficient_attention_forward_requires_grad(qq, kx, vx, attn_bias=bias, scale=scale)
        return o.float(), lse.float()                        # o [B, q, Hq, D], lse [B, Hq, q]

    def knob(x):                                             # float or [Hq] -> [1, Hq|1, q]
        if isinstance(x, torch.Tensor):
            return x.to(device=q.device, dtype=torch.float32).view(1, Hq, 1).expand(1, Hq, Lq)
        return torch.full((1, 1, Lq), float(x), device=q.device)

    Tq, Sq = knob(T), knob(S)
    if q_is_ctx is not None:                                 # rows that are context slots: plain attention
        Tq = torch.where(q_is_ctx.view(-1, 1, Lq), 1.0, Tq)
        Sq = torch.where(q_is_ctx.view(-1, 1, Lq), 1.0, Sq)
    q_c = (qx.float() / Tq.transpose(1, 2)[..., None]).to(q.dtype)   # scores / T == (q / T) . k
    o_c, lse_c = part(allowed & ctx, q_c, sm)
    o_o, lse_o = part(allowed & ~ctx, qx, sm)
    a = Sq * Tq * lse_c
    wc = torch.sigmoid(a - lse_o).nan_to_num(0.0)            # softmax of two = sigmoid of the difference
    wc = torch.where(torch.isfinite(lse_c), torch.where(torch.isfinite(lse_o), wc, 1.0), 0.0)
    out = wc.transpose(1, 2)[..., None] * o_c.nan_to_num(0.0) + (1 - wc).transpose(1, 2)[..., None] * o_o.nan_to_num(0.0)
    return out.transpose(1, 2).to(q.dtype)                   # [B, Hq, q, D]


# ---------------------------------------------------------------------------------------------------------------------
# per-head calibration (beyond the paper): fit T and S per layer and query head so that the question's attention
# under parallel encoding looks like it does under full prefill
# ---------------------------------------------------------------------------------------------------------------------

PROBE_NAME = "kvpos_ape_probe"
GRID_T = tuple(round(0.30 + 0.05 * i, 2) for i in range(27))       # 0.30 .. 1.60
GRID_S = tuple(round(0.50 + 0.05 * i, 2) for i in range(21))       # 0.50 .. 1.50
_PROBE: "_Probe | None" = None


def _context_stats(s: torch.Tensor, ctx: torch.Tensor, ok: torch.Tensor, grid_t: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row statistics of question scores. s [Hq, R, N] float (already times sm); ctx [N] bool; ok [R, N] bool.

    Returns, per temperature t of grid_t [G]: entropy of softmax(s_C / t) over the allowed context slots
    [Hq, R, G], LSE_C(t) = log sum_C exp(s / t) [Hq, R, G]; and LSE_O over the other allowed slots [Hq, R]."""
    neg = torch.tensor(float("-inf"))
    sc = s.masked_fill(~(ok & ctx), neg)[..., None, :] / grid_t.view(-1, 1)        # [Hq, R, G, N]
    lse_c = torch.logsumexp(sc, -1)
    p = torch.exp(sc - lse_c[..., None])
    ent = -(p * torch.where(p > 0, sc - lse_c[..., None], torch.zeros(()))).sum(-1)
    lse_o = torch.logsumexp(s.masked_fill(~(ok & ~ctx), neg), -1)
    return ent, lse_c, lse_o


class _Probe:
    """Accumulates per-(layer, query head) means over question rows, for `calibrate_ape`.

    mode "full": entropy of the context distribution and log-odds of the context mass at T = S = 1 (full prefill,
    recorded by the probe attention function); mode "ape": the same as functions of T (and S) on a grid, from the
    raw scores under parallel encoding (recorded inside `ape_attention`)."""

    def __init__(self, L: int, Hq: int, grid_t: torch.Tensor, grid_s: torch.Tensor) -> None:
        self.L, self.Hq, self.gt, self.gs = L, Hq, grid_t, grid_s
        self.ent = torch.zeros(L, Hq, grid_t.numel(), dtype=torch.float64)
        self.lo = torch.zeros(L, Hq, grid_t.numel(), grid_s.numel(), dtype=torch.float64)
        self.n = torch.zeros(L, dtype=torch.float64)
        self.ctx: torch.Tensor | None = None      # full mode: [N] context columns of the current prompt
        self.rows = 0                             # full mode: the last `rows` queries are the question

    @staticmethod
    def _scores(q: torch.Tensor, k: torch.Tensor, sm: float) -> torch.Tensor:
        """q [1, Hq, R, D], k [1, H, N, D] -> [Hq, R, N] float scores."""
        g = q.shape[1] // k.shape[1]
        return (q[0].float() @ k[0].float().repeat_interleave(g, 0).transpose(-1, -2)) * sm

    def _add(self, layer: int, s: torch.Tensor, ctx: torch.Tensor, ok: torch.Tensor) -> None:
        ent, lse_c, lse_o = _context_stats(s.cpu(), ctx.cpu(), ok.cpu(), self.gt)
        keep = torch.isfinite(lse_c[0, :, 0]) & torch.isfinite(lse_o[0])       # rows that see both groups
        if not bool(keep.any()):
            return
        ent, lse_c, lse_o = ent[:, keep], lse_c[:, keep], lse_o[:, keep]
        lo = (self.gs.view(1, 1, 1, -1) * self.gt.view(1, 1, -1, 1) * lse_c[..., None]) - lse_o[..., None, None]
        w = float(keep.sum())
        self.ent[layer] += ent.double().sum(1)
        self.lo[layer] += lo.double().sum(1)
        self.n[layer] += w

    def record_full(self, layer: int, query: torch.Tensor, key: torch.Tensor, sm: float) -> None:
        N, R = key.shape[2], self.rows
        s = self._scores(query[:, :, -R:], key, sm)
        ok = torch.arange(N)[None] <= torch.arange(N - R, N)[:, None]             # causal rows of the question
        self._add(layer, s, self.ctx, ok)

    def record_ape(self, layer: int, query: torch.Tensor, key: torch.Tensor, allowed: torch.Tensor,
                   is_ctx: torch.Tensor, sm: float, q_is_ctx: torch.Tensor) -> None:
        rows = ~q_is_ctx[0]
        if query.shape[0] != 1 or not bool(rows.any()):
            return
        s = self._scores(query[:, :, rows], key, sm)
        self._add(layer, s, is_ctx[0], allowed[0, 0][rows])

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not bool((self.n > 0).all()):
            fail("calibrate_ape prompts", "question tokens that see both context and other slots in every layer",
                 f"no usable rows in layers {torch.nonzero(self.n == 0).flatten().tolist()}")
        d = self.n.view(-1, 1, 1)
        return self.ent / d, self.lo / d.view(-1, 1, 1, 1)


def _probe_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """sdpa, plus (while a probe is active) the question rows' context statistics of a full-prefill forward."""
    if _PROBE is not None and _PROBE.ctx is not None:
        sm = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        _PROBE.record_full(module.layer_idx, query, key, sm)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(PROBE_NAME, _probe_attention)
AttentionMaskInterface.register(PROBE_NAME, sdpa_mask)


@contextlib.contextmanager
def _probing(probe: "_Probe", model: torch.nn.Module | None = None) -> Iterator[None]:
    global _PROBE
    prev = model.config._attn_implementation if model is not None else None
    if model is not None:
        model.set_attn_implementation(PROBE_NAME)
    _PROBE = probe
    try:
        yield
    finally:
        _PROBE = None
        if model is not None:
            model.set_attn_implementation(prev)


@dataclass
class ApeCalibration:
    """Per-(layer, query head) APE knobs fitted by `calibrate_ape`; `use_ape(model, cache, **cal.knobs())`.

    temperature, scale: [L, Hq]; entropy_full / entropy_fit: mean context entropy of the question's attention
    under full prefill and under APE with the fitted T (calibration prompts); n_prompts: how many were used.
    Saved as plain JSON (`save` / `load`), never pickled."""

    temperature: torch.Tensor
    scale: torch.Tensor
    entropy_full: torch.Tensor
    entropy_fit: torch.Tensor
    n_prompts: int

    def knobs(self) -> dict[str, torch.Tensor]:
        return {"temperature": self.temperature, "scale": self.scale}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}, f)

    @classmethod
    def load(cls, path: str) -> "ApeCalibration":
        with open(path) as f:
            d = json.load(f)
        want = {"temperature", "scale", "entropy_full", "entropy_fit", "n_prompts"}
        if not isinstance(d, dict) or set(d) != want:
            fail(f"ApeCalibration file {path}", f"a JSON object with keys {sorted(want)}",
                 sorted(d) if isinstance(d, dict) else type(d).__name__)
        cal = cls(**{k: (torch.tensor(v, dtype=torch.float32) if k != "n_prompts" else int(v)) for k, v in d.items()})
        _check_ts(cal.temperature, cal.scale, tuple(cal.entropy_full.shape))
        return cal


@torch.no_grad()
def calibrate_ape(model: torch.nn.Module, chunk_cache: Any, prompts: Sequence[Any], rounds: int = 2,
                  fit_scale: bool = True, grid_t: Sequence[float] = GRID_T, grid_s: Sequence[float] = GRID_S,
                  progress: bool = True) -> ApeCalibration:
    """Fit APE's T and S per layer and query head on calibration prompts (never the evaluation items).

    prompts: PromptParts (anchor = chunk_cache's anchor, chunks, question). For the question tokens, per layer and
    head: T is the grid value whose tempered context entropy under parallel encoding is closest to the entropy under
    full prefill; S (if fit_scale, else 1) is the grid value that matches the mean log-odds of the context mass
    (S*T*LSE_C - LSE_O vs LSE_C - LSE_O of full prefill). Later layers depend on earlier layers' knobs, so the
    parallel statistics are re-measured `rounds` times, each under the previous round's fit."""
    from tqdm import tqdm

    if not prompts:
        fail("calibrate_ape prompts", "a non-empty list of PromptParts", "[]")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        fail("calibrate_ape rounds", "an int >= 1", rounds)
    L, Hq = _layers_heads(model)
    gt = torch.tensor([float(x) for x in grid_t], dtype=torch.float32)
    gs = torch.tensor([float(x) for x in grid_s] if fit_scale else [1.0], dtype=torch.float32)
    _check_ts(gt.view(1, -1), gs.view(1, -1))
    A = int(chunk_cache.anchor.length)
    bar = tqdm(total=len(prompts) * (rounds + 1), desc="calibrate_ape", disable=not progress, file=sys.stdout)
    full = _Probe(L, Hq, torch.ones(1), torch.ones(1))
    with _probing(full, model):
        for p in prompts:
            ids = p.full_ids()
            full.ctx = torch.zeros(ids.shape[1], dtype=torch.bool)
            full.ctx[A:A + sum(int(c.numel()) for c in p.chunks)] = True
            full.rows = int(p.question.numel())
            model(ids, use_cache=False)
            bar.update()
    ent_full, lo_full = (x[..., 0] for x in full.means())            # [L, Hq], [L, Hq, 1]
    lo_full = lo_full[..., 0]
    T, S = torch.ones(L, Hq), torch.ones(L, Hq)
    for _ in range(rounds):
        par = _Probe(L, Hq, gt, gs)
        with _probing(par):
            for p in prompts:
                cache, _ = chunk_cache.compose(p.chunks, layout="parallel")
                ape_extend(model, cache, p.question[None], temperature=T, scale=S)
                bar.update()
        ent, lo = par.means()                                          # [L, Hq, G], [L, Hq, G, Gs]
        ti = (ent - ent_full[..., None]).abs().argmin(-1)              # [L, Hq]
        lo_t = lo.gather(2, ti[..., None, None].expand(L, Hq, 1, gs.numel()))[:, :, 0]
        si = (lo_t - lo_full[..., None]).abs().argmin(-1)
        T, S = gt[ti], gs[si]
        ent_fit = ent.gather(2, ti[..., None])[..., 0]
    bar.close()
    return ApeCalibration(T, S, ent_full.float(), ent_fit.float(), len(prompts))
