"""PINE-lite on transformers: documents encoded apart (the chunk store), the question and answer reading them at
importance-sorted positions per head and per query (kvpos.posmap), so the output does not depend on the order the
documents come in.

    cache, _ = ChunkComposer(model, anchor).compose(doc_chunks, layout="sequential")
    with use_pine_lite(model, cache):
        out = generate(model, cache, question_ids, max_new_tokens=16)

For every attention call (question and generated tokens only), per head and query row: the importance of each
document, computed WITHOUT RoPE (PINE's: softmax of raw q.k over the document slots, summed per document over its
size), sorts the documents; the most important is read as ending right where the documents end (E: the first
document position + all document tokens, where the question starts in the sequential layout), the next right
before it, and so on (kvpos.posmap.pine_shifts / offset_attend). Anchor and question slots keep their positions.
The documents' KV never depends on their order (each encoded alone after the anchor), so neither does the answer,
up to exact ties in the importance sort and float summation order.

Sliding-window layers (Gemma 3, Qwen2 / Mistral with a window): transformers hides keys by SLOT distance, which
would make which documents such a layer sees depend on their order in the cache. Under PINE the window follows
the positions keys are read at instead (kvpos.posmap.shifted_window: query position - read position < window), the
importance is computed over every causal key, and a decode step over storage="raw" applies the window per query
head (each head moves the documents by its own shifts). A custom mask inside the window is refused (`unwindowed`).

Decode steps over storage="raw" run in one kernel call per layer (PositionedKV.decode_pine,
kvpos._posmap_kernels.pine_decode_kernel): the importance without RoPE, the sort, one query variant per document and the
position-map decode, all in C; prefill rows (the question) and other storages take the torch path
(segment_importance, pine_shifts, offset_attend), which computes the same numbers.

PINE's full form (`pine_prefill`): the documents are prefilled together, each right-aligned to end at E (the
prefix length + all document tokens), under `PineDocPhase`: the rows of document i read the prefix plainly, their
own document causally, and every other document bidirectionally at importance-ranked positions per head (PINE's
document phase: kvpos.posmap.pair_importance / pair_shifts: i itself nearest, then the others by how much i's rows
read them, without RoPE). The question and answer then run under PineLiteBackend, which is PINE's suffix phase.

    cache = pine_prefill(model, prefix_ids, doc_ids_list)
    with use_pine_lite(model, cache):
        out = generate(model, cache, question_ids, max_new_tokens=16)
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from kvpos._checks import fail
from kvpos.cache import PositionedKV
from kvpos.compose import SEG_CHUNK0
from kvpos.posmap import (offset_attend, pair_importance, pair_shifts, pine_shifts, rotate_heads, segment_importance,
                          shifted_window)
from kvpos.rope import cos_sin, unrotate
from kvpos.integrations.hf import AttentionCall, Binding, PositionedCache, StepMemo, bind_attention, extend
from kvpos.integrations.hf.attention import decode_mask

__all__ = ["PineLiteBackend", "use_pine_lite", "document_layout", "PineDocPhase", "pine_prefill"]


def document_layout(segment: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor,
                                                                         torch.Tensor, torch.Tensor]:
    """The documents of slots labelled SEG_CHUNK0 + d: (doc [B, N] int64, -1 for other slots; n documents; start,
    size [B, n] int64: first position and token count of each; end [B]: where the documents end, the largest
    start + size (sequential layout: the first start + all document tokens; PINE's right-aligned layout: E))."""
    doc = torch.where(segment >= SEG_CHUNK0, segment.long() - SEG_CHUNK0, torch.full_like(segment, -1).long())
    n = int(doc.max()) + 1 if doc.numel() else 0
    if n <= 0:
        return doc, 0, doc[:, :0], doc[:, :0], doc[:, 0] * 0
    onehot = torch.nn.functional.one_hot(doc.clamp_min(0), n) * (doc >= 0)[..., None]        # [B, N, n]
    size = onehot.sum(1)
    big = torch.iinfo(torch.long).max
    start = torch.where(onehot.bool(), pos.long()[..., None], torch.full_like(onehot, big)).amin(1)
    if bool((size == 0).any()):
        fail("PINE-lite documents", "segments SEG_CHUNK0 + 0 .. n-1 each holding slots",
             f"empty document(s) {torch.nonzero(size[0] == 0).flatten().tolist()}")
    return doc, n, start, size, (start + size).amax(1)


class PineLiteBackend:
    """Attention backend: PINE-lite over the bound cache (module docstring). Decode steps over storage="raw" run the
    importance, shift and position-map kernels in one call (PositionedKV.decode_pine); `read_counts` and
    `importance_counts` say which path served each."""

    needs_cache = True

    def __init__(self) -> None:
        self.read_counts = {"fused": 0, "torch": 0}
        self.importance_counts = {"fused": 0, "torch": 0}   # which path computed each call's document importance
        self._layout: tuple | None = None           # (segments, positions, document_layout of them): one per step
        self._doc32: torch.Tensor | None = None     # that layout's documents as int32
        self._steps = StepMemo()                    # a decode forward's kernel inputs, shared by its layers

    def layout(self, seg: torch.Tensor, pos: torch.Tensor) -> tuple:
        """document_layout(seg, pos), computed once while the slots' segments and positions stay equal (every layer
        of a step reads the same ones; the check is against copies, so an in-place position change is seen)."""
        last = self._layout
        if last is None or last[0].shape != seg.shape or not torch.equal(last[0], seg) or not torch.equal(last[1], pos):
            lay = document_layout(seg, pos)
            last = self._layout = (seg.clone(), pos.clone(), lay)
            self._doc32 = lay[0].to(torch.int32)    # the documents as the decode kernel reads them
        return last[2]

    def __call__(self, call: AttentionCall, binding: Binding) -> torch.Tensor:
        cache = binding.cache_layer_keys(call)
        if call.query.shape[2] == 1:                # a decode step: one kernel call (storage="raw")
            inputs = self._step_args(cache, call)
            if inputs is None:
                return call.plain()                 # no documents: plain attention
            got = cache.decode_pine(call.layer, call.query[:, :, 0], *inputs, call.scaling, window=call.window,
                                    state=call.read_state)
            if got is not None:
                self.read_counts["fused"] += 1
                self.importance_counts["fused"] += 1
                return AttentionCall.finish(got[0][:, :, None].to(call.query.dtype))
        got = self._inputs(cache, call)
        if got is None:
            return call.plain()                     # no documents: plain attention
        doc, n, start, size, end, allowed = got
        layer, Lq, N = cache.layers[call.layer], call.query.shape[2], call.n_keys
        pos = cache.table.pos[:, :N].to(call.query.device)
        q_raw = unrotate(call.query, pos[:, N - Lq:], layer.spec)
        imp = segment_importance(q_raw, layer.raw_keys, doc, n, call.scaling, allowed)
        self.importance_counts["torch"] += 1
        self.read_counts["torch"] += 1
        shift = pine_shifts(imp, start, size, end)
        if call.window is not None:
            allowed = allowed & shifted_window(pos[:, N - Lq:], pos, doc, shift, call.window)   # [B, Hq, q, N]
        out = offset_attend(call.query, call.key, call.value, doc, shift, layer.spec, call.scaling, allowed)
        return AttentionCall.finish(out.to(call.query.dtype))

    def _inputs(self, cache: PositionedKV, call: AttentionCall) -> tuple | None:
        """(doc [B, N] int64, n, start, size, end, allowed [B, 1, q, N] bool) of the call (document_layout; on a
        sliding-window layer the visibility without the window, `unwindowed`), None when no slot is a document;
        refuses query rows that are document slots."""
        B, Lq, N = call.query.shape[0], call.query.shape[2], call.n_keys
        seg = cache.table.segment[:, :N]
        if bool((seg[:, N - Lq:] >= SEG_CHUNK0).any()):
            fail("PineLiteBackend", "query rows that are not document slots (documents are encoded apart, then "
                 "composed; only the question and answer run under the backend)", "document slots among the rows")
        pos = cache.table.pos[:, :N].to(call.query.device)
        doc, n, start, size, end = self.layout(seg, pos)
        if n == 0:
            return None
        allowed = call.allowed().expand(B, 1, Lq, N)
        if call.window is not None:                 # importance over every causal key; the window at PINE's positions
            allowed = unwindowed(cache, call, allowed, torch.arange(N - Lq, N), "PineLiteBackend")
        return doc, n, start, size, end, allowed

    def _step_args(self, cache: PositionedKV, call: AttentionCall) -> tuple | None:
        """(doc int32 [B, N], start, size, end, additive mask [B, N] or None) of a decode call, as
        PositionedKV.decode_pine takes them, or None when no slot is a document; once per forward and mask
        (StepMemo: the checks, the layout and the mask are paid by the first layer of each)."""
        def make() -> tuple | None:
            found = self._inputs(cache, call)
            if found is None:
                return None
            _, _, start, size, end, allowed = found
            return self._doc32, start, size, end, decode_mask(allowed)
        return self._steps.get(call, make)


def unwindowed(cache: PositionedKV, call: AttentionCall, allowed: torch.Tensor, q_slots: torch.Tensor,
               what: str, own: torch.Tensor | None = None) -> torch.Tensor:
    """The visibility of a sliding-window layer's call WITHOUT transformers' slot window: each query row (at cache
    slot q_slots [q]) sees the cache's visible slots up to its own; `own` [q, N] bool, if given, also shows keys after
    the row (PINE's document phase: other documents bidirectionally). Checked against the call's mask inside the
    window (slot distance < window), where the two must agree: a custom mask there is refused, since the window
    could not be moved to PINE's positions without knowing what it hid. allowed [B, 1, q, N] -> [B, 1, q, N]."""
    N = call.n_keys
    slots = torch.arange(N, device=allowed.device)
    q_slots = q_slots.to(allowed.device)
    seen = slots[None] <= q_slots[:, None]
    if own is not None:
        seen = seen | own.to(allowed.device)
    base = cache.table.visible[:, :N].to(allowed.device)[:, None, None, :] & seen[None, None]
    near = (slots[None] > q_slots[:, None] - call.window)[None, None]
    if not torch.equal(allowed & near, base & near) or bool((allowed & ~base).any()):
        fail(f"{what} layer {call.layer} (sliding window {call.window})",
             "the default mask (the cache's visible slots, causal) inside the window, so that the window can be "
             "applied at PINE's positions instead of the cache's slot order", "a custom mask",
             "run PINE on sliding-window layers with the default mask")
    return base.expand_as(allowed)


@contextlib.contextmanager
def use_pine_lite(model: torch.nn.Module, cache: PositionedKV) -> Iterator[PineLiteBackend]:
    """Within the block, `model` attends with PINE-lite over `cache` (its question and answer tokens)."""
    backend = PineLiteBackend()
    with bind_attention(model, backend, cache):
        yield backend


class PineDocPhase:
    """Attention backend for PINE's document phase: one forward over all document tokens (`sizes` tokens each, in
    order; the forward's rows are exactly these), after the prefix slots (module docstring). The keys of document
    j, for the rows of document i and head h, are read pair_shifts[.., h, i, j] positions earlier; visibility is the
    call's mask (pine_prefill passes prefix + other documents + own document causal)."""

    needs_cache = True

    def __init__(self, sizes: Sequence[int]) -> None:
        if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
            fail("PineDocPhase sizes", "one int >= 1 per document", list(sizes))
        self.sizes = list(sizes)

    def __call__(self, call: AttentionCall, binding: Binding) -> torch.Tensor:
        cache = binding.cache_layer_keys(call)
        layer, spec = cache.layers[call.layer], cache.layers[call.layer].spec
        B, Hq, Lq, _ = call.query.shape
        N, n = call.n_keys, len(self.sizes)
        if Lq != sum(self.sizes):
            fail("PineDocPhase", f"a forward over the {sum(self.sizes)} document tokens", f"{Lq} rows")
        sizes = torch.tensor(self.sizes)
        row_doc = torch.repeat_interleave(torch.arange(n), sizes)[None].expand(B, Lq)
        key_doc = torch.cat([torch.full((B, N - Lq), -1, dtype=torch.long), row_doc], 1)
        pos = cache.table.pos[:, :N]
        k_raw = layer.raw_keys
        imp = pair_importance(unrotate(call.query, pos[:, N - Lq:], spec), k_raw, row_doc, key_doc, n, call.scaling)
        shift = pair_shifts(imp, sizes[None].expand(B, n))                                  # [B, Hq, n, n]
        g = Hq // k_raw.shape[1]
        keys, vals = k_raw.float().repeat_interleave(g, 1), layer.values.float().repeat_interleave(g, 1)
        allowed = call.allowed().expand(B, 1, Lq, N)
        if call.window is not None:                 # the window at PINE's positions, not the slot order
            other = (key_doc[0][None, :] >= 0) & (key_doc[0][None, :] != row_doc[0][:, None])     # [Lq, N]
            allowed = unwindowed(cache, call, allowed, torch.arange(N - Lq, N), "PineDocPhase", other)
        out = torch.empty(B, Hq, Lq, vals.shape[-1])
        at = 0
        for i, size in enumerate(self.sizes):
            rows = slice(at, at + size)
            sh = shift[:, :, i].gather(-1, key_doc.clamp_min(0)[:, None].expand(B, Hq, N)) * (key_doc >= 0)[:, None]
            c, s = cos_sin(pos[:, None, :] - sh, spec)                                      # [B, Hq, N, R/2]
            k = rotate_heads(keys, c, s, spec, spec.attention_scaling)
            ok = allowed[:, :, rows]
            if call.window is not None:
                read_at = pos[:, None, None, :] - sh[:, :, None, :]                          # [B, Hq, 1, N]
                ok = ok & (pos[:, N - Lq:][:, rows][:, None, :, None] - read_at < call.window)
            att = torch.nn.functional.scaled_dot_product_attention(call.query[:, :, rows].float(), k, vals,
                                                                   attn_mask=ok, scale=call.scaling)
            out[:, :, rows] = att.nan_to_num(0.0) * ok.any(-1, keepdim=True)   # a row that sees no key: zeros
            at += size
        return AttentionCall.finish(out.to(call.query.dtype))


@torch.no_grad()
def pine_prefill(model: torch.nn.Module, prefix_ids: torch.Tensor, docs: Sequence[torch.Tensor],
                 storage: str | None = None) -> PositionedCache:
    """PINE's prefill (module docstring): a new cache holding the prefix [1, P] at 0..P-1 (plain causal) and the
    documents (1-D token tensors) each right-aligned to end at E = P + all document tokens, prefilled together under
    PineDocPhase and labelled SEG_CHUNK0 + j. Run the question and answer under PineLiteBackend (use_pine_lite)."""
    if not isinstance(prefix_ids, torch.Tensor) or prefix_ids.dim() != 2 or prefix_ids.shape[0] != 1:
        fail("pine_prefill prefix_ids", "a [1, P] token tensor", getattr(prefix_ids, "shape", type(prefix_ids)))
    if not docs or any(not isinstance(d, torch.Tensor) or d.dim() != 1 or d.numel() == 0 for d in docs):
        fail("pine_prefill docs", "a non-empty list of non-empty 1-D token tensors",
             [tuple(d.shape) if isinstance(d, torch.Tensor) else type(d).__name__ for d in docs])
    cache = PositionedCache.from_model(model, **({} if storage is None else {"storage": storage}))
    P = prefix_ids.shape[1]
    if P:
        extend(model, cache, prefix_ids, last_logits=True)
    sizes = [int(d.numel()) for d in docs]
    E, S = P + sum(sizes), sum(sizes)
    pos = torch.cat([torch.arange(E - n, E) for n in sizes])[None]
    row_doc = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    own_causal = torch.arange(S)[:, None] >= torch.arange(S)[None, :]
    seen = (row_doc[:, None] != row_doc[None, :]) | own_causal
    mask = torch.cat([torch.ones(S, P, dtype=torch.bool), seen], 1)[None, None]
    extend(model, cache, torch.cat(docs)[None], positions=pos, attention_mask=mask, attention=PineDocPhase(sizes),
           last_logits=True)
    at = P
    for j, n in enumerate(sizes):
        cache.set_segment_(at, at + n, SEG_CHUNK0 + j)
        at += n
    return cache
