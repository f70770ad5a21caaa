"""AttnRank on transformers: profile where a model's question reads the documents of a composed cache (per layer,
per document slot), then lay out ranked documents by the attention basin (kvpos.ordering). With chunk reuse a
reorder is a new composition of stored chunks: no document is encoded again.

    basin = AttentionBasin(n)
    for parts in probe_requests:                                  # calibration questions, n documents each
        cache, info = composer.compose(parts.chunks, layout="sequential")
        basin.add(segment_mass(model, cache, info.plan.slots, parts.question))
    order = basin.slot_order()                                    # the basin layer's slots, most read first
    cache, _ = composer.compose(place(ranked_chunks, order))      # the rank-r document in slot order[r]

Profile in the layout that will serve (full prefill and chunk reuse can read slots differently).
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvpos._checks import fail
from kvpos.cache import PositionedKV
from kvpos.ordering import ORDERS, AttentionBasin, lim_order, order_for, place
from kvpos.integrations.repairs import layer_attention_mass

__all__ = ["segment_mass", "AttentionBasin", "place", "lim_order", "order_for", "ORDERS"]


@torch.no_grad()
def segment_mass(model: torch.nn.Module, cache: PositionedKV, slots: Sequence[tuple[int, int]],
                 question: torch.Tensor) -> torch.Tensor:
    """[L, n] float32: per layer, the attention mass that the question's tokens [q] (placed after the cache) put
    on each document's slots [start, end), summed over its slots. The cache is left as it was."""
    if not slots:
        fail("segment_mass slots", "a non-empty list of (start, end) document slot ranges", list(slots))
    mass = layer_attention_mass(model, cache, question.reshape(-1), None)
    return torch.stack([mass[:, s:e].sum(1) for s, e in slots], 1)
