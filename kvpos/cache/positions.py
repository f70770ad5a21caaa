"""Position operations: shift, set, delete, keep, hide / unhide, segment labels (validated first, atomic)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .._checks import as_positions, check_int, check_range, check_slot_index, fail
from .buffers import MAX_POSITION, SEGMENT_RANGE, _MIN_CAPACITY, _grown

if TYPE_CHECKING:
    from .kv import PositionedKV


class _PositionOps:
    """PositionedKV's position operations (a mixin: every name it uses is PositionedKV's)."""

    def shift_(self, start: int, end: int, delta: int) -> "PositionedKV":
        """Move slots [start, end) by `delta` positions (all rows); keys re-rotated once from raw. Returns self.

            before: | ... | p_start .. p_end-1              | ... |
            after:  | ... | p_start+delta .. p_end-1+delta  | ... |
        """
        n = self.check_idle("shift_")
        start, end = check_range("shift_", start, end, n)
        delta = check_int("shift_ delta", delta)
        if abs(delta) >= MAX_POSITION:
            fail("shift_ delta", f"|delta| < 2**40 (MAX_POSITION)", delta)
        new = self.table.pos[:, start:end] + delta
        self.check_new_positions(new, f"shift_ (delta={delta})")
        self._unshare_below(start)
        self.table.pos[:, start:end] = new
        self._rerotate(start, end)
        return self

    def set_positions_(self, start: int, end: int, positions: torch.Tensor | Sequence[int]) -> "PositionedKV":
        """Give slots [start, end) the positions `positions` ([S] or [B, S] int64). Returns self."""
        n = self.check_idle("set_positions_")
        start, end = check_range("set_positions_", start, end, n)
        B = max(self.table.batch_size, 1)
        pos = as_positions("set_positions_ positions", positions, B, end - start, self.table.pos.device)
        self.check_new_positions(pos, "set_positions_ positions")
        self._unshare_below(start)
        self.table.pos[:, start:end] = pos
        self._rerotate(start, end)
        return self

    def delete_(self, start: int, end: int, close_gap: bool = False) -> "PositionedKV":
        """Remove slots [start, end). With close_gap, slots after `end` move back by (end - start) positions.

            before: | 0..start-1 | start..end-1 | end..T-1            |
            after:  | 0..start-1 | end..T-1  (positions - (end-start) if close_gap) |
        """
        n = self.check_idle("delete_")
        start, end = check_range("delete_", start, end, n)
        if not isinstance(close_gap, bool):
            fail("delete_ close_gap", "a bool", type(close_gap).__name__, exc=TypeError)
        if close_gap and end < n:
            tail = self.table.pos[:, end:n] - (end - start)
            if int(tail.min()) < 0:
                fail("delete_ close_gap", "positions >= 0 after closing the gap", f"min {int(tail.min())}")
        if end == start:
            return self
        keep = torch.cat([torch.arange(0, start), torch.arange(end, n)])
        self._select(keep)
        if close_gap and start < self.table.n:
            self.table.pos[:, start:] -= end - start
            self._rerotate(start, self.table.n)
        return self

    def keep_(self, slots: torch.Tensor | Sequence[int]) -> "PositionedKV":
        """Keep only `slots` (1-D integer slot indices, any order, no repeats), in that order. Positions unchanged."""
        n = self.check_idle("keep_")
        idx = check_slot_index("keep_ slots", slots, n)
        self._select(idx)
        return self

    def _select(self, idx: torch.Tensor) -> None:
        self._unshare_below(0)
        for l in self.layers:
            if l.allocated:
                l.select_(idx.to(l.slot_device))
        if self.table._pos is not None:
            self.table.select_(idx.to(self.table._pos.device))
        self._maybe_shrink()

    def _maybe_shrink(self) -> None:
        """Release memory after large deletions: capacity back to ~2x the slots when it exceeds 4x."""
        n, cap = self.table.n, self.table.capacity
        if cap > 4 * max(n, _MIN_CAPACITY):
            new = _grown(0, max(1, 2 * n))
            for l in self.layers:
                l.shrink_(new)
            self.table.shrink_(new)

    def hide_(self, start: int, end: int) -> "PositionedKV":
        """Mask slots [start, end) out of attention (kept in memory; `unhide_` brings them back)."""
        return self._set_visible("hide_", start, end, False)

    def unhide_(self, start: int, end: int) -> "PositionedKV":
        """Make slots [start, end) visible to attention again."""
        return self._set_visible("unhide_", start, end, True)

    def _set_visible(self, op: str, start: int, end: int, value: bool) -> "PositionedKV":
        n = self.check_idle(op)
        start, end = check_range(op, start, end, n)
        if end > start:
            self._unshare_below(start)
            self.table._vis[:, start:end] = value
        return self

    def set_segment_(self, start: int, end: int, label: int) -> "PositionedKV":
        """Label slots [start, end) with `label` (an int32 tag read by attention backends such as APE)."""
        n = self.check_idle("set_segment_")
        start, end = check_range("set_segment_", start, end, n)
        label = check_int("set_segment_ label", label)
        if not SEGMENT_RANGE[0] <= label <= SEGMENT_RANGE[1]:
            fail("set_segment_ label", f"an int32 label in [{SEGMENT_RANGE[0]}, {SEGMENT_RANGE[1]}]", label)
        if end > start:
            self._unshare_below(start)
            self.table._seg[:, start:end] = label
        return self
