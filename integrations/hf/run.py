"""Running a transformers model on a PositionedCache: extend / generate with explicit positions, the independent
reference forward, and access to a decoder's layers for partial recomputation.

Letters: B batch · T cached slots · S new tokens · V vocab.

transformers builds its attention mask from slot counts, not positions, so a cache whose positions are not 0..T-1
needs explicit `position_ids` (and a 2-D mask for hidden slots): `generate` and `extend` pass both. Both are atomic:
if the model raises (any layer, any step, Ctrl-C) the cache is left exactly as it was before the call.

The walk of positions: extend/generate compute `position_ids` [B, S] -> model.forward -> each attention layer rotates
q/k and calls cache.update(k, v, layer, kwargs={"position_ids"}) -> PositionedCache.update reads them once per
forward -> PositionedKV.write_rotated_ appends them to the slot table, which attention backends read through the
binding (kvpos.integrations.hf.attention).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from kvpos._checks import as_positions, check_tensor, fail
from kvpos.cache import PositionedKV

from .attention import AttentionBackend, bind_attention

__all__ = ["extend", "generate", "forward_reference", "additive_mask", "layer_masks", "decoder_parts",
           "run_decoder_layers", "cache_kwarg", "check_vocab"]


def cache_kwarg(fn: Any) -> str:
    """The name under which `fn` (a model's forward, a decoder layer's forward) takes the cache: "cache" from
    transformers 5.20 on, "past_key_values" before (vLLM pins transformers < 5.20)."""
    import inspect

    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def takes_logits_to_keep(fn: Any) -> bool:
    """Whether `fn` (a model's forward) takes logits_to_keep (transformers causal LMs do)."""
    import inspect

    return "logits_to_keep" in inspect.signature(fn).parameters


def logits_kwargs(fn: Any, last_only: bool) -> dict[str, int]:
    """{"logits_to_keep": 1} when only the last position's logits are wanted and `fn` (a model's forward) takes
    it; refuses a forward without it rather than silently returning every position's logits."""
    if not last_only:
        return {}
    if not takes_logits_to_keep(fn):
        fail("last_logits", "a model whose forward takes logits_to_keep (transformers causal LMs)",
             f"{type(getattr(fn, '__self__', fn)).__name__}.forward without it", "pass last_logits=False")
    return {"logits_to_keep": 1}


def _check_ids(what: str, ids: Any, cache: PositionedKV) -> torch.Tensor:
    ids = check_tensor(what, ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int32, torch.int64) or ids.shape[1] == 0:
        fail(what, "token ids [B, S] (int64, S >= 1)", f"{tuple(ids.shape)} {ids.dtype}")
    B = cache.batch_size
    if B > 0 and ids.shape[0] != B:
        fail(what, f"batch {B} (the cache's)", ids.shape[0])
    cache.check_idle(what)
    return ids.long()


def check_vocab(what: str, model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Token ids must index the model's input embedding: [0, V). Raises ValueError naming the offenders."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    V = getattr(emb, "num_embeddings", None)
    if V is None or ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= V:
        fail(what, f"token ids in [0, {V}) (the model's vocabulary)", f"min {lo}, max {hi}",
             "tokenize with the model's own tokenizer")


def _new_positions(cache: PositionedKV, ids: torch.Tensor, positions: Any) -> torch.Tensor:
    B, S = ids.shape
    if positions is None:
        start = cache.next_position().to(ids.device)
        if start.numel() == 1 and B > 1:
            start = start.expand(B)
        return start[:, None] + torch.arange(S, device=ids.device)
    return as_positions("positions", positions, B, S, ids.device)


def _scope(model: torch.nn.Module, attention: AttentionBackend | None, cache: PositionedKV):
    return bind_attention(model, attention, cache) if attention is not None else contextlib.nullcontext()


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = may attend) as transformers' additive float mask of `dtype`."""
    if allowed.dtype != torch.bool:
        return allowed.to(dtype)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def layer_masks(model: torch.nn.Module, mask: torch.Tensor, q_slots: torch.Tensor) -> Any:
    """The custom 4-D additive mask [B, 1, S, T] of a forward whose queries sit at cache slots q_slots [S], as the
    model needs it: transformers hands a 4-D mask unchanged to every layer, so on a model with sliding-window layers
    it would let those layers see past their window. Full-attention models get `mask`; models whose config lists
    sliding layers (`layer_types`, e.g. Gemma 3) get {layer type: mask}, the sliding ones also hiding keys at slot
    <= q_slot - sliding_window (transformers' own window); models with a window and no layer types (Mistral) get
    the windowed mask. Chunked attention is refused."""
    if mask.dim() != 4 or mask.shape[-2] != q_slots.numel():
        fail("layer_masks mask", f"a 4-D [B, 1, {q_slots.numel()}, T] mask (one row per query slot)",
             list(mask.shape))
    cfg = getattr(model, "config", None)
    window = getattr(cfg, "sliding_window", None)
    types = set(getattr(cfg, "layer_types", None) or ())
    if "chunked_attention" in types:
        fail("custom attention mask", "full or sliding-window attention layers", "chunked_attention layers")
    sliding = "sliding_attention" in types or (not types and window is not None)
    if not sliding or window is None:
        return mask
    far = torch.arange(mask.shape[-1])[None] <= q_slots.reshape(-1, 1) - int(window)      # [S, T]
    windowed = mask.masked_fill(far, torch.finfo(mask.dtype).min)
    if not types:
        return windowed
    return {t: windowed if t == "sliding_attention" else mask for t in types}


@torch.no_grad()
def extend(model: torch.nn.Module, cache: PositionedKV, ids: torch.Tensor, positions: Any = None,
           segment: int = 0, attention_mask: torch.Tensor | None = None,
           attention: AttentionBackend | None = None, last_logits: bool = False) -> torch.Tensor:
    """Run the model on `ids` [B, S] at `positions` (default: after the cache), attending to the visible slots.

    The new slots are appended to `cache` (cache: modified in place, labelled `segment`). Returns logits [B, S, V],
    or [B, 1, V] (the last position's only) with last_logits=True: the LM head then runs on one position instead of
    S, for callers that only fill the cache.
    attention_mask: optional 4-D [B, 1, S, T+S] bool mask (True = attend) replacing the default causal one.
    attention: an attention backend (e.g. ApeBackend, WindowBackend) bound for this call.
    """
    ids = _check_ids("extend ids", ids, cache)
    check_vocab("extend ids", model, ids)
    pos = _new_positions(cache, ids, positions)
    cache.check_new_positions(pos, "extend positions")
    T = cache.num_slots
    if attention_mask is None:
        mask = cache.attention_mask(ids.shape[1]).to(ids.device)
        if bool(mask.all()):
            mask = None
    else:
        want = (ids.shape[0], 1, ids.shape[1], T + ids.shape[1])
        if attention_mask.dim() != 4 or attention_mask.shape[0] not in (1, want[0]) or \
                tuple(attention_mask.shape[1:]) != want[1:]:
            fail("extend attention_mask", f"a 4-D [B|1, 1, S, T+S] = {list(want)} mask", list(attention_mask.shape))
        mask = layer_masks(model, additive_mask(attention_mask, model.dtype), torch.arange(T, T + ids.shape[1]))
    with cache.appending(), _scope(model, attention, cache):
        out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                    **{cache_kwarg(model.forward): cache}, **logits_kwargs(model.forward, last_logits))
        if segment:
            cache.set_segment_(T, cache.num_slots, segment)
    return out.logits


