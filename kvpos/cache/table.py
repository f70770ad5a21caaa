"""SlotTable: the positions, visibility and segment labels of every slot, shared by all layers."""
from __future__ import annotations

from typing import Callable

import torch

from .._checks import fail

from .buffers import _OVERFLOW, _alloc, _dynamic_capacity, _grown, _regrow, _sized, _static_buffer


class SlotTable:
    """Positions, visibility and segment labels of the cached slots; [B, C] buffers, first `n` valid."""

    def __init__(self, fixed: int | None = None, grow: Callable[[int, int], int] | None = None) -> None:
        self._pos: torch.Tensor | None = None
        self._vis: torch.Tensor | None = None
        self._seg: torch.Tensor | None = None
        self.fixed = fixed          # a fixed capacity (never grows nor shrinks), or None
        # fixed capacity: the slot count also as a 0-d int64 tensor, the one compiled forwards advance (a Python int
        # would specialise or recompile every step); eager code reads `n`, re-synced from it (PositionedKV.sync_count)
        self.count = _static_buffer(torch.zeros((), dtype=torch.long)) if fixed is not None else None
        self.n = 0
        # the layers' growth rule: table and layers then regrow in the same forward (one growth branch to compile)
        self.grow = _grown if grow is None else grow
        self.room = 0               # slots the first allocation makes room for at least (reserve_ before any slot)

    @property
    def n(self) -> int:
        """The number of valid slots."""
        return self._n

    @n.setter
    def n(self, value: int) -> None:
        self._n = value
        if self.count is not None and not torch.compiler.is_compiling():
            self.count.fill_(value)

    def append_counted(self, pos: torch.Tensor) -> torch.Tensor:
        """Fixed capacity, inside a compiled forward: write S slots at the tensor count and advance it (no Python
        int is read or written). Returns the slot index [S] the layers write at. A forward past the capacity writes
        into the overflow slot only and raises (RuntimeError naming the capacity): never a silent wrap."""
        B, S = pos.shape
        if self._pos is None:
            self.reserve(B, S, pos.device)
        C = self.fixed
        torch._assert_async(self.count + S <= C, f"fixed-capacity cache: expected at most {C} slots (its capacity), "
                            "got a compiled forward past it (the cache is unchanged); build it with a larger capacity=")
        idx = torch.clamp(torch.arange(S, device=pos.device) + self.count, max=C)     # past C: the overflow slot
        self._pos.index_copy_(1, idx, pos)
        self._vis.index_fill_(1, idx, True)
        self._seg.index_fill_(1, idx, 0)
        self.count.copy_(torch.clamp(self.count + S, max=C))
        return idx

    @property
    def batch_size(self) -> int:
        """B, or -1 before the first slot."""
        return -1 if self._pos is None else self._pos.shape[0]

    @property
    def capacity(self) -> int:
        return 0 if self._pos is None else self._pos.shape[1] - (_OVERFLOW if self.fixed else 0)

    @property
    def pos(self) -> torch.Tensor:
        """[B, T] int64 view of the valid positions (a view: do not modify; use the cache's operations)."""
        return self._pos[:, : self.n] if self._pos is not None else torch.zeros(0, 0, dtype=torch.long)

    @property
    def visible(self) -> torch.Tensor:
        return self._vis[:, : self.n] if self._vis is not None else torch.zeros(0, 0, dtype=torch.bool)

    @property
    def segment(self) -> torch.Tensor:
        return self._seg[:, : self.n] if self._seg is not None else torch.zeros(0, 0, dtype=torch.int32)

    def reserve(self, B: int, need: int, device: torch.device) -> None:
        """Make room for `need` slots (all-or-nothing)."""
        if self._pos is None:
            cap = _sized(self.fixed, 0, max(need, self.room), self.grow)
            cap += _OVERFLOW if self.fixed else 0
            pos = _alloc((B, cap), torch.long, device, 0)
            vis = _alloc((B, cap), torch.bool, device, True)
            seg = _alloc((B, cap), torch.int32, device, 0)
            self._pos, self._vis, self._seg = (_static_buffer(t) if self.fixed else _dynamic_capacity(t, 1)
                                               for t in (pos, vis, seg))
            if self.count is not None and self.count.device != pos.device:
                self.count = _static_buffer(self.count.to(pos.device))
            return
        if need <= self.capacity:
            return
        self._pos, self._vis, self._seg = _regrow([self._pos, self._vis, self._seg], 1,
                                                  _sized(self.fixed, self.capacity, need, self.grow), self.n)

    def append(self, pos: torch.Tensor, visible: torch.Tensor | None = None, segment: int | torch.Tensor = 0) -> None:
        """Append S slots; pos [B, S] int64 (already validated)."""
        B, S = pos.shape
        self.reserve(B, self.n + S, pos.device)
        if torch.compiler.is_compiling() and visible is None and isinstance(segment, int):
            idx = torch.arange(S, device=pos.device) + self.n
            self._pos.index_copy_(1, idx, pos)
            self._vis.index_fill_(1, idx, True)
            self._seg.index_fill_(1, idx, segment)
        else:
            sl = slice(self.n, self.n + S)
            self._pos[:, sl] = pos
            self._vis[:, sl] = True if visible is None else visible
            self._seg[:, sl] = segment
        self.n += S

    def truncate(self, n: int) -> None:
        self.n = n

    def select_(self, idx: torch.Tensor) -> None:
        """Keep slots idx (1-D long, any order) in that order."""
        for name in ("_pos", "_vis", "_seg"):
            buf = getattr(self, name)
            buf[:, : idx.numel()] = buf[:, idx]
        self.n = idx.numel()

    def unshare_(self) -> None:
        """Copy-on-write: new buffers holding the valid slots (see SlotLayer.unshare_)."""
        if self._pos is not None:
            self._pos, self._vis, self._seg = _regrow([self._pos, self._vis, self._seg], 1, self.capacity, self.n,
                                                      self.fixed is not None)

    def select_rows_(self, rows: torch.Tensor) -> None:
        """Batch rows `rows` (new tensors: the old buffers are left as they were)."""
        if self._pos is None:
            return
        self._pos, self._vis, self._seg = (b[rows.to(b.device)] for b in (self._pos, self._vis, self._seg))

    def shrink_(self, cap: int) -> None:
        if self._pos is not None and cap < self.capacity and self.fixed is None:
            self._pos, self._vis, self._seg = _regrow([self._pos, self._vis, self._seg], 1, cap, self.n)

    def valid_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(pos [B, T] int64, visible [B, T] bool, segment [B, T] int32) of the valid slots, views of the buffers
        (what an export flattens), or None before the first write."""
        if self._pos is None:
            return None
        return self._pos[:, : self.n], self._vis[:, : self.n], self._seg[:, : self.n]

    def adopt_(self, pos: torch.Tensor, visible: torch.Tensor, segment: torch.Tensor) -> None:
        """Take these tensors (not copies) as the buffers, every slot valid: pos [B, T] int64, visible [B, T] bool,
        segment [B, T] int32 (what an export unflattens)."""
        B, T = pos.shape
        for what, x, dtype in (("visible", visible, torch.bool), ("segment", segment, torch.int32)):
            if tuple(x.shape) != (B, T) or x.dtype != dtype:
                fail(f"SlotTable.adopt_ {what}", f"[{B}, {T}] {dtype}", f"{tuple(x.shape)} {x.dtype}")
        if pos.dtype != torch.long:
            fail("SlotTable.adopt_ pos", "int64", pos.dtype)
        self._pos, self._vis, self._seg = pos, visible, segment
        self.n = T

    def copy(self, headroom: int = 0) -> "SlotTable":
        """A copy holding the valid slots (plus `headroom` free ones), not the whole capacity (a fixed-capacity
        table copies into its fixed capacity)."""
        t = SlotTable(self.fixed, self.grow)
        if self._pos is not None:
            cap = self.fixed or max(self.n + headroom, 1)
            t._pos, t._vis, t._seg = _regrow([self._pos, self._vis, self._seg], 1, cap, self.n, self.fixed is not None)
        t.n = self.n
        return t
