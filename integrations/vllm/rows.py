"""The engine-independent half of kvpos's vLLM attention backends (no vLLM import): each batch row's view of a
step (RowView, row_views: its blocks, logical positions and visibility from its kvpos layout) and attention of a
row's queries in torch over raw keys rotated to the logical positions (row_attention). The CPU backend
(attention.py) and the CUDA one (attention_cuda.py) read their paged caches into [H, s, D] and call these.

Letters: T tokens of the step · s a request's tokens so far · q its tokens in this step · H kv heads · Hq query
heads · D head dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvpos._checks import fail
from kvpos.ape import ape_attend
from kvpos.compose import plan_layout
from kvpos.rope import rotate, unrotate

__all__ = ["RowView", "layout_positions", "row_views", "row_attention", "attend"]


@dataclass
class RowView:
    """Batch row `row`: query tokens [q0, q1) of the step, s tokens of the request so far, the blocks holding them
    in order ([ceil(s / block size)] int64), and, for a kvpos layout, logical positions [s] int64 and visibility of
    the row's queries [q, s] bool (None: vLLM's positions, causal); `lead`: how many of its first queries attend in
    torch (all with APE; else those up to the last whose visibility is not causal by token index, e.g. passage
    tokens computed in the parallel layout), the rest through vLLM's kernel; with APE its (temperature, scale) and
    which tokens are passages [s] bool."""

    q0: int
    q1: int
    s: int
    block_ids: torch.Tensor
    row: int = 0
    logical: torch.Tensor | None = None
    allowed: torch.Tensor | None = None
    lead: int = 0
    ape: tuple[float, float] | None = None
    is_ctx: torch.Tensor | None = None


def layout_positions(anchor_len: int, lengths: list[int], layout: str, s: int, n: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logical positions [s], visibility of the last n tokens [n, s]) of the first s tokens of a request with this
    layout: the anchor, the passages (kvpos.compose.plan_layout), then the question and generated tokens after
    them."""
    plan = plan_layout(anchor_len, lengths, layout)
    P = plan.num_slots
    pieces = [torch.arange(anchor_len)] + [plan.positions(i) for i in range(len(lengths))]
    tail = torch.arange(plan.next_position, plan.next_position + max(0, s - P))
    logical = torch.cat(pieces + [tail])[:s]
    return logical, plan.allowed(max(0, s - P), torch.arange(s - n, s))[:, :s]


def row_views(meta: Any, block_size: int, rows: list) -> list[RowView]:
    """The step's batch rows, each matched to its kvpos layout (`rows`: scheduler.RowLayout of the step). Raises
    ValueError when a layout finds no row (a request's positions would silently be vLLM's)."""
    qsl = meta.query_start_loc.tolist()
    seq = meta.seq_lens.tolist()
    by_block = {b: r for r in rows for b in r.block_ids}
    views, used = [], set()
    for i in range(len(seq)):
        q0, q1, s = qsl[i], qsl[i + 1], int(seq[i])
        if q1 <= q0:
            continue
        t = torch.arange(s)
        v = RowView(q0, q1, s, meta.block_table[i][:-(-s // block_size)].to(torch.long), i)
        last = int(meta.slot_mapping[q1 - 1]) // block_size
        r = by_block.get(last)
        if r is not None:
            v.logical, v.allowed = layout_positions(r.anchor_len, r.lengths, r.layout, s, q1 - q0)
            odd = (v.allowed != (t[None] <= t[s - (q1 - q0):, None])).any(1).nonzero()
            v.lead = int(odd[-1]) + 1 if odd.numel() else 0
            if r.ape is not None:
                v.ape = tuple(r.ape)
                v.is_ctx = (t >= r.anchor_len) & (t < r.anchor_len + sum(r.lengths))
                v.lead = q1 - q0
            used.add(r.req_id)
        views.append(v)
    missing = sorted({r.req_id for r in rows} - used)
    if missing:
        fail("kvpos attention rows", "a batch row for every request with a kvpos layout", f"none for {missing}")
    return views


def row_attention(query: torch.Tensor, positions: torch.Tensor, v: RowView, spec: Any, scale: float,
                  raw: torch.Tensor, val: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Attention of row v's queries a..b (of its q0..q1; query [T, Hq, D] rotated at vLLM's positions `positions`
    [T]) over its raw keys and values raw, val [H, s, D], the keys rotated to the row's logical positions and the
    queries turned to theirs, under its visibility, over the keys some query sees -> [b - a, Hq, D] (query's dtype;
    any device: the row's positions and masks move to raw's)."""
    dev = raw.device
    q = query[v.q0 + a:v.q0 + b]
    qh = q.transpose(0, 1)[None]                                                # [1, Hq, n, D]
    t0 = v.s - (v.q1 - v.q0)                                                    # the row's first query token
    if v.logical is None:
        kpos = torch.arange(v.s)
        mask = None if (a, b) == (0, v.q1 - v.q0) else torch.arange(v.s)[None] <= torch.arange(
            t0 + a, t0 + b)[:, None]
    else:
        kpos, mask = v.logical, v.allowed[a:b]
        qh = rotate(unrotate(qh, positions[v.q0 + a:v.q0 + b].to(dev), spec), kpos[t0 + a:t0 + b].to(dev), spec)
    is_ctx = v.is_ctx
    if mask is not None and not bool(mask.any(0).all()):                       # only the keys some query sees
        cols = mask.any(0).nonzero().flatten()                                  # (a parallel passage's own)
        raw, val, kpos, mask = raw[:, cols.to(dev)], val[:, cols.to(dev)], kpos[cols], mask[:, cols]
        is_ctx = None if is_ctx is None else is_ctx[cols]
    k = rotate(raw[None], kpos.to(dev), spec)                                   # [1, H, s', D]
    mask = None if mask is None else mask.to(dev)
    if v.ape is not None:                                                       # APE over the passages
        out = ape_attend(qh, k, val[None], mask[None, None], is_ctx[None].to(dev), scale, v.ape[0], v.ape[1],
                         q_is_ctx=v.is_ctx[t0 + a:t0 + b][None].to(dev))       # [1, Hq, n, D]
        return out[0].transpose(0, 1).to(q.dtype)
    return attend(qh, k, val[None], mask, scale).transpose(0, 1).to(q.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float
            ) -> torch.Tensor:
    """Grouped-query attention of q [1, Hq, n, D] over k, v [1, H, s, D] -> [Hq, n, D] (torch's fused CPU kernel);
    allowed [n, s] bool, or None: causal with the n queries last (query i sees keys up to s - n + i)."""
    n, s = q.shape[2], k.shape[2]
    if allowed is None and n == s:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out[0]
    if allowed is None:
        allowed = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(s - n)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                                            enable_gqa=True)[0]
