"""Composition plans: where stored chunks go in a request's cache, and what each slot may attend to.

Letters: A anchor tokens · S_i chunk i's tokens · q question tokens · N slots.

A request = anchor (shared prefix, cached once at positions 0..A-1) + chunks (each encoded ONCE after the anchor at
positions A..A+S_i-1, stored raw) + question:

    sequential: | anchor 0..A-1 | c1 A..A+S1-1 | c2 A+S1..  | ... | question P.. |
    parallel:   | anchor 0..A-1 | c1 A..A+S1-1 | c2 A..A+S2-1 | ... | question A+max(S_i).. |

Slots are labelled with segments: SEG_ANCHOR for the anchor, SEG_CHUNK0 + i for chunk i, SEG_QUERY for the question
and generated tokens (APE treats segment >= SEG_CHUNK0 as context). Repairs are plans too: `link_slots` (EPIC's
LegoLink: the first k tokens of every chunk after the first, re-encoded at their final positions) and the masks a
re-encoded slot attends with (`allowed`). The engine glue (kvpos.integrations.compose) runs the forwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ._checks import fail

__all__ = ["SEG_QUERY", "SEG_ANCHOR", "SEG_CHUNK0", "LAYOUTS", "LayoutPlan", "plan_layout", "block_diagonal_allowed"]

SEG_QUERY = 0        # question and generated tokens
SEG_ANCHOR = 1       # the shared anchor prefix
SEG_CHUNK0 = 16      # chunk i is labelled SEG_CHUNK0 + i
LAYOUTS = ("sequential", "parallel")


@dataclass(frozen=True)
class LayoutPlan:
    """Slot ranges and first positions of the chunks of one request, after an anchor of `anchor_len` slots.

    slots[i] = [start, end) slot range of chunk i; starts[i] = position of its first token; next_position = where
    the question starts."""

    layout: str
    anchor_len: int
    slots: tuple[tuple[int, int], ...]
    starts: tuple[int, ...]
    next_position: int

    @property
    def num_slots(self) -> int:
        return self.slots[-1][1] if self.slots else self.anchor_len

    def positions(self, i: int) -> torch.Tensor:
        """[S_i] int64 positions of chunk i."""
        s, e = self.slots[i]
        return torch.arange(self.starts[i], self.starts[i] + e - s)

    def allowed(self, n_query: int = 0, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[N, N] bool (N = anchor + chunks + n_query): what each slot of the composed layout may see; with rows
        ([R] int64 slots in [0, N)) only those rows, [R, N] (what a step of R query slots needs, without the N x N
        matrix).

        sequential: plain causal over slots (each chunk sees the anchor and every chunk before it), the full-prefill
        pattern. parallel: each chunk sees the anchor and itself (causal); the query sees everything."""
        N = self.num_slots + n_query
        if rows is None:
            rows = torch.arange(N)
        elif rows.dtype != torch.long or rows.dim() != 1 or (rows.numel() and not 0 <= int(rows.min()) <= int(
                rows.max()) < N):
            fail("allowed rows", f"a 1-D int64 tensor of slots in [0, {N})", f"{rows.dtype} {list(rows.shape)}")
        cols = torch.arange(N)
        allowed = cols[None] <= rows[:, None]
        if self.layout == "parallel" and self.slots:
            first = torch.full((N,), self.anchor_len)            # the first slot each row's chunk may not hide
            for s, e in self.slots:
                first[s:e] = s
            hidden_to = first[rows]                              # row r sees no chunk slot in [anchor, first[r])
            allowed &= ~((cols[None] >= self.anchor_len) & (cols[None] < hidden_to[:, None]))
        return allowed

    def link_slots(self, k: int) -> torch.Tensor:
        """Slots [K] of the first k tokens of every chunk after the first (LegoLink's re-encoded tokens)."""
        if k < 0:
            fail("link k", "an int >= 0", k)
        out = [torch.arange(s, min(s + k, e)) for s, e in self.slots[1:]]
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

    def chunk_slots(self) -> torch.Tensor:
        """Every chunk slot [sum S_i], ascending."""
        return torch.arange(self.anchor_len, self.num_slots)

    def tail_slots(self, k: int) -> torch.Tensor:
        """Slots [K] of the last k tokens of every chunk (in a chat layout with one turn per passage: the turn's
        closing tokens, which read every passage before them in a full prefill), ascending."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            fail("tail k", "an int >= 0", k)
        out = [torch.arange(max(s, e - k), e) for s, e in self.slots]
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

    def slots_of(self, chunks: Sequence[int]) -> torch.Tensor:
        """Slots [K] of the chunks with these indices (each whole), ascending."""
        idx = sorted(set(chunks))
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.slots) for i in idx):
            fail("chunk indices", f"ints in [0, {len(self.slots)})", list(chunks))
        out = [torch.arange(*self.slots[i]) for i in idx]
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def plan_layout(anchor_len: int, lengths: Sequence[int], layout: str = "sequential") -> LayoutPlan:
    """Place chunks of `lengths` tokens after an anchor of `anchor_len` slots, in order, under `layout`."""
    if layout not in LAYOUTS:
        fail("compose layout", "'sequential' or 'parallel'", repr(layout))
    if not lengths:
        fail("compose chunks", "at least one chunk", "none")
    slots, starts = [], []
    s0, pos = anchor_len, anchor_len
    for L in lengths:
        if isinstance(L, bool) or not isinstance(L, int) or L <= 0:
            fail("compose chunk length", "a positive int", L)
        start = pos if layout == "sequential" else anchor_len
        slots.append((s0, s0 + L))
        starts.append(start)
        s0 += L
        pos = start + L if layout == "sequential" else max(pos, anchor_len + L)
    return LayoutPlan(layout, anchor_len, tuple(slots), tuple(starts), pos)


def block_diagonal_allowed(lengths: Sequence[int], prefix: int = 0) -> torch.Tensor:
    """[sum L, prefix + sum L] bool: token t of chunk i sees the whole prefix and chunk i's tokens <= t.

    Same pattern as xformers' BlockDiagonalCausalMask (plus a shared prefix column block)."""
    if not lengths or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in lengths):
        fail("block_diagonal_allowed lengths", "a non-empty list of positive ints", list(lengths))
    n = sum(lengths)
    allowed = torch.zeros(n, prefix + n, dtype=torch.bool)
    allowed[:, :prefix] = True
    s = 0
    for L in lengths:
        allowed[s:s + L, prefix + s:prefix + s + L] = torch.tril(torch.ones(L, L, dtype=torch.bool))
        s += L
    return allowed

