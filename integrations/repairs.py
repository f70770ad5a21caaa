"""Fidelity repairs, one room for edits (PIE) and chunk reuse (RAG) alike: re-encode chosen slots in place.

    recompute_slots       re-encode slots (all layers, one forward) with a given visibility: the primitive
    blend_recompute       CacheBlend: layers 0-1 for every candidate, the most deviating fraction through the rest
    AttentionMassProbe    an attention backend that records how much query rows read each cached slot
    layer_attention_mass  the same per layer (attention_mass_of is its mean over layers)
    attention_mass_of     how much probe tokens placed after the cache (e.g. the question) read each slot
    attention_mass        how much the document's own last tokens read each earlier slot (PIE)
    query_aware_refresh   re-encode the fraction of candidate slots the probe tokens read most (RAG `seq_attn`)
    chunks_read_most      which whole chunks the probe tokens read most (RAG `probe_chunks`)
    attention_refresh     PIE's pie+attn: re-encode the last tokens and the stale slots they read most

Every repair leaves the cache consistent (a failed forward rolls back) and returns the number of tokens it encoded.
"""
from __future__ import annotations


import torch

from kvpos._checks import check_fraction, check_int, fail
from kvpos.cache import PositionedKV
from kvpos.integrations.hf import AttentionCall, Binding, additive_mask, bind_attention, extend, layer_masks
from kvpos.integrations.hf.run import cache_kwarg, decoder_parts, run_decoder_layers, takes_logits_to_keep

__all__ = ["recompute_slots", "blend_recompute", "AttentionMassProbe", "attention_mass_of", "layer_attention_mass",
           "attention_mass",
           "query_aware_refresh", "chunks_read_most", "attention_refresh"]


def recompute_slots(model: torch.nn.Module, cache: PositionedKV, slots: torch.Tensor, ids: torch.Tensor,
                    allowed: torch.Tensor) -> int:
    """Re-encode the tokens `ids` [S] that sit at `slots` [S] of `cache` in ONE forward (all layers): slot slots[i]
    attends to the slots where allowed[i] [S, T] is True; the new keys/values overwrite the slots in place
    (positions unchanged; on an error the slots keep their old contents). Returns S."""
    if slots.numel() == 0:
        return 0
    mask = additive_mask(allowed[:, :cache.num_slots], next(model.parameters()).dtype)[None, None]
    mask = layer_masks(model, mask, slots)
    pos = cache.positions[:, slots]
    no_head = {"logits_to_keep": 1} if takes_logits_to_keep(model.forward) else {}   # the update needs no logits
    with cache.overwriting(slots):
        model(input_ids=ids[None], position_ids=pos, attention_mask=mask, use_cache=True,
              **{cache_kwarg(model.forward): cache}, **no_head)
    return int(slots.numel())


def blend_recompute(model: torch.nn.Module, cache: PositionedKV, slots: torch.Tensor, ids: torch.Tensor,
                    allowed: torch.Tensor, ratio: float, n_first: int = 2) -> int:
    """CacheBlend on stale slots: refresh layers 0..n_first-1 for every token `ids` [S] at `slots` [S] (ascending;
    slot slots[i] attends where allowed[i] [S, N] is True), pick the top `ratio` of them by the deviation of their
    layer n_first-1 values (refreshed vs stored), carry those through the remaining layers. The KV of the carried
    tokens replace the stored ones in place; the others keep their stale KV beyond layer n_first-1.
    Returns the number of tokens carried through all layers."""
    base, layers, rotary = decoder_parts(model, "selective recompute (CacheBlend)")
    S = int(slots.numel())
    if S == 0:
        return 0
    pos = cache.positions[:, slots]
    mask = additive_mask(allowed[:, :cache.num_slots], next(model.parameters()).dtype)[None, None]
    hidden = base.embed_tokens(ids[None])
    n_first = min(n_first, len(layers))
    v_old = cache.layers[n_first - 1].v[:, :, slots].clone()
    with cache.overwriting(slots):
        hidden = run_decoder_layers(layers, 0, n_first, hidden, pos, mask, cache, rotary)
    if n_first == len(layers):
        return S
    dev = (cache.layers[n_first - 1].v[:, :, slots] - v_old).float().pow(2).sum(dim=(1, 3))[0]   # [S]
    n_sel = max(1, int(round(ratio * S)))
    sel = torch.topk(dev, n_sel).indices.sort().values
    with cache.overwriting(slots[sel]):
        run_decoder_layers(layers, n_first, len(layers), hidden[:, sel], pos[:, sel], mask[:, :, sel], cache, rotary)
    return n_sel


