"""Position-independent chunk reuse on transformers: anchors, chunk encoding, compose() with fidelity repairs.

The plans (where chunks go, what each slot may see) are kvpos.compose; this module runs the model: it encodes the
anchor and chunks, places stored chunks with `append_raw_`, and re-encodes the slots a repair chooses.

Repairs (optional, measured in bench/rag_eval.py; they live in kvpos.integrations.repairs, re-exported here):
    link_k (EPIC LegoLink): the first k tokens of every chunk after the first are re-encoded at their final
        positions, attending to everything placed before them (sequential layout).
    recompute_ratio (CacheBlend): layers 0-1 are recomputed for all chunk tokens; the fraction of tokens whose
        layer-1 values deviate most are carried through the remaining layers, their KV replacing the stored ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from kvpos._checks import as_token_ids, check_fraction, fail
from kvpos.compose import SEG_ANCHOR, SEG_CHUNK0, SEG_QUERY, LayoutPlan, plan_layout
from kvpos.cache import storage_mode
from kvpos.store import ChunkKV, ChunkStore, MemoryBackend, WeightsDigest, model_fingerprint
from kvpos.integrations.hf import PositionedCache, extend
from kvpos.integrations.repairs import (AttentionMassProbe, attention_mass_of, blend_recompute,  # noqa: F401
                                       query_aware_refresh, recompute_slots)

__all__ = ["SEG_ANCHOR", "SEG_QUERY", "SEG_CHUNK0", "Anchor", "ChunkComposer", "compose", "ComposeInfo",
           "encode_chunk", "recompute_slots", "blend_recompute", "AttentionMassProbe", "attention_mass_of",
           "query_aware_refresh"]


def _ids1d(what: str, ids: Any) -> torch.Tensor:
    t = as_token_ids(what, ids)
    if t.numel() == 0:
        fail(what, "at least one token", "an empty sequence")
    return t


@dataclass
class Anchor:
    """The shared prefix: ids [A] and its cache at positions 0..A-1 (segment SEG_ANCHOR), and an optional lead.

    lead: ids [L] that every chunk is ENCODED after (at positions A..A+L-1) and that no request holds: a chunk then
    carries the state of a token that had other passages before it, as every chunk but the first has in a request.
    Chunks start at `chunk_start` = A + L; `context` is the cache they are encoded on (anchor + lead). Empty lead
    (L = 0): chunks are encoded right after the anchor.

        request:  | anchor 0..A-1 | chunk_1 | chunk_2 | ... | question |
        encoding: | anchor 0..A-1 | lead A..A+L-1 | chunk_i A+L.. |          (lead slots dropped from the chunk)
    """

    ids: torch.Tensor
    cache: PositionedCache
    lead: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    context: PositionedCache | None = None

    def __post_init__(self) -> None:
        if self.context is None:
            if self.lead.numel():
                fail("Anchor context", "the cache of anchor + lead when a lead is given", None,
                     "build it with Anchor.encode(model, ids, lead)")
            self.context = self.cache

    @property
    def length(self) -> int:
        return int(self.ids.numel())

    @property
    def chunk_start(self) -> int:
        """A + L: the position a chunk's first token is encoded at."""
        return self.length + int(self.lead.numel())

    @property
    def context_ids(self) -> torch.Tensor:
        """[A + L] the ids every chunk is encoded after (what the store's fingerprint names)."""
        return torch.cat([self.ids, self.lead])

    @classmethod
    @torch.no_grad()
    def encode(cls, model: torch.nn.Module, ids: Any, lead: Any = None) -> "Anchor":
        ids = _ids1d("anchor ids", ids)
        cache = PositionedCache.from_model(model)
        extend(model, cache, ids[None], segment=SEG_ANCHOR)
        if lead is None or as_token_ids("anchor lead", lead).numel() == 0:
            return cls(ids, cache)
        lead = as_token_ids("anchor lead", lead)
        context = cache.copy(headroom=lead.numel())
        extend(model, context, lead[None], segment=SEG_ANCHOR)
        return cls(ids, cache, lead, context)