def generate(model: torch.nn.Module, cache: PositionedKV, new_ids: torch.Tensor, positions: Any = None,
             attention: AttentionBackend | None = None, **gen_kwargs: Any) -> torch.Tensor:
    """`model.generate` continuing after `cache`: new_ids [B, S] start at `positions` (default: next_position()).

    Passes the 2-D mask over cached + new slots (hidden slots masked) and explicit position_ids, the two things
    transformers needs when positions are not 0..T-1. Returns what generate returns: new_ids followed by the
    generated tokens, [B, S + new]. The cache grows by the new tokens (cache: modified in place). attention: a
    backend bound for the whole generation (the question and every generated token).
    """
    new_ids = _check_ids("generate new_ids", new_ids, cache)
    check_vocab("generate new_ids", model, new_ids)
    for k in ("cache", "past_key_values", "position_ids"):
        if k in gen_kwargs:
            fail(f"generate {k}", "not given (kvpos sets it from the cache)", "a value", "pass positions= instead")
    with cache.appending(), _scope(model, attention, cache):
        if cache.num_slots == 0 and positions is None:
            return model.generate(new_ids, **{cache_kwarg(model.forward): cache}, **gen_kwargs)
        pos = _new_positions(cache, new_ids, positions)
        cache.check_new_positions(pos, "generate positions")
        mask = gen_kwargs.pop("attention_mask", None)
        full = cache.attention_mask(new_ids.shape[1]).to(new_ids.device)
        if mask is not None:
            if mask.shape != new_ids.shape:
                fail("generate attention_mask", f"[B, S]={tuple(new_ids.shape)} over the new ids", tuple(mask.shape))
            full[:, cache.num_slots:] = mask
        return model.generate(new_ids, attention_mask=full, position_ids=pos, **{cache_kwarg(model.forward): cache},
                              **gen_kwargs)


