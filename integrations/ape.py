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
import math
from typing import Any, Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvpos._checks import fail
from kvpos.integrations.compose import SEG_CHUNK0, Anchor, encode_chunk
from kvpos.integrations.hf import PositionedCache, active_cache, extend, generate
from kvpos.store import ChunkKV, Fingerprint

__all__ = ["NAME", "DEFAULT_TEMPERATURE", "DEFAULT_SCALE", "ape_attend", "ape_attention", "use_ape", "ape_extend",
           "ape_generate", "block_diagonal_allowed", "encode_chunks_batched", "xformers_available"]

NAME = "kvpos_ape"
# chosen by the sweep `bench/rag_eval.py --n 20 --n-cont 0 --only parallel --ape --sweep --single-message`
# (results/ape_sweep_single_message.md: T=0.7,S=1.0 keeps 94% of full-prefill accuracy vs 44% for plain parallel);
# the APE paper/repo default is T=S=0.9 (89% there)
DEFAULT_TEMPERATURE = 0.7
DEFAULT_SCALE = 1.0


def _check_ts(temperature: float, scale: float) -> tuple[float, float]:
    for what, v in (("temperature", temperature), ("scale", scale)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            fail(f"APE {what}", "a finite float > 0", v)
    return float(temperature), float(scale)


def ape_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, is_ctx: torch.Tensor,
               sm_scale: float, temperature: float, scale: float, q_is_ctx: torch.Tensor | None = None
               ) -> torch.Tensor:
    """APE attention, torch (CPU or GPU). Returns [B, Hq, q, D] in q's dtype.

    q [B, Hq, q, D] rotated queries; k/v [B, H, N, D]; allowed [B|1, 1, q, N] bool; is_ctx [B|1, N] bool;
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
    T = torch.full((q_is_ctx.shape[0] if q_is_ctx is not None else 1, 1, 1, Lq, 1), temperature)
    Sc = torch.full_like(T, scale)
    if q_is_ctx is not None:
        plain = q_is_ctx.view(q_is_ctx.shape[0], 1, 1, Lq, 1)
        T, Sc = T.masked_fill(plain, 1.0), Sc.masked_fill(plain, 1.0)
    T, Sc = T.to(s.device), Sc.to(s.device)
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
    T, S = params
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


@contextlib.contextmanager
def use_ape(model: torch.nn.Module, cache: PositionedCache, temperature: float = DEFAULT_TEMPERATURE,
            scale: float = DEFAULT_SCALE) -> Iterator[None]:
    """Within the block, `model` attends with APE (T=temperature, S=scale) over `cache`'s context slots."""
    T, S = _check_ts(temperature, scale)
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
    """Two memory_efficient_attention calls (context with scale sm/T, others with sm) returning LSEs, merged as
    APE. Masks are dense additive biases (the question/generation phase has few queries)."""
    import xformers.ops as xops

    B, Hq, Lq, D = q.shape
    H, N = k.shape[1], k.shape[2]
    g = Hq // H
    kx = k.repeat_interleave(g, 1).transpose(1, 2)          # [B, N, Hq, D]
    vx = v.repeat_interleave(g, 1).transpose(1, 2)
    qx = q.transpose(1, 2)                                   # [B, q, Hq, D]
    ctx = is_ctx.view(-1, 1, 1, N)

    def part(mask, scale):
        bias = torch.zeros(B, Hq, Lq, N, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        o, lse = xops.memory_efficient_attention_forward_requires_grad(qx, kx, vx, attn_bias=bias, scale=scale)
        return o.float(), lse.float()                        # o [B, q, Hq, D], lse [B, Hq, q]

    o_c, lse_c = part(allowed & ctx, sm / T)
    o_o, lse_o = part(allowed & ~ctx, sm)
    Tq = torch.full((1, 1, Lq), T, device=q.device)
    Sq = torch.full((1, 1, Lq), S, device=q.device)
    if q_is_ctx is not None:
        Tq = Tq.masked_fill(q_is_ctx.view(-1, 1, Lq), 1.0)
        Sq = Sq.masked_fill(q_is_ctx.view(-1, 1, Lq), 1.0)
    a = Sq * Tq * lse_c
    wc = torch.sigmoid(a - lse_o).nan_to_num(0.0)            # softmax of two = sigmoid of the difference
    wc = torch.where(torch.isfinite(lse_c), torch.where(torch.isfinite(lse_o), wc, 1.0), 0.0)
    out = wc.transpose(1, 2)[..., None] * o_c.nan_to_num(0.0) + (1 - wc).transpose(1, 2)[..., None] * o_o.nan_to_num(0.0)
    return out.transpose(1, 2).to(q.dtype)                   # [B, Hq, q, D]
