"""Position-independent chunk reuse: anchors, chunk encoding, compose() with fidelity repairs.

Letters: A anchor tokens · S chunk tokens · Q question tokens · L layers · H kv heads · D head_dim.

    anchor (BOS / system prompt / user header), cached once at positions 0..A-1, visible to every chunk
    chunk_i encoded ONCE after the anchor at positions A..A+S_i-1 (sees anchor + itself), stored raw

compose() places stored chunks in any subset and order:

    sequential: | anchor 0..A-1 | c1 A..A+S1-1 | c2 A+S1..  | ... | question P.. |
    parallel:   | anchor 0..A-1 | c1 A..A+S1-1 | c2 A..A+S2-1 | ... | question A+max(S_i).. |

Repairs (optional, measured in bench/rag_eval.py):
    link_k (EPIC LegoLink): the first k tokens of every chunk after the first are re-encoded at their final
        positions, attending to everything placed before them (sequential layout).
    recompute_ratio (CacheBlend): layers 0-1 are recomputed for all chunk tokens; the r% of tokens whose layer-1
        values deviate most are carried through the remaining layers, their KV replacing the stored ones.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from kvpos._checks import as_token_ids, check_fraction, fail
from kvpos.store import ChunkKV, ChunkStore, Fingerprint, MemoryBackend, model_fingerprint
from kvpos.integrations.hf import PositionedCache, _additive, extend

__all__ = ["SEG_ANCHOR", "SEG_QUERY", "SEG_CHUNK0", "Anchor", "ChunkCache", "compose", "ComposeInfo",
           "layout_allowed", "recompute_slots", "blend_recompute"]

SEG_QUERY = 0        # question and generated tokens
SEG_ANCHOR = 1       # the shared anchor prefix
SEG_CHUNK0 = 16      # chunk i is labelled SEG_CHUNK0 + i (APE treats segment >= SEG_CHUNK0 as context)


def _ids1d(what: str, ids: Any) -> torch.Tensor:
    t = as_token_ids(what, ids)
    if t.numel() == 0:
        fail(what, "at least one token", "an empty sequence")
    return t


@dataclass
class Anchor:
    """The shared prefix: ids [A] and its cache at positions 0..A-1 (segment SEG_ANCHOR)."""

    ids: torch.Tensor
    cache: PositionedCache

    @property
    def length(self) -> int:
        return int(self.ids.numel())

    @classmethod
    @torch.no_grad()
    def encode(cls, model: torch.nn.Module, ids: Any) -> "Anchor":
        ids = _ids1d("anchor ids", ids)
        cache = PositionedCache.from_model(model)
        extend(model, cache, ids[None], segment=SEG_ANCHOR)
        return cls(ids, cache)


@torch.no_grad()
def encode_chunk(model: torch.nn.Module, anchor: Anchor, ids: Any, fingerprint: Fingerprint) -> ChunkKV:
    """Encode one chunk after the anchor (positions A..A+S-1) and return its raw KV (the anchor's slots excluded)."""
    ids = _ids1d("chunk ids", ids)
    cache = anchor.cache.copy()
    extend(model, cache, ids[None])
    A = anchor.length
    keys = torch.stack([l.raw_k[0, :, A:cache.num_slots] for l in cache.layers])    # [L, H, S, D]
    values = torch.stack([l.v[0, :, A:cache.num_slots] for l in cache.layers])
    return ChunkKV(ids.clone(), keys.contiguous(), values.contiguous(), A, fingerprint)


class ChunkCache:
    """A model + anchor + ChunkStore: chunks are computed on a miss and stored; `compose` builds request caches.

        cc = ChunkCache(model, anchor_ids)                       # memory store by default
        cc.precompute([ids1, ids2, ...])                         # progress bar
        cache, info = cc.compose([ids2, ids1], layout="sequential", link_k=8)
    """

    def __init__(self, model: torch.nn.Module, anchor_ids: Any, store: ChunkStore | None = None,
                 backend: Any = None, namespace: str = "default", **store_kw: Any) -> None:
        self.model = model
        self.anchor = Anchor.encode(model, anchor_ids)
        specs = [l.spec for l in self.anchor.cache.layers]
        self.fingerprint = model_fingerprint(model, self.anchor.ids, specs)
        if store is None:
            store = ChunkStore(backend or MemoryBackend(), self.fingerprint, namespace=namespace, **store_kw)
        elif store.fingerprint != self.fingerprint:
            fail("ChunkCache store", f"a store with fingerprint [{self.fingerprint.short()}]",
                 f"[{store.fingerprint.short()}]", "build the store with ChunkCache's fingerprint")
        self.store = store

    def get_or_compute(self, ids: Any) -> tuple[ChunkKV, bool]:
        """(chunk, hit): from the store, or computed now and stored."""
        ids = _ids1d("chunk ids", ids)
        chunk = self.store.get(ids)
        if chunk is not None:
            return chunk, True
        chunk = encode_chunk(self.model, self.anchor, ids, self.fingerprint)
        self.store.put(chunk)
        return chunk, False

    def precompute(self, chunks: Sequence[Any], progress: bool = True) -> int:
        """Compute and store every chunk not yet stored; returns how many were computed."""
        n = 0
        for ids in tqdm(chunks, desc="precompute chunks", disable=not progress, unit="chunk"):
            _, hit = self.get_or_compute(ids)
            n += not hit
        return n

    def compose(self, chunks: Sequence[Any], layout: str = "sequential", link_k: int = 0,
                recompute_ratio: float = 0.0) -> tuple[PositionedCache, "ComposeInfo"]:
        """Cache for anchor + `chunks` (token ids, fetched or computed) in this order; see `compose`."""
        t0 = time.perf_counter()
        got = [self.get_or_compute(c) for c in chunks]
        t_fetch = time.perf_counter() - t0
        cache, info = compose(self.model, self.anchor, [c for c, _ in got], layout, link_k, recompute_ratio)
        info.hits = sum(h for _, h in got)
        info.misses = len(got) - info.hits
        info.tokens_computed += sum(c.num_tokens for c, h in got if not h)
        info.fetch_s = t_fetch
        return cache, info


@dataclass
class ComposeInfo:
    """What compose() did: per-chunk slot ranges and positions, tokens recomputed, timings."""

    layout: str
    slots: list[tuple[int, int]] = field(default_factory=list)      # [start, end) slot range of each chunk
    starts: list[int] = field(default_factory=list)                 # position of each chunk's first token
    next_position: int = 0
    tokens_computed: int = 0
    tokens_reused: int = 0
    hits: int = 0
    misses: int = 0
    fetch_s: float = 0.0
    compose_s: float = 0.0


def _check_chunks(anchor: Anchor, chunks: Sequence[ChunkKV]) -> None:
    if not chunks:
        fail("compose chunks", "at least one ChunkKV", "none")
    fp = None
    for i, c in enumerate(chunks):
        if not isinstance(c, ChunkKV):
            fail(f"compose chunks[{i}]", "a ChunkKV", type(c).__name__, exc=TypeError)
        if c.start != anchor.length:
            fail(f"compose chunks[{i}]", f"a chunk encoded after this anchor (start {anchor.length})", c.start)
        if fp is not None and c.fingerprint != fp:
            fail(f"compose chunks[{i}]", f"fingerprint [{fp.short()}] like chunks[0]", f"[{c.fingerprint.short()}]")
        fp = c.fingerprint
        if c.keys.shape[0] != len(anchor.cache.layers):
            fail(f"compose chunks[{i}]", f"{len(anchor.cache.layers)} layers", c.keys.shape[0])


@torch.no_grad()
def compose(model: torch.nn.Module, anchor: Anchor, chunks: Sequence[ChunkKV], layout: str = "sequential",
            link_k: int = 0, recompute_ratio: float = 0.0) -> tuple[PositionedCache, ComposeInfo]:
    """Build a PositionedCache holding anchor + chunks (in the given order) under `layout`; returns (cache, info).

    The question is then run with `extend`/`generate`, which start at `cache.next_position()`.
    """
    t0 = time.perf_counter()
    if layout not in ("sequential", "parallel"):
        fail("compose layout", "'sequential' or 'parallel'", repr(layout))
    if not isinstance(link_k, int) or link_k < 0:
        fail("compose link_k", "an int >= 0", link_k)
    recompute_ratio = check_fraction("compose recompute_ratio", recompute_ratio)
    if link_k and layout == "parallel":
        fail("compose link_k", "0 with layout='parallel' (link tokens re-encode against the chunks placed before "
             "them; in parallel layout nothing is placed before a chunk but the anchor)", link_k)
    _check_chunks(anchor, chunks)
    A = anchor.length
    cache = anchor.cache.copy()
    total = A + sum(c.num_tokens for c in chunks)
    cache.reserve_(total + 64)
    info = ComposeInfo(layout)
    pos = A
    link_slots, link_ids = [], []
    for i, c in enumerate(chunks):
        S = c.num_tokens
        start = pos if layout == "sequential" else A
        s0 = cache.num_slots
        cache.append_raw_(c.layer_kv(), torch.arange(start, start + S), segment=SEG_CHUNK0 + i)
        k = min(link_k, S) if i > 0 else 0
        link_slots.append(torch.arange(s0, s0 + k))
        link_ids.append(c.ids[:k])
        info.slots.append((s0, cache.num_slots))
        info.starts.append(start)
        info.tokens_reused += S - k
        pos = start + S if layout == "sequential" else max(pos, A + S)
    if link_k:
        slots = torch.cat(link_slots)
        info.tokens_computed += _recompute_slots(model, cache, slots, torch.cat(link_ids), info, A)
    if recompute_ratio > 0:
        n = _selective_recompute(model, cache, anchor, chunks, info, recompute_ratio)
        info.tokens_computed += n
        info.tokens_reused -= n
    info.next_position = int(cache.next_position().max())
    info.compose_s = time.perf_counter() - t0
    return cache, info


# ---------------------------------------------------------------------------------------------------------------------
# layout masks and selective recompute (CacheBlend)
# ---------------------------------------------------------------------------------------------------------------------

def layout_allowed(info: ComposeInfo, anchor_len: int, n_query: int = 0) -> torch.Tensor:
    """[N, N] bool mask of the composed layout (N = anchor + chunks + n_query): what each slot was allowed to see.

    sequential: plain causal over slots (each chunk sees the anchor and every chunk before it) — the full-prefill
    pattern. parallel: each chunk sees the anchor and itself (causal); the query sees everything.
    """
    N = (info.slots[-1][1] if info.slots else anchor_len) + n_query
    allowed = torch.tril(torch.ones(N, N, dtype=torch.bool))
    if info.layout == "parallel":
        for i, (s, e) in enumerate(info.slots):
            allowed[s:e, anchor_len:s] = False
    return allowed


@contextlib.contextmanager
def _scatter_updates(cache: PositionedCache, slots: torch.Tensor) -> Iterator[None]:
    """While active, cache.update writes the incoming S tokens into existing `slots` [S] instead of appending."""
    cache._scatter = slots
    try:
        yield
    finally:
        cache._scatter = None


def recompute_slots(model: torch.nn.Module, cache: PositionedCache, slots: torch.Tensor, ids: torch.Tensor,
                    allowed: torch.Tensor) -> int:
    """Re-encode the tokens `ids` [S] that sit at `slots` [S] of `cache` in ONE forward (all layers): slot slots[i]
    attends to the slots where allowed[i] [S, T] is True; the new keys/values overwrite the slots in place
    (positions unchanged). Returns S."""
    if slots.numel() == 0:
        return 0
    dtype = next(model.parameters()).dtype
    mask = _additive(allowed, dtype)[None, None]
    pos = cache.positions[:, slots]
    with _scatter_updates(cache, slots):
        model(input_ids=ids[None], position_ids=pos, attention_mask=mask, cache=cache, use_cache=True)
    return int(slots.numel())


def _recompute_slots(model: torch.nn.Module, cache: PositionedCache, slots: torch.Tensor, ids: torch.Tensor,
                     info: ComposeInfo, anchor_len: int) -> int:
    """Link tokens: each attends to what the layout lets it see (sequential: every slot before it). One forward is
    equivalent to re-encoding them one chunk after another, since a chunk's link tokens only see slots placed before
    them."""
    N = cache.num_slots
    return recompute_slots(model, cache, slots, ids, layout_allowed(info, anchor_len)[slots][:, :N])


def _decoder_layers(model: torch.nn.Module) -> tuple[Any, Any, Any]:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or not hasattr(base, "rotary_emb") or not hasattr(base, "embed_tokens"):
        fail("selective recompute model", "a Llama-style decoder (model.model.layers / rotary_emb / embed_tokens)",
             type(model).__name__, "use link_k instead")
    lt = getattr(model.config, "layer_types", None)
    if lt and any(t != "full_attention" for t in lt):
        fail("selective recompute model", "full-attention layers only", sorted(set(lt)), "use link_k instead")
    return base, layers, base.rotary_emb


def _run_layers(layers, lo: int, hi: int, hidden: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                cache: PositionedCache, slots: torch.Tensor, rotary) -> torch.Tensor:
    pe = rotary(hidden, pos)
    with _scatter_updates(cache, slots):
        for i in range(lo, hi):
            hidden = layers[i](hidden, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                               position_embeddings=pe)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
    return hidden


def _selective_recompute(model: torch.nn.Module, cache: PositionedCache, anchor: Anchor, chunks: Sequence[ChunkKV],
                         info: ComposeInfo, ratio: float) -> int:
    """CacheBlend over the composed chunks (every slot after the anchor). Returns the number of tokens carried."""
    A, N = anchor.length, cache.num_slots
    ids = torch.cat([c.ids for c in chunks])
    return blend_recompute(model, cache, torch.arange(A, N), ids, layout_allowed(info, A)[A:N, :N], ratio)


def blend_recompute(model: torch.nn.Module, cache: PositionedCache, slots: torch.Tensor, ids: torch.Tensor,
                    allowed: torch.Tensor, ratio: float, n_first: int = 2) -> int:
    """CacheBlend on stale slots: refresh layers 0..n_first-1 for every token `ids` [S] at `slots` [S] (ascending;
    slot slots[i] attends where allowed[i] [S, N] is True), pick the top `ratio` of them by the deviation of their
    layer n_first-1 values (refreshed vs stored), carry those through the remaining layers. The KV of the carried
    tokens replace the stored ones in place; the others keep their stale KV beyond layer n_first-1.
    Returns the number of tokens carried through all layers."""
    base, layers, rotary = _decoder_layers(model)
    if hasattr(base, "embed_scale") or getattr(model.config, "model_type", "") == "gemma":
        fail("selective recompute model", "no embedding scaling (Gemma)", model.config.model_type)
    S = int(slots.numel())
    if S == 0:
        return 0
    pos = cache.positions[:, slots]
    dtype = next(model.parameters()).dtype
    mask = _additive(allowed, dtype)[None, None]
    hidden = base.embed_tokens(ids[None])
    n_first = min(n_first, len(layers))
    v_old = cache.layers[n_first - 1].v[:, :, slots].clone()
    hidden = _run_layers(layers, 0, n_first, hidden, pos, mask, cache, slots, rotary)
    if n_first == len(layers):
        return S
    dev = (cache.layers[n_first - 1].v[:, :, slots] - v_old).float().pow(2).sum(dim=(1, 3))[0]   # [S]
    n_sel = max(1, int(round(ratio * S)))
    sel = torch.topk(dev, n_sel).indices.sort().values
    _run_layers(layers, n_first, len(layers), hidden[:, sel], pos[:, sel], mask[:, :, sel], cache, slots[sel], rotary)
    return n_sel