@torch.no_grad()
def forward_reference(model: torch.nn.Module, ids: torch.Tensor, position_ids: torch.Tensor,
                      allowed: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] of ONE model forward over ids [B, S] with explicit position_ids [B, S] and a 4-D mask
    allowed [B, 1, S, S] (True = may attend). No cache involved: the ground truth for every exactness test."""
    mask = layer_masks(model, additive_mask(allowed, model.dtype), torch.arange(ids.shape[1]))
    return model(input_ids=ids, position_ids=position_ids, attention_mask=mask, use_cache=False).logits


def decoder_parts(model: torch.nn.Module, what: str) -> tuple[Any, Any, Any]:
    """(decoder, its layers, its rotary module) of a Llama-style causal LM with full-attention layers only, for
    running a subset of layers on a subset of tokens; refuses other models naming `what` needs it."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or not hasattr(base, "rotary_emb") or not hasattr(base, "embed_tokens"):
        fail(f"{what} model", "a Llama-style decoder (model.model.layers / rotary_emb / embed_tokens)",
             type(model).__name__)
    lt = getattr(model.config, "layer_types", None)
    if lt and any(t != "full_attention" for t in lt):
        fail(f"{what} model", "full-attention layers only", sorted(set(lt)))
    if hasattr(base, "embed_scale") or getattr(model.config, "model_type", "") == "gemma":
        fail(f"{what} model", "no embedding scaling (Gemma)", model.config.model_type)
    return base, layers, base.rotary_emb


def run_decoder_layers(layers: Any, lo: int, hi: int, hidden: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                       cache: PositionedKV, rotary: Any) -> torch.Tensor:
    """Run decoder layers [lo, hi) on hidden [1, S, hidden] at positions pos [1, S] with an additive 4-D mask,
    writing into `cache` (inside cache.overwriting(...) for recomputation). Returns the new hidden states."""
    pe = rotary(hidden, pos)
    for i in range(lo, hi):
        hidden = layers[i](hidden, attention_mask=mask, position_ids=pos, use_cache=True, position_embeddings=pe,
                           **{cache_kwarg(layers[i].forward): cache})
        if isinstance(hidden, tuple):
            hidden = hidden[0]
    return hidden