@torch.no_grad()
def encode_chunk(model: torch.nn.Module, anchor: Anchor, ids: Any, fingerprint: Any) -> ChunkKV:
    """Encode one chunk after the anchor and its lead (positions A+L..A+L+S-1) and return its raw KV (the anchor's and
    lead's slots excluded)."""
    ids = _ids1d("chunk ids", ids)
    cache = anchor.context.copy(headroom=ids.numel())
    extend(model, cache, ids[None], last_logits=True)
    return ChunkKV.from_raw_kv(ids, cache.raw_kv(anchor.chunk_start, cache.num_slots), anchor.chunk_start,
                               fingerprint)


class ChunkComposer:
    """A model + anchor + ChunkStore: chunks are computed on a miss and stored; `compose` builds request caches.

        composer = ChunkComposer(model, anchor_ids)               # memory store by default
        composer.precompute([ids1, ids2, ...])                    # progress bar
        cache, info = composer.compose([ids2, ids1], layout="sequential", link_k=8)

    lead_ids: token ids every chunk is encoded after and no request holds (see Anchor; measured in
    docs/evaluation.md); the store's fingerprint names anchor + lead, so chunks of another lead are never served.
    `with_lead(ids)` gives a composer over the same model and store backend with another lead.
    """

    def __init__(self, model: torch.nn.Module, anchor_ids: Any, store: ChunkStore | None = None,
                 backend: Any = None, namespace: str = "default", lead_ids: Any = None,
                 weights: WeightsDigest | None = None, **store_kw: Any) -> None:
        self.model = model
        self.weights = WeightsDigest(model) if weights is None else weights
        self.anchor = Anchor.encode(model, anchor_ids, lead_ids)
        self.fingerprint = model_fingerprint(model, self.anchor.context_ids, self.anchor.cache.specs, self.weights)
        if store is None:
            store = ChunkStore(MemoryBackend() if backend is None else backend, self.fingerprint,
                               namespace=namespace, **store_kw)
        elif backend is not None:
            fail("ChunkComposer backend", "None when a store is given (the store has its backend)",
                 type(backend).__name__)
        elif store.fingerprint != self.fingerprint:
            fail("ChunkComposer store", f"a store with fingerprint [{self.fingerprint.short()}]",
                 f"[{store.fingerprint.short()}]", "build the store with ChunkComposer's fingerprint")
        self.store = store

    def _current(self) -> None:
        """After any weight changed: re-encode the anchor and serve under the new fingerprint (old entries are then
        refused as mismatches, never served)."""
        if self.weights.changed():
            self.anchor = Anchor.encode(self.model, self.anchor.ids, self.anchor.lead)
            self.fingerprint = model_fingerprint(self.model, self.anchor.context_ids, self.anchor.cache.specs,
                                                 self.weights)
            self.store = self.store.with_fingerprint(self.fingerprint)

    def with_lead(self, lead_ids: Any) -> "ChunkComposer":
        """A composer over the same model, weights digest and store backend (namespace, settings and stats shared)
        whose chunks are encoded after the anchor + `lead_ids` [L] (empty: right after the anchor)."""
        self._current()
        other = ChunkComposer(self.model, self.anchor.ids, backend=self.store.backend, lead_ids=lead_ids,
                              weights=self.weights)
        other.store = self.store.with_fingerprint(other.fingerprint)
        return other

    def get_or_compute(self, ids: Any) -> tuple[ChunkKV, bool]:
        """(chunk, hit): from the store, or computed now and stored."""
        ids = _ids1d("chunk ids", ids)
        self._current()
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
                recompute_ratio: float = 0.0, storage: str | None = None) -> tuple[PositionedCache, "ComposeInfo"]:
        """Cache for anchor + `chunks` (token ids, fetched or computed) in this order; see `compose`."""
        t0 = time.perf_counter()
        got = [self.get_or_compute(c) for c in chunks]
        self._current()
        t_fetch = time.perf_counter() - t0
        cache, info = compose(self.model, self.anchor, [c for c, _ in got], layout, link_k, recompute_ratio, storage)
        info.hits = sum(h for _, h in got)
        info.misses = len(got) - info.hits
        info.tokens_computed += sum(c.num_tokens for c, h in got if not h)
        info.fetch_s = t_fetch
        return cache, info