class AttentionMassProbe:
    """Attention backend for pie+attn: eager attention (the same numbers as transformers' eager implementation),
    recording per layer the attention probabilities of the query rows over the first `n_keys` slots, averaged over
    query heads and rows (`mass`, one [n_keys] float32 tensor per layer; per_head=True: over rows only, [Hq,
    n_keys])."""

    needs_cache = False

    def __init__(self, n_keys: int, per_head: bool = False) -> None:
        self.n_keys = n_keys
        self.mean_dims = (1,) if per_head else (0, 1)
        self.mass: list[torch.Tensor] = []

    def __call__(self, call: AttentionCall, binding: Binding) -> torch.Tensor:
        q, k, v = call.query, call.key, call.value
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        w = torch.matmul(q, k.transpose(2, 3)) * call.scaling
        if call.mask is not None:
            m = call.mask[..., -k.shape[2]:]
            w = w + m if m.dtype != torch.bool else w.masked_fill(~m, torch.finfo(w.dtype).min)
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        self.mass.append(w[0, :, :, :self.n_keys].float().mean(dim=self.mean_dims))
        return torch.matmul(w, v).transpose(1, 2).contiguous()


def layer_attention_mass(model: torch.nn.Module, cache: PositionedKV, probe_ids: torch.Tensor,
                positions: torch.Tensor | None) -> torch.Tensor:
    """How much tokens `probe_ids` [q] placed after the cache (at `positions` [q], default next_position()..) read
    each cached slot, per layer: attention probabilities averaged over query heads and probe rows, [L, N] float32.
    The cache is left as it was."""
    N = cache.num_slots
    if N == 0 or probe_ids.numel() == 0:
        fail("attention_mass_of", "a non-empty cache and probe", f"{N} slots, {probe_ids.numel()} probe tokens")
    probe = AttentionMassProbe(N)
    try:
        extend(model, cache, probe_ids.reshape(1, -1), positions=positions, attention=probe)
    finally:
        cache.crop(N - cache.num_slots)
    if not probe.mass:
        fail("attention_mass_of model", "attention calls through kvpos's attention binding", "none")
    return torch.stack(probe.mass)


