"""Code edits without re-prefill: an editing session over a document's token ids and its PositionedCache.

Strategies (per call):
  full    re-encode the whole edited document (the reference)
  pie     Positional Integrity Encoding: keep the untouched segments' KV, move each by its cumulative shift (one
          rotation of the raw keys, values unchanged), encode only the new tokens on top of what precedes them
  naive   "conflict fast" reuse: splice the encoded new tokens in and leave the old positions as they were
          (duplicated / gapped positions); generation continues at the document's true positions, as a plain
          generate loop does (position = document length), so the stale suffix sits shift positions off
  pie+k   pie, and also re-encode the k tokens after every edit (their context changed the most)
  pie+blend  pie, then CacheBlend on the stale tokens (all from the first kept token after an edit): layers 0-1
          are refreshed for all of them, the `ratio` whose layer-1 values moved most are carried through every layer
          (ratio = 1 equals full)
  pie+attn   (beyond PIE and CacheBlend: query-aware) pie, then ask the document's last `probe` tokens which stale
          slots they read: one probe forward of those tokens records their attention over the cache (mean over
          layers, heads and rows); the `ratio` of the stale slots with the most attention, plus the probe tokens
          themselves, are re-encoded through every layer in one forward (ratio = 1 equals full). Measured on real
          code, the stale error that flips a next-line prediction sits where the cursor looks, mostly near it, not
          right after the edit (bench/pie_eval.py)

Every update builds a new cache from the old one's raw KV (the old cache is only read), so a failure leaves the
session exactly as it was.

    s = EditSession(model, ids)                          # prefills the document
    r = s.apply([Insert(120, new_ids)], "pie")           # r.update_s, r.tokens_encoded
    s.apply_text(tok, new_source_text, "pie+k", k=8)     # re-tokenize, diff on tokens, apply
    line_ids = s.generate(max_new_tokens=32)             # continue at the end (or cursor=...)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvpos._checks import as_token_ids, check_fraction, check_int, fail
from kvpos.edits import Replace, apply_edits, diff_tokens, normalize, plan, widen, with_tail
from kvpos.integrations.compose import blend_recompute, recompute_slots
from kvpos.integrations.hf import PositionedCache, _additive, extend, generate

__all__ = ["EditSession", "EditResult", "STRATEGIES", "attention_mass"]

STRATEGIES = ("full", "pie", "naive", "pie+k", "pie+blend", "pie+attn")


@dataclass
class EditResult:
    strategy: str
    update_s: float          # wall time to bring the cache up to date
    tokens_encoded: int      # tokens run through the model
    tokens_reused: int       # tokens whose KV was kept (moved or not)
    edits: int


class EditSession:
    """A document (token ids [n]) and its cache (slot j = token j at position j after full/pie updates)."""

    def __init__(self, model: torch.nn.Module, ids: Any, cache: PositionedCache | None = None) -> None:
        self.model = model
        self.ids = as_token_ids("EditSession ids", ids)
        if self.ids.numel() == 0:
            fail("EditSession ids", "at least one token", "an empty document")
        if cache is None:
            cache = PositionedCache.from_model(model)
            with torch.no_grad():
                extend(model, cache, self.ids[None])
        elif cache.num_slots != self.ids.numel():
            fail("EditSession cache", f"{self.ids.numel()} slots (one per token)", cache.num_slots)
        self.cache = cache

    @property
    def length(self) -> int:
        return int(self.ids.numel())

    # -- edits -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self, edits: Sequence[Replace] | Replace, strategy: str = "pie", k: int = 8,
              tail: int = 0, ratio: float = 0.1, probe: int = 16) -> EditResult:
        """Apply edits (token indices of the current document) with `strategy`; the session moves to the new doc.

        tail (every strategy but full): also re-encode the last `tail` tokens of the document in the new context.
        ratio (pie+blend / pie+attn): the fraction of the stale tokens carried through every layer.
        probe (pie+attn): how many of the document's last tokens choose the stale slots by their attention."""
        if strategy not in STRATEGIES:
            fail("apply strategy", f"one of {STRATEGIES}", repr(strategy))
        k = check_int("apply k", k)
        if k < 0:
            fail("apply k", "an int >= 0", k)
        tail = check_int("apply tail", tail)
        if tail < 0:
            fail("apply tail", "an int >= 0", tail)
        ratio = check_fraction("apply ratio", ratio)
        probe = check_int("apply probe", probe)
        if probe < 1:
            fail("apply probe", "an int >= 1 (the last tokens whose attention picks the stale slots)", probe)
        if strategy == "pie+attn" and self._sliding:
            fail("pie+attn model", "full-attention layers only (one 4-D mask per forward)",
                 sorted(set(self.model.config.layer_types)), "use pie+k / tail= on sliding-window models")
        edits = normalize(edits, self.length)
        new_ids = torch.tensor(apply_edits(self.ids, edits), dtype=torch.long)
        if new_ids.numel() == 0:
            fail("edits", "a non-empty document after editing", "every token deleted")
        t0 = time.perf_counter()
        if strategy == "full":
            cache = PositionedCache.from_model(self.model)
            extend(self.model, cache, new_ids[None])
            enc, reused = new_ids.numel(), 0
        else:
            if strategy == "pie+k":
                edits = widen(self.ids, edits, k)
            if tail:
                edits = with_tail(self.ids, edits, tail)
            pieces = plan(self.length, edits)
            cache, enc, reused = self._splice(pieces, fix_positions=strategy != "naive")
            if strategy == "pie+blend":
                stale = _stale_slots(pieces)
                allowed = torch.arange(cache.num_slots)[None] <= stale[:, None]      # causal over the new document
                enc += blend_recompute(self.model, cache, stale, new_ids[stale], allowed, ratio)
            elif strategy == "pie+attn":
                enc += _attention_refresh(self.model, cache, _stale_slots(pieces), new_ids, ratio, probe)
        dt = time.perf_counter() - t0
        self.ids, self.cache = new_ids, cache
        return EditResult(strategy, dt, int(enc), int(reused), len(edits))

    def apply_text(self, tokenizer: Any, new_text: str, strategy: str = "pie", k: int = 8,
                   add_special_tokens: bool = False, tail: int = 0, ratio: float = 0.1, probe: int = 16
                   ) -> EditResult:
        """Re-tokenize the whole new text, diff on tokens (tokenization can change around an edit) and apply."""
        if not isinstance(new_text, str):
            fail("apply_text new_text", "a str", type(new_text).__name__, exc=TypeError)
        new = tokenizer(new_text, add_special_tokens=add_special_tokens).input_ids
        return self.apply(diff_tokens(self.ids, new), strategy, k, tail=tail, ratio=ratio, probe=probe)

    def _splice(self, pieces: list, fix_positions: bool) -> tuple[PositionedCache, int, int]:
        """New cache in document order: untouched segments' raw KV (moved by their shift, or left at their old
        positions for naive) and placeholder slots for the new tokens, which ONE forward then encodes in place, each
        new token attending to every slot before it (causal over the new document)."""
        old = self.cache
        old._check_idle("apply")
        new = old.empty_like()
        n_new = sum(p.length for p in pieces)
        new.reserve_(n_new + 16)
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
        if new_slots and self._sliding:
            return self._splice_sequential(pieces, fix_positions)
        if new_slots:
            slots = torch.cat(new_slots)
            allowed = torch.arange(new.num_slots)[None] <= slots[:, None]       # causal over the new document
            enc = recompute_slots(self.model, new, slots, torch.cat(new_ids), allowed)
        return new, enc, reused

    @property
    def _sliding(self) -> bool:
        """Models with sliding-window layers: one 4-D mask cannot express the window, so edits are encoded one
        after another with transformers' own masks (new tokens last, so slot distance = position distance)."""
        lt = getattr(self.model.config, "layer_types", None) or []
        return any(t != "full_attention" for t in lt)

    def _splice_sequential(self, pieces: list, fix_positions: bool) -> tuple[PositionedCache, int, int]:
        old = self.cache
        new = old.empty_like()
        new.reserve_(sum(p.length for p in pieces) + 16)
        enc = reused = 0
        for p in pieces:
            if p.kind == "keep":
                reused += _append_kept(old, new, p, fix_positions)
            else:
                extend(self.model, new, torch.tensor([p.ids]), positions=torch.arange(p.new_start,
                                                                                        p.new_start + p.length))
                enc += p.length
        return new, enc, reused

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
        keep_to = c - 1                 # the token before the cursor is re-fed to get its next-token logits
        cache.keep_(torch.arange(keep_to))
        last = self.ids[c - 1:c][None]
        pos = torch.tensor([[c - 1]])   # the document index, as any generate loop has it (= the slot's position
        #                                 after full / pie; naive's stale slots disagree: its "temporal confusion")
        gen_kwargs.setdefault("do_sample", False)
        out = generate(self.model, cache, last, positions=pos, max_new_tokens=max_new_tokens, **gen_kwargs)
        return out[0, 1:]


