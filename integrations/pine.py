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
up to exact ties in the importance sort and float summation order. PINE's full form (documents attending to each
other bidirectionally in prefill) is not this: here documents never see each other.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from kvpos._checks import fail
from kvpos.cache import PositionedKV
from kvpos.compose import SEG_CHUNK0
from kvpos.posmap import offset_attend, pine_shifts, rotate_heads, segment_importance
from kvpos.rope import cos_sin, unrotate
from kvpos.integrations.hf import AttentionCall, Binding, bind_attention

__all__ = ["PineLiteBackend", "use_pine_lite", "document_layout"]


def document_layout(segment: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor,
                                                                         torch.Tensor, torch.Tensor]:
    """The documents of slots labelled SEG_CHUNK0 + d: (doc [B, N] int64, -1 for other slots; n documents; start,
    size [B, n] int64: first position and token count of each; end [B]: first start + all document tokens)."""
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
    return doc, n, start, size, start.amin(1) + size.sum(1)


class PineLiteBackend:
    """Attention backend: PINE-lite over the bound cache (module docstring). Decode steps over storage="raw" run the
    fused position-map kernel (one query variant per document); `read_counts` says which path served."""

    needs_cache = True

    def __init__(self) -> None:
        self.read_counts = {"fused": 0, "torch": 0}
        self._layout: tuple | None = None           # (segments, positions, document_layout of them): one per step

    def layout(self, seg: torch.Tensor, pos: torch.Tensor) -> tuple:
        """document_layout(seg, pos), computed once while the slots' segments and positions stay equal (every layer
        of a step reads the same ones; the check is against copies, so an in-place position change is seen)."""
        last = self._layout
        if last is None or last[0].shape != seg.shape or not torch.equal(last[0], seg) or not torch.equal(last[1], pos):
            last = self._layout = (seg.clone(), pos.clone(), document_layout(seg, pos))
        return last[2]

    def __call__(self, call: AttentionCall, binding: Binding) -> torch.Tensor:
        cache = binding.cache_layer_keys(call)
        layer = cache.layers[call.layer]
        B, Hq, Lq, _ = call.query.shape
        N = call.n_keys
        seg = cache.table.segment[:, :N]
        if bool((seg[:, N - Lq:] >= SEG_CHUNK0).any()):
            fail("PineLiteBackend", "query rows that are not document slots (documents are encoded apart, then "
                 "composed; only the question and answer run under the backend)", "document slots among the rows")
        pos = cache.table.pos[:, :N].to(call.query.device)
        doc, n, start, size, end = self.layout(seg, pos)
        if n == 0:
            return call.plain()                     # no documents: plain attention
        allowed = call.allowed().expand(B, 1, Lq, N)
        q_raw = unrotate(call.query, pos[:, N - Lq:], layer.spec)
        imp = segment_importance(q_raw, layer.raw_keys, doc, n, call.scaling, allowed)
        shift = pine_shifts(imp, start, size, end)
        out = _decode_fused(cache, call, doc, shift, allowed) if Lq == 1 else None
        self.read_counts["torch" if out is None else "fused"] += 1
        if out is None:
            out = offset_attend(call.query, call.key, call.value, doc, shift, layer.spec, call.scaling, allowed)
        return AttentionCall.finish(out.to(call.query.dtype))


def _decode_fused(cache: PositionedKV, call: AttentionCall, doc: torch.Tensor, shift: torch.Tensor,
                  allowed: torch.Tensor) -> torch.Tensor | None:
    """One query row over storage="raw" by the position-map kernel: variant 0 the query as it is (non-document
    slots), variant d + 1 the query turned back by document d's shift; [B, Hq, 1, D] float32 or None."""
    B, Hq, _, n = shift.shape
    c, s = cos_sin((-shift).reshape(B, Hq, n), cache.layers[call.layer].spec)
    turned = rotate_heads(call.query.float().expand(B, Hq, n, -1), c, s, cache.layers[call.layer].spec, 1.0)
    q = torch.cat([call.query.float(), turned], 2)                                              # [B, Hq, n+1, D]
    mask = torch.zeros(allowed.shape[0], allowed.shape[-1]).masked_fill_(~allowed[:, 0, 0], float("-inf"))
    out = cache.decode_mapped(call.layer, q, mask, call.scaling, seg=doc + 1)
    return None if out is None else out[:, :, None]


@contextlib.contextmanager
def use_pine_lite(model: torch.nn.Module, cache: PositionedKV) -> Iterator[PineLiteBackend]:
    """Within the block, `model` attends with PINE-lite over `cache` (its question and answer tokens)."""
    backend = PineLiteBackend()
    with bind_attention(model, backend, cache):
        yield backend