@torch.no_grad()
def attention_mass_of(model: torch.nn.Module, cache: PositionedKV, probe_ids: torch.Tensor,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
    """How much tokens `probe_ids` [q], placed after the cache (at `positions` [q], default next_position()..),
    read each cached slot: their attention probabilities over the N slots (hidden ones get 0), averaged over
    layers, query heads and probe rows. The cache is left as it was (the probe's slots are cropped). Returns [N]."""
    return layer_attention_mass(model, cache, probe_ids, positions).mean(0)


def query_aware_refresh(model: torch.nn.Module, cache: PositionedKV, candidates: torch.Tensor, ids: torch.Tensor,
                        probe_ids: torch.Tensor, ratio: float, allowed: torch.Tensor) -> int:
    """Re-encode (all layers, one forward, in place) the `ratio` of the `candidates` slots [C] (token ids [C]) that
    the probe tokens [q] (e.g. the question) read most, each attending where allowed[c] [C, N] is True. Returns the
    number of tokens re-encoded."""
    ratio = check_fraction("query_aware_refresh ratio", ratio)
    n_sel = int(round(ratio * candidates.numel()))
    if n_sel == 0:
        return 0
    if n_sel < candidates.numel():
        mass = attention_mass_of(model, cache, probe_ids)
        pick = torch.topk(mass[candidates], n_sel).indices.sort().values
    else:
        pick = torch.arange(candidates.numel())
    return recompute_slots(model, cache, candidates[pick], ids[pick], allowed[pick])


def chunks_read_most(model: torch.nn.Module, cache: PositionedKV, chunk_slots: "list[tuple[int, int]]",
                     probe_ids: torch.Tensor, m: int) -> list[int]:
    """Indices (ascending) of the `m` chunks (slots [start, end) each) that the probe tokens [q] (the question) read
    most, with recency taken out. On a copy of the cache every chunk is moved to end right before the probe
    (positions are data: all chunks at the same distance from it), the probe runs after the cache's last position,
    and a chunk's score is the mean attention probability over its slots without its first token and its last 5
    (turn separators; a chunk of 7 tokens or fewer keeps all its slots), averaged over the upper half of the layers,
    query heads and probe rows. The cache is left as it was.

    Why (calibration questions, experiments/probe_rank.py): at the composed positions the question reads the chunk
    nearest to it most, whatever it holds, so the rule picked the last chunk; at equal distance the gold passage
    ranks first far more often (results/probe_rank.md)."""
    if check_int("chunks_read_most m", m) < 0:
        fail("chunks_read_most m", "an int >= 0", m)
    if m == 0:
        return []
    if m >= len(chunk_slots):
        return list(range(len(chunk_slots)))
    start = int(cache.positions.max()) + 1
    equal = cache.copy()
    for s, e in chunk_slots:
        equal.set_positions_(s, e, torch.arange(start - (e - s), start, dtype=torch.long))
    pos = torch.arange(start, start + probe_ids.numel(), dtype=torch.long)
    mass = layer_attention_mass(model, equal, probe_ids, pos)
    mass = mass[mass.shape[0] // 2:].mean(0)
    per = torch.stack([mass[s + 1:e - 5].mean() if e - s > 7 else mass[s:e].mean() for s, e in chunk_slots])
    return sorted(torch.topk(per, m).indices.tolist())


@torch.no_grad()
def attention_mass(model: torch.nn.Module, cache: PositionedKV, n_probe: int, ids: torch.Tensor) -> torch.Tensor:
    """How much the last `n_probe` tokens of the document read each earlier slot: their attention probabilities
    (causal, over the cache's first N - n_probe slots), averaged over layers, query heads and the probe rows.
    ids [N] are the document's token ids (slot j = token j at position j). The cache is not changed.
    Returns [N - n_probe] float32."""
    N = cache.num_slots
    if check_int("attention_mass n_probe", n_probe) < 1 or N < 2:
        fail("attention_mass", "n_probe >= 1 and a cache of at least 2 slots", f"n_probe={n_probe}, {N} slots")
    q = min(n_probe, N - 1)
    c = cache.copy()
    c.keep_(torch.arange(N - q))
    allowed = torch.arange(N)[None] <= torch.arange(N - q, N)[:, None]                 # [q, N] causal
    mask = layer_masks(model, additive_mask(allowed, next(model.parameters()).dtype)[None, None],
                       torch.arange(N - q, N))
    probe = AttentionMassProbe(N - q)
    with bind_attention(model, probe):
        model(input_ids=ids[None, N - q:], position_ids=cache.positions[:, N - q:], attention_mask=mask,
              use_cache=True, **{cache_kwarg(model.forward): c})
    if not probe.mass:
        fail("pie+attn model", "attention calls through kvpos's attention binding", "none")
    return torch.stack(probe.mass).mean(0)


def attention_refresh(model: torch.nn.Module, cache: PositionedKV, stale: torch.Tensor, ids: torch.Tensor,
                       ratio: float, n_probe: int) -> int:
    """pie+attn's repair, in place: re-encode (all layers, one forward, causal over the document) the last n_probe
    tokens and the `ratio` of the other stale slots [S] that those tokens attend to most. Returns tokens encoded."""
    N = cache.num_slots
    q = min(n_probe, N - 1)
    if stale.numel() == 0 or q < 1:
        return 0
    cand = stale[stale < N - q]
    n_sel = int(round(ratio * cand.numel()))
    picked = cand if n_sel == cand.numel() else cand[:0]
    if 0 < n_sel < cand.numel():
        mass = attention_mass(model, cache, q, ids)
        picked = cand[torch.topk(mass[cand], n_sel).indices]
    slots = torch.cat([picked, torch.arange(N - q, N)]).sort().values
    allowed = torch.arange(N)[None] <= slots[:, None]
    return recompute_slots(model, cache, slots, ids[slots], allowed)