@dataclass
class ComposeInfo:
    """What compose() did: the layout plan (slot ranges and positions of the chunks), tokens recomputed, timings."""

    plan: LayoutPlan
    tokens_computed: int = 0
    tokens_reused: int = 0
    hits: int = 0
    misses: int = 0
    fetch_s: float = 0.0
    compose_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def layout(self) -> str:
        return self.plan.layout

    @property
    def next_position(self) -> int:
        return self.plan.next_position


def _check_chunks(anchor: Anchor, chunks: Sequence[ChunkKV]) -> None:
    if not chunks:
        fail("compose chunks", "at least one ChunkKV", "none")
    fp = None
    for i, c in enumerate(chunks):
        if not isinstance(c, ChunkKV):
            fail(f"compose chunks[{i}]", "a ChunkKV", type(c).__name__, exc=TypeError)
        if c.start != anchor.chunk_start:
            fail(f"compose chunks[{i}]", f"a chunk encoded after this anchor and lead (start {anchor.chunk_start})",
                 c.start)
        if fp is not None and c.fingerprint != fp:
            fail(f"compose chunks[{i}]", f"fingerprint [{fp.short()}] like chunks[0]", f"[{c.fingerprint.short()}]")
        fp = c.fingerprint
        if c.raw_keys.shape[0] != len(anchor.cache.layers):
            fail(f"compose chunks[{i}]", f"{len(anchor.cache.layers)} layers", c.raw_keys.shape[0])


@torch.no_grad()
def compose(model: torch.nn.Module, anchor: Anchor, chunks: Sequence[ChunkKV], layout: str = "sequential",
            link_k: int = 0, recompute_ratio: float = 0.0, storage: str | None = None
            ) -> tuple[PositionedCache, ComposeInfo]:
    """Build a PositionedCache holding anchor + chunks (in the given order) under `layout`; returns (cache, info).
    storage: the new cache's storage (default: the anchor cache's, "rotated"); "int8" quantizes the anchor and the
    chunks as they enter (repairs then refuse: they rewrite slots).

    The question is then run with `extend`/`generate`, which start at `cache.next_position()`.
    """
    t0 = time.perf_counter()
    if isinstance(link_k, bool) or not isinstance(link_k, int) or link_k < 0:
        fail("compose link_k", "an int >= 0", link_k)
    recompute_ratio = check_fraction("compose recompute_ratio", recompute_ratio)
    if link_k and layout == "parallel":
        fail("compose link_k", "0 with layout='parallel' (link tokens re-encode against the chunks placed before "
             "them; in parallel layout nothing is placed before a chunk but the anchor)", link_k)
    plan = plan_layout(anchor.length, [c.num_tokens for c in chunks] if chunks else [], layout)
    _check_chunks(anchor, chunks)
    if storage is None or storage_mode(storage, "compose storage") is anchor.cache.mode:
        cache = anchor.cache.copy(headroom=plan.num_slots - anchor.length + 64)
    else:
        cache = PositionedCache.from_model(model, storage=storage)
        cache.append_from_(anchor.cache)
    info = ComposeInfo(plan)
    for i, c in enumerate(chunks):
        cache.append_raw_(c.layer_kv(), plan.positions(i), segment=SEG_CHUNK0 + i)
    info.tokens_reused = plan.num_slots - anchor.length
    if link_k:
        slots = plan.link_slots(link_k)
        ids = torch.cat([c.ids for c in chunks])[slots - anchor.length]
        n = recompute_slots(model, cache, slots, ids, plan.allowed()[slots])
        info.tokens_computed += n
        info.tokens_reused -= n
    if recompute_ratio > 0:
        slots = plan.chunk_slots()
        ids = torch.cat([c.ids for c in chunks])
        n = blend_recompute(model, cache, slots, ids, plan.allowed()[slots], recompute_ratio)
        info.tokens_computed += n
        info.tokens_reused -= n
    info.compose_s = time.perf_counter() - t0
    return cache, info


# ---------------------------------------------------------------------------------------------------------------------
# re-encoding chosen slots in place (link tokens, CacheBlend, PIE repairs)
# ---------------------------------------------------------------------------------------------------------------------