def _stale_slots(pieces: list) -> torch.Tensor:
    """Slots (= new document indices) whose KV may be stale: everything from the first kept token that follows an
    edit on (later edits' new tokens included: they attended to stale slots). [S] int64, ascending."""
    after = [p.new_start for p in pieces if p.kind == "keep" and p.old_start > 0]
    n = pieces[-1].new_start + pieces[-1].length if pieces else 0
    return torch.arange(min(after), n) if after else torch.zeros(0, dtype=torch.long)


def attention_mass(model: torch.nn.Module, cache: PositionedCache, n_probe: int, ids: torch.Tensor) -> torch.Tensor:
    """How much the last `n_probe` tokens of the document read each earlier slot: their attention probabilities
    (eager attention, causal, over the cache's first N - n_probe slots), averaged over layers, query heads and the
    probe rows. ids [N] are the document's token ids (slot j = token j at position j). The cache is not changed.
    Returns [N - n_probe] float32."""
    N = cache.num_slots
    if check_int("attention_mass n_probe", n_probe) < 1 or N < 2:
        fail("attention_mass", "n_probe >= 1 and a cache of at least 2 slots", f"n_probe={n_probe}, {N} slots")
    q = min(n_probe, N - 1)
    c = cache.copy()
    c.keep_(torch.arange(N - q))
    dtype = next(model.parameters()).dtype
    allowed = torch.arange(N)[None] <= torch.arange(N - q, N)[:, None]                 # [q, N] causal
    mask = _additive(allowed, dtype)[None, None]
    prev = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=ids[None, N - q:], position_ids=cache.positions[:, N - q:], attention_mask=mask,
                    cache=c, use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation(prev)
    if not out.attentions or out.attentions[0] is None:
        fail("pie+attn model", "attention probabilities from eager attention", "none returned")
    return torch.stack([a[0, :, :, :N - q].float().mean(dim=(0, 1)) for a in out.attentions]).mean(0)


def _attention_refresh(model: torch.nn.Module, cache: PositionedCache, stale: torch.Tensor, ids: torch.Tensor,
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


def _append_kept(old: PositionedCache, new: PositionedCache, piece, fix_positions: bool) -> int:
    """Append the raw KV of one untouched segment of `old` to `new`, moved by its shift (or left at its old
    positions when `fix_positions` is False: naive reuse); returns the number of slots reused."""
    s, e = piece.old_start, piece.old_start + piece.length
    pos = old.table.pos[:, s:e] + (piece.shift if fix_positions else 0)
    new.append_raw_([(l.raw_k[:, :, s:e], l.v[:, :, s:e]) for l in old.layers], pos)
    return piece.length
