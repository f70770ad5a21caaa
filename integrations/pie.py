"""Code edits without re-prefill: an editing session over a document's token ids and its PositionedCache.

Strategies are kvpos.edits.Strategy values (or their spec strings, one grammar everywhere):
  full    re-encode the whole edited document (the reference)
  prefix  keep the KV before the first edited token, recompute everything after it: exact, and what every serving
          engine does (vLLM, SGLang, llama.cpp); its cost is the tokens that follow the first edit
  auto    per edit, prefix when few tokens follow the first edit, else pie+k<K>+tail<T> (kvpos.edits.Strategy.resolve;
          its parameters come from a calibration split, results/pie_calib2_seed1.md)
  auto+b<B>  a cost target: pie+k with the longest tail whose tokens stay within B% of what prefix would encode,
          prefix when even the shortest tail (128) does not fit
  pie     Positional Integrity Encoding: keep the untouched segments' KV, move each by its cumulative shift (one
          rotation of the raw keys, values unchanged), encode only the new tokens on top of what precedes them
  naive   "conflict fast" reuse: splice the encoded new tokens in and leave the old positions as they were
          (duplicated / gapped positions); generation continues at the document's true positions, as a plain
          generate loop does (position = document length), so the stale suffix sits shift positions off
  pie+k<K>    pie, and also re-encode the K tokens after every edit (their context changed the most)
  pie+blend<P>  pie, then CacheBlend on the stale tokens (all from the first kept token after an edit): layers 0-1
          are refreshed for all of them, the P% whose layer-1 values moved most are carried through every layer
          (100% equals full)
  pie+attn<P>[+probe<Q>]  (query-aware) pie, then the document's last Q tokens (default 16) pick, by their attention
          over the cache, the P% of the stale slots they read most; those and the probe tokens are re-encoded through
          every layer in one forward (100% equals full)
  +tail<T>    any of them (but full) also re-encodes the last T tokens of the document

Every update builds a new cache from the old one's raw KV (the old cache is only read), so a failure leaves the
session exactly as it was.

    s = EditSession(model, ids)                          # prefills the document
    r = s.apply([Insert(120, new_ids)], "pie")           # r.update_s, r.tokens_encoded
    s.apply_text(tok, new_source_text, "pie+k8")         # re-tokenize, diff on tokens, apply
    line_ids = s.generate(max_new_tokens=32)             # continue at the end (or cursor=...)
    c = s.complete(edits, "auto+b35", min_margin=0.05)  # update + generate; redone with prefix (exact) when a
                                                         # generated step's margin falls below 0.05 nats
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvpos._checks import as_token_ids, check_int, fail
from kvpos.cache import PositionedKV
from kvpos.edits import Piece, Replace, Strategy, apply_edits, diff_tokens, normalize, plan, stale_slots, widen, \
    with_tail
from kvpos.integrations.repairs import attention_mass, attention_refresh, blend_recompute, recompute_slots  # noqa: F401
from kvpos.integrations.hf import MarginWatch, PositionedCache, extend, generate
from kvpos.integrations.hf.run import check_vocab, takes_logits_to_keep

__all__ = ["EditSession", "EditResult", "Completion", "attention_mass"]


@dataclass
class EditResult:
    strategy: str
    update_s: float          # wall time to bring the cache up to date
    tokens_encoded: int      # tokens run through the model
    tokens_reused: int       # tokens whose KV was kept (moved or not)
    edits: int


@dataclass
class Completion:
    """What EditSession.complete did: the generated ids, the update they came from, and what the gate cost."""
    ids: torch.Tensor        # generated ids [new]
    update: EditResult       # the update whose cache generated `ids` (the fallback's when fell_back)
    fell_back: bool          # the approximate update's generation met a margin below the floor: redone exactly
    cost_s: float            # wall time spent to reach `ids`' cache: update(s) + the abandoned generation, if any
    tokens_encoded: int      # tokens run through the model by the update(s) (not the generation)
    margins: list[float]     # each kept generated step's margin (nats: log p top-1 - log p top-2)
    first: EditResult | None = None   # the abandoned approximate update (fell_back only)


class EditSession:
    """A document (token ids [n]) and its cache (slot j = token j at position j after full/pie updates)."""

    def __init__(self, model: torch.nn.Module, ids: Any, cache: PositionedCache | None = None,
                 storage: str = "rotated") -> None:
        """storage: of the cache built when none is given ("int8": quantized; new tokens are then encoded piece by
        piece after what precedes them, and the blend / attn repairs refuse, since they rewrite slots)."""
        self.model = model
        self.ids = as_token_ids("EditSession ids", ids)
        if self.ids.numel() == 0:
            fail("EditSession ids", "at least one token", "an empty document")
        if cache is None:
            cache = PositionedCache.from_model(model, storage=storage)
            with torch.no_grad():
                extend(model, cache, self.ids[None], last_logits=self._last)
        elif cache.num_slots != self.ids.numel():
            fail("EditSession cache", f"{self.ids.numel()} slots (one per token)", cache.num_slots)
        self.cache = cache

    @property
    def length(self) -> int:
        return int(self.ids.numel())

    @property
    def layer_types(self) -> list[str]:
        return list(getattr(self.model.config, "layer_types", None) or [])

    # -- edits -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self, edits: Sequence[Replace] | Replace, strategy: str | Strategy = "pie", **overrides: Any
              ) -> EditResult:
        """Apply edits (token indices of the current document) with `strategy` (a Strategy or its spec, e.g.
        "pie+k64+tail512"; keyword overrides set its fields: k, tail, ratio, probe). The session moves to the new
        document."""
        asked = Strategy.parse(strategy, **overrides).check(self.layer_types)
        if asked.repair is not None and self.cache.mode.quantized:
            fail(f"EditSession strategy {asked}", "no blend / attn repair with storage='int8' (they rewrite slots)",
                 asked.repair, "use k / tail re-encoding, or a session with storage 'rotated' or 'raw'")
        edits = normalize(edits, self.length)
        strat = asked.resolve(self.length, edits)
        new_ids = torch.tensor(apply_edits(self.ids, edits), dtype=torch.long)
        if new_ids.numel() == 0:
            fail("edits", "a non-empty document after editing", "every token deleted")
        check_vocab("edits: inserted token ids", self.model, new_ids)
        t0 = time.perf_counter()
        if strat.base == "full":
            cache = PositionedCache.from_model(self.model, storage=self.cache.storage)
            extend(self.model, cache, new_ids[None], last_logits=self._last)
            enc, reused = new_ids.numel(), 0
        elif strat.base == "prefix":
            cache, enc, reused = self._recompute_from(edits[0].start if edits else self.length, new_ids)
        else:
            if strat.k:
                edits = widen(self.ids, edits, strat.k)
            if strat.tail:
                edits = with_tail(self.ids, edits, strat.tail)
            pieces = plan(self.length, edits)
            cache, enc, reused = self._splice(pieces, fix_positions=strat.base != "naive")
            if strat.repair == "blend":
                stale = stale_slots(pieces)
                allowed = torch.arange(cache.num_slots)[None] <= stale[:, None]      # causal over the new document
                enc += blend_recompute(self.model, cache, stale, new_ids[stale], allowed, strat.ratio)
            elif strat.repair == "attn":
                enc += attention_refresh(self.model, cache, stale_slots(pieces), new_ids, strat.ratio, strat.probe)
        dt = time.perf_counter() - t0
        self.ids, self.cache = new_ids, cache
        name = str(strat) if asked.base != "auto" else f"{asked}->{strat}"
        return EditResult(name, dt, int(enc), int(reused), len(edits))

    def _recompute_from(self, first: int, new_ids: torch.Tensor) -> tuple[PositionedCache, int, int]:
        """Exact prefix reuse: the slots before `first` (positions 0..first-1, untouched by every edit) are kept,
        the new document from `first` on is encoded after them. Returns (cache, encoded, reused)."""
        cache = self.cache.copy(headroom=max(0, new_ids.numel() - first))
        cache.delete_(first, cache.num_slots)
        if first < new_ids.numel():
            extend(self.model, cache, new_ids[None, first:], positions=torch.arange(first, new_ids.numel()),
                   last_logits=self._last)
        return cache, int(new_ids.numel() - first), first

    def apply_text(self, tokenizer: Any, new_text: str, strategy: str | Strategy = "pie",
                   add_special_tokens: bool = False, **overrides: Any) -> EditResult:
        """Re-tokenize the whole new text, diff on tokens (tokenization can change around an edit) and apply."""
        if not isinstance(new_text, str):
            fail("apply_text new_text", "a str", type(new_text).__name__, exc=TypeError)
        new = tokenizer(new_text, add_special_tokens=add_special_tokens).input_ids
        return self.apply(diff_tokens(self.ids, new), strategy, **overrides)

    def _splice(self, pieces: list[Piece], fix_positions: bool) -> tuple[PositionedCache, int, int]:
        """New cache in document order: untouched segments' raw KV (moved by their shift, or left at their old
        positions for naive) and placeholder slots for the new tokens, which ONE forward then encodes in place, each
        new token attending to every slot before it (causal over the new document)."""
        if (self._sliding or self.cache.mode.quantized) and any(p.kind == "new" for p in pieces):
            return self._splice_sequential(pieces, fix_positions)   # (int8 slots are written once, not rewritten)
        old = self.cache
        new = old.empty_like()
        new.reserve_(sum(p.length for p in pieces) + 16)
        new_slots, new_ids = [], []
        reused = 0
        for p in pieces:
            if p.kind == "keep":
                reused += _append_kept(old, new, p, fix_positions)
            else:
                s0 = new.num_slots
                zeros = [(torch.zeros_like(l.raw_k[:, :, :p.length]), torch.zeros_like(l.v[:, :, :p.length]))
                         for l in old.layers]
                new.append_raw_(zeros, torch.arange(p.new_start, p.new_start + p.length))
                new_slots.append(torch.arange(s0, s0 + p.length))
                new_ids.append(torch.tensor(p.ids, dtype=torch.long))
        enc = 0
        if new_slots:
            slots = torch.cat(new_slots)
            allowed = torch.arange(new.num_slots)[None] <= slots[:, None]       # causal over the new document
            enc = recompute_slots(self.model, new, slots, torch.cat(new_ids), allowed)
        return new, enc, reused

    @property
    def _last(self) -> bool:
        """Fill the cache without the LM head on every position (the update needs no logits)."""
        return takes_logits_to_keep(self.model.forward)

    @property
    def _sliding(self) -> bool:
        """Models with sliding-window layers: one 4-D mask cannot express the window, so edits are encoded one
        after another with transformers' own masks (new tokens last, so slot distance = position distance)."""
        return any(t != "full_attention" for t in self.layer_types)

    def _splice_sequential(self, pieces: list[Piece], fix_positions: bool) -> tuple[PositionedCache, int, int]:
        old = self.cache
        new = old.empty_like()
        new.reserve_(sum(p.length for p in pieces) + 16)
        enc = reused = 0
        for p in pieces:
            if p.kind == "keep":
                reused += _append_kept(old, new, p, fix_positions)
            else:
                extend(self.model, new, torch.tensor([p.ids]),
                       positions=torch.arange(p.new_start, p.new_start + p.length), last_logits=self._last)
                enc += p.length
        return new, enc, reused

    @torch.no_grad()
    def complete(self, edits: Sequence[Replace] | Replace, strategy: str | Strategy = "auto+b35", *,
                 min_margin: float, fallback: str | Strategy = "prefix", max_new_tokens: int = 32,
                 **gen_kwargs: Any) -> Completion:
        """Apply edits with `strategy` and generate greedily at the end; an approximate update (one that resolves to
        pie or naive) is trusted only while every generated step's margin (log p top-1 - log p top-2, nats) stays at
        or above `min_margin`. At the first step below it the generation stops, the update is abandoned (the session
        goes back to the document before the edits, unchanged) and the edits are applied again with `fallback`
        (default prefix: exact), whose generation is returned whatever its margins. Exact updates (full, prefix, or
        auto resolving to prefix) are not gated. The session moves to the new document.

        A small margin is where a slightly stale cache can flip the greedy token; min_margin 0 never falls back.
        There is no default floor: in next-line code completion many of full recompute's own generated lines hold
        low-margin steps, so a floor that catches PIE's disagreements with full also redoes edits that needed no
        redo (measured in results/pie_gate_calib_seed1.md); pick it from what a redo costs you.
        cost_s counts the update(s) and the abandoned generation, not the returned generation (every strategy pays
        that). gen_kwargs go to generate (greedy only; logits_processor / stopping_criteria lists are extended)."""
        if isinstance(min_margin, bool) or not isinstance(min_margin, (int, float)) or not 0 <= min_margin < 1e9:
            fail("complete min_margin", "a number of nats >= 0 (0 = never fall back)", min_margin)
        if gen_kwargs.get("do_sample"):
            fail("complete do_sample", "greedy decoding (the margin gate watches the greedy token)", True,
                 "generate with EditSession.generate to sample")
        fb = Strategy.parse(fallback).check(self.layer_types)
        asked = Strategy.parse(strategy).check(self.layer_types)
        norm = normalize(edits, self.length)
        exact = asked.resolve(self.length, norm).base in ("full", "prefix")
        before_ids, before_cache = self.ids, self.cache     # updates only read the old cache: kept as it is
        try:
            r = self.apply(norm, asked)
            t0 = time.perf_counter()
            ids, watch = self._generate_watched(max_new_tokens, 0.0 if exact else float(min_margin), gen_kwargs)
            if exact or not watch.low:
                return Completion(ids, r, False, r.update_s, r.tokens_encoded, watch.margins)
            abandoned = time.perf_counter() - t0
            self.ids, self.cache = before_ids, before_cache
            r2 = self.apply(norm, fb)
            ids2, watch2 = self._generate_watched(max_new_tokens, 0.0, gen_kwargs)
        except BaseException:
            self.ids, self.cache = before_ids, before_cache     # a failure anywhere leaves the session as it was
            raise
        return Completion(ids2, r2, True, r.update_s + abandoned + r2.update_s, r.tokens_encoded + r2.tokens_encoded,
                          watch2.margins, first=r)

    def _generate_watched(self, max_new_tokens: int, floor: float, gen_kwargs: dict) -> tuple[torch.Tensor, MarginWatch]:
        watch = MarginWatch(floor)
        return self.generate(max_new_tokens=max_new_tokens, **watch.gen_kwargs(gen_kwargs)), watch

    # -- continuing ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, max_new_tokens: int = 32, cursor: int | None = None, **gen_kwargs: Any) -> torch.Tensor:
        """Greedy (by default) continuation at the end of the document, or after token `cursor` (tokens >= cursor
        are ignored). The session is unchanged. Returns the generated ids [new]."""
        n = self.length
        c = n if cursor is None else check_int("generate cursor", cursor)
        if not 1 <= c <= n:
            fail("generate cursor", f"1 <= cursor <= len(doc)={n}", c)
        cache = self.cache.copy()
        cache.keep_(torch.arange(c - 1))     # the token before the cursor is re-fed to get its next-token logits
        last = self.ids[c - 1:c][None]
        pos = torch.tensor([[c - 1]])   # the document index, as any generate loop has it (= the slot's position
        #                                 after full / pie; naive's stale slots disagree: its "temporal confusion")
        gen_kwargs.setdefault("do_sample", False)
        out = generate(self.model, cache, last, positions=pos, max_new_tokens=max_new_tokens, **gen_kwargs)
        return out[0, 1:]


def _append_kept(old: PositionedKV, new: PositionedKV, piece: Piece, fix_positions: bool) -> int:
    """Append the raw KV of one untouched segment of `old` to `new`, moved by its shift (or left at its old
    positions when `fix_positions` is False: naive reuse); returns the number of slots reused."""
    s, e = piece.old_start, piece.old_start + piece.length
    pos = old.positions[:, s:e] + (piece.shift if fix_positions else 0)
    new.append_from_(old, s, e, positions=pos, segment=0)
    return piece.length
