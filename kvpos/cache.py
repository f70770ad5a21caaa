"""The positioned KV cache core: per-layer UNROTATED keys + rotated keys + values, and one slot table of positions.

Letters: B batch · H kv heads · T cached slots · S new slots · D head_dim · C capacity (>= T).

Storage per layer (buffers grow geometrically, the first T slots are valid):

    raw_k [B, H, C, D]   keys before RoPE (what the model's k_proj produced)   <- the source of truth
    rot_k [B, H, C, D]   raw_k rotated to the slot's *current* position        <- what attention reads
    v     [B, H, C, D]   values (RoPE never touches them)

Slot table, shared by all layers (every layer holds the same slots):

    pos     [B, C] int64  logical position of each slot (per batch row: left padding gives rows different positions)
    visible [B, C] bool   False = hidden (kept in memory, masked out of attention)
    segment [B, C] int32  free label per slot (compose() marks anchor / chunk / query slots with it)

Invariant: rot_k[..., j, :] == rotate(raw_k[..., j, :], pos[j]) for every valid slot j, computed by ONE rotation from
raw_k whenever pos[j] changes (no chains of delta rotations, so no drift). New slots coming from the model keep the
model's own rotated keys (bit-identical to DynamicCache) and get raw_k = unrotate(k, pos).

Every position operation validates all its arguments before touching anything: a failed call leaves the cache as it
was. Operations that mutate end in "_".
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from ._checks import as_positions, check_int, check_range, fail
from .rope import RopeSpec, _apply_many, cos_sin

__all__ = ["SlotLayer", "SlotTable", "PositionedKV", "GROWTH"]

GROWTH = 2.0  # capacity multiplier when a buffer is full
_MIN_CAPACITY = 64


def _grown(old_cap: int, need: int) -> int:
    cap = max(old_cap, _MIN_CAPACITY)
    while cap < need:
        cap = int(math.ceil(cap * GROWTH))
    return cap


class SlotTable:
    """Positions, visibility and segment labels of the cached slots; [B, C] buffers, first `n` valid."""

    def __init__(self) -> None:
        self._pos: torch.Tensor | None = None
        self._vis: torch.Tensor | None = None
        self._seg: torch.Tensor | None = None
        self.n = 0

    @property
    def batch_size(self) -> int:
        return -1 if self._pos is None else self._pos.shape[0]

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

    def _reserve(self, B: int, need: int, device: torch.device) -> None:
        if self._pos is None:
            cap = _grown(0, need)
            self._pos = torch.zeros(B, cap, dtype=torch.long, device=device)
            self._vis = torch.ones(B, cap, dtype=torch.bool, device=device)
            self._seg = torch.zeros(B, cap, dtype=torch.int32, device=device)
            return
        cap = self._pos.shape[1]
        if need <= cap:
            return
        new = _grown(cap, need)
        for name in ("_pos", "_vis", "_seg"):
            old = getattr(self, name)
            buf = torch.zeros(old.shape[0], new, dtype=old.dtype, device=old.device)
            buf[:, : self.n] = old[:, : self.n]
            setattr(self, name, buf)

    def append(self, pos: torch.Tensor, visible: torch.Tensor | None = None, segment: int | torch.Tensor = 0) -> None:
        """Append S slots; pos [B, S] int64 (already validated)."""
        B, S = pos.shape
        self._reserve(B, self.n + S, pos.device)
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

    def select_rows_(self, rows: torch.Tensor) -> None:
        for name in ("_pos", "_vis", "_seg"):
            setattr(self, name, getattr(self, name)[rows.to(getattr(self, name).device)])

    def copy(self) -> "SlotTable":
        t = SlotTable()
        if self._pos is not None:
            t._pos, t._vis, t._seg = self._pos.clone(), self._vis.clone(), self._seg.clone()
        t.n = self.n
        return t


class SlotLayer:
    """One layer's storage: raw_k, rot_k, v buffers [B, H, C, D], first `n` slots valid."""

    def __init__(self, spec: RopeSpec, raw_dtype: torch.dtype | None = None) -> None:
        self.spec = spec
        self.raw_dtype = raw_dtype
        self.raw_k: torch.Tensor | None = None
        self.rot_k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.n = 0

    # -- views ---------------------------------------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        """[B, H, T, D] keys rotated to their current positions (a view into the buffer)."""
        return None if self.rot_k is None else self.rot_k[:, :, : self.n]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.v is None else self.v[:, :, : self.n]

    @property
    def raw_keys(self) -> torch.Tensor | None:
        """[B, H, T, D] keys before RoPE."""
        return None if self.raw_k is None else self.raw_k[:, :, : self.n]

    @property
    def capacity(self) -> int:
        return 0 if self.rot_k is None else self.rot_k.shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.raw_k, self.rot_k, self.v) if t is not None)

    # -- growth --------------------------------------------------------------------------------------------------
    def reserve(self, like_k: torch.Tensor, like_v: torch.Tensor, need: int) -> None:
        """Make room for `need` slots (geometric growth; copies only the valid prefix)."""
        B, H, _, D = like_k.shape
        if self.rot_k is None:
            cap = _grown(0, need)
            raw_dtype = self.raw_dtype or like_k.dtype
            self.rot_k = torch.empty(B, H, cap, D, dtype=like_k.dtype, device=like_k.device)
            self.raw_k = torch.empty(B, H, cap, D, dtype=raw_dtype, device=like_k.device)
            self.v = torch.empty(B, H, cap, like_v.shape[-1], dtype=like_v.dtype, device=like_v.device)
            return
        if need <= self.capacity:
            return
        cap = _grown(self.capacity, need)
        for name in ("rot_k", "raw_k", "v"):
            old = getattr(self, name)
            buf = torch.empty(old.shape[0], old.shape[1], cap, old.shape[3], dtype=old.dtype, device=old.device)
            buf[:, :, : self.n] = old[:, :, : self.n]
            setattr(self, name, buf)

    def append(self, k_rot: torch.Tensor, v: torch.Tensor, k_raw: torch.Tensor) -> None:
        """Write S new slots after the valid ones. k_rot/k_raw/v: [B, H, S, D]."""
        S = k_rot.shape[2]
        self.reserve(k_rot, v, self.n + S)
        sl = slice(self.n, self.n + S)
        self.rot_k[:, :, sl] = k_rot
        self.raw_k[:, :, sl] = k_raw
        self.v[:, :, sl] = v
        self.n += S

    def select_(self, idx: torch.Tensor) -> None:
        """Keep slots idx (1-D long) in that order, compacting them to the front."""
        for name in ("rot_k", "raw_k", "v"):
            buf = getattr(self, name)
            buf[:, :, : idx.numel()] = buf[:, :, idx]
        self.n = idx.numel()

    def select_rows_(self, rows: torch.Tensor) -> None:
        for name in ("rot_k", "raw_k", "v"):
            buf = getattr(self, name)
            if buf is not None:
                setattr(self, name, buf[rows.to(buf.device)])

    def clear(self) -> None:
        self.raw_k = self.rot_k = self.v = None
        self.n = 0


class PositionedKV:
    """Position operations over a list of SlotLayer-like layers sharing one SlotTable.

    Subclasses provide `self.layers` (SlotLayer instances) and `self.table` (SlotTable). The transformers adapter
    (`kvpos.integrations.hf.PositionedCache`) adds the `transformers.Cache` protocol on top.
    """

    layers: list[SlotLayer]
    table: SlotTable

    # -- reading -------------------------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """T, the number of cached slots (hidden ones included)."""
        return self.table.n

    @property
    def positions(self) -> torch.Tensor:
        """[B, T] int64 copy of the slot positions."""
        return self.table.pos.clone()

    @property
    def visible(self) -> torch.Tensor:
        """[B, T] bool copy: False where a slot is hidden."""
        return self.table.visible.clone()

    @property
    def segments(self) -> torch.Tensor:
        """[B, T] int32 copy of the slot labels."""
        return self.table.segment.clone()

    def next_position(self) -> torch.Tensor:
        """[B] int64: one past the largest position of a visible slot per row (0 for an empty row)."""
        t = self.table
        if t.n == 0:
            B = max(t.batch_size, 1)
            return torch.zeros(B, dtype=torch.long)
        p = t.pos.masked_fill(~t.visible, -1)
        return p.max(dim=1).values + 1

    def attention_mask(self, new_tokens: int = 0) -> torch.Tensor:
        """[B, T + new_tokens] int64 2-D mask for transformers: 1 = attend, 0 = hidden slot."""
        vis = self.table.visible.long()
        if new_tokens:
            vis = torch.cat([vis, vis.new_ones(vis.shape[0], new_tokens)], 1)
        return vis

    def nbytes(self) -> int:
        """Bytes held by the key/value buffers of every layer (capacity, not just valid slots)."""
        return sum(l.nbytes() for l in self.layers)

    def raw_kv(self, start: int = 0, end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (raw_keys [B, H, S, D], values [B, H, S, D]) of slots [start, end): copies, safe to keep."""
        n = self._check_idle("raw_kv")
        end = n if end is None else end
        start, end = check_range("raw_kv", start, end, n)
        return [(l.raw_k[:, :, start:end].clone(), l.v[:, :, start:end].clone()) for l in self.layers]

    def rotated_keys(self, layer: int) -> torch.Tensor:
        """[B, H, T, D] keys of `layer` as attention sees them (a view)."""
        return self.layers[layer].keys

    # -- validation helpers ----------------------------------------------------------------------------------------
    def _check_idle(self, op: str) -> int:
        """All layers must hold the table's slots (not in the middle of a forward); return T."""
        n = self.table.n
        for i, l in enumerate(self.layers):
            if l.n != n:
                fail(f"{op}: layer {i}", f"{n} slots like the slot table", f"{l.n}",
                     "position operations run between forwards, not during one")
        return n

    def _specs(self) -> dict[int, tuple[RopeSpec, list[int]]]:
        groups: dict[int, tuple[RopeSpec, list[int]]] = {}
        for i, l in enumerate(self.layers):
            groups.setdefault(id(l.spec), (l.spec, []))[1].append(i)
        return groups

    def _check_spec_limits(self, pos: torch.Tensor, what: str) -> None:
        for spec, _ in self._specs().values():
            spec.check_positions(pos, what)

    def _rerotate(self, start: int, end: int) -> None:
        """Recompute rot_k of slots [start, end) from raw_k, every layer; cos/sin computed once per distinct spec."""
        if end <= start or not self.layers:
            return
        pos = self.table.pos[:, start:end]
        for spec, idx in self._specs().values():
            cos, sin = cos_sin(pos, spec, device=self.layers[idx[0]].rot_k.device)
            layers = [self.layers[i] for i in idx]
            _apply_many([l.raw_k[:, :, start:end] for l in layers], [l.rot_k[:, :, start:end] for l in layers],
                        cos[:, None], sin[:, None], spec)

    # -- position operations -------------------------------------------------------------------------------------
    def shift_(self, start: int, end: int, delta: int) -> "PositionedKV":
        """Move slots [start, end) by `delta` positions (all rows); keys re-rotated once from raw. Returns self.

            before: | ... | p_start .. p_end-1              | ... |
            after:  | ... | p_start+delta .. p_end-1+delta  | ... |
        """
        n = self._check_idle("shift_")
        start, end = check_range("shift_", start, end, n)
        delta = check_int("shift_ delta", delta)
        new = self.table.pos[:, start:end] + delta
        if new.numel() and int(new.min()) < 0:
            fail("shift_", "positions >= 0 after the shift", f"min {int(new.min())} (delta={delta})")
        self._check_spec_limits(new, "shift_")
        self.table.pos[:, start:end] = new
        self._rerotate(start, end)
        return self

    def set_positions_(self, start: int, end: int, positions: torch.Tensor | Sequence[int]) -> "PositionedKV":
        """Give slots [start, end) the positions `positions` ([S] or [B, S] int64). Returns self."""
        n = self._check_idle("set_positions_")
        start, end = check_range("set_positions_", start, end, n)
        B = max(self.table.batch_size, 1)
        pos = as_positions("set_positions_ positions", positions, B, end - start, self.table.pos.device)
        self._check_spec_limits(pos, "set_positions_")
        self.table.pos[:, start:end] = pos
        self._rerotate(start, end)
        return self

    def delete_(self, start: int, end: int, close_gap: bool = False) -> "PositionedKV":
        """Remove slots [start, end). With close_gap, slots after `end` move back by (end - start) positions.

            before: | 0..start-1 | start..end-1 | end..T-1            |
            after:  | 0..start-1 | end..T-1  (positions - (end-start) if close_gap) |
        """
        n = self._check_idle("delete_")
        start, end = check_range("delete_", start, end, n)
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
        """Keep only `slots` (1-D slot indices, any order, no repeats), in that order. Positions are unchanged."""
        n = self._check_idle("keep_")
        idx = torch.as_tensor(slots, dtype=torch.long)
        if idx.dim() != 1:
            fail("keep_ slots", "a 1-D index list", tuple(idx.shape))
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            fail("keep_ slots", f"indices in [0, {n})", f"min {int(idx.min())}, max {int(idx.max())}")
        if idx.unique().numel() != idx.numel():
            fail("keep_ slots", "distinct indices", "repeated indices")
        self._select(idx)
        return self

    def _select(self, idx: torch.Tensor) -> None:
        for l in self.layers:
            l.select_(idx.to(l.rot_k.device))
        self.table.select_(idx.to(self.table._pos.device))

    def hide_(self, start: int, end: int) -> "PositionedKV":
        """Mask slots [start, end) out of attention (kept in memory; `unhide_` brings them back)."""
        n = self._check_idle("hide_")
        start, end = check_range("hide_", start, end, n)
        self.table._vis[:, start:end] = False
        return self

    def unhide_(self, start: int, end: int) -> "PositionedKV":
        n = self._check_idle("unhide_")
        start, end = check_range("unhide_", start, end, n)
        self.table._vis[:, start:end] = True
        return self

    def set_segment_(self, start: int, end: int, label: int) -> "PositionedKV":
        """Label slots [start, end) with `label` (an int32 tag read by attention backends such as APE)."""
        n = self._check_idle("set_segment_")
        start, end = check_range("set_segment_", start, end, n)
        self.table._seg[:, start:end] = check_int("set_segment_ label", label)
        return self

    def append_raw_(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor | Sequence[int],
                    segment: int = 0) -> "PositionedKV":
        """Append precomputed slots: kv[layer] = (raw_keys [B|1, H, S, D], values [B|1, H, S, D]) placed at
        `positions` ([S] or [B, S]). Keys are rotated once from raw. This is how stored chunks enter a cache."""
        if len(kv) != len(self.layers):
            fail("append_raw_ kv", f"one (raw_keys, values) pair per layer ({len(self.layers)})", len(kv))
        n = self._check_idle("append_raw_")
        k0 = kv[0][0]
        if k0.dim() != 4:
            fail("append_raw_ kv[0] raw_keys", "[B, H, S, D]", tuple(k0.shape))
        S = k0.shape[2]
        B = self.table.batch_size if self.table.batch_size > 0 else k0.shape[0]
        for i, ((k, v), l) in enumerate(zip(kv, self.layers)):
            if k.dim() != 4 or v.dim() != 4 or k.shape[2] != S or v.shape[2] != S or k.shape[0] not in (1, B):
                fail(f"append_raw_ kv[{i}]", f"raw_keys/values [B={B}, H, S={S}, D]",
                     f"{tuple(k.shape)} / {tuple(v.shape)}")
            if l.rot_k is not None and (k.shape[1] != l.rot_k.shape[1] or k.shape[3] != l.rot_k.shape[3]):
                fail(f"append_raw_ kv[{i}]", f"H={l.rot_k.shape[1]}, D={l.rot_k.shape[3]}", tuple(k.shape))
            if k.shape[-1] != l.spec.head_dim:
                fail(f"append_raw_ kv[{i}]", f"head_dim {l.spec.head_dim}", tuple(k.shape))
        dev = k0.device if self.table._pos is None else self.table._pos.device
        pos = as_positions("append_raw_ positions", positions, B, S, dev)
        self._check_spec_limits(pos, "append_raw_ positions")
        # validated: from here on nothing can fail except allocation
        sl = slice(n, n + S)
        for l, (k, v) in zip(self.layers, kv):
            like = k.expand(B, -1, -1, -1)
            if l.rot_k is None:
                l.reserve(like, v.expand(B, -1, -1, -1), n + S)
            else:
                l.reserve(l.rot_k[:, :, :0], l.v[:, :, :0], n + S)
            l.raw_k[:, :, sl] = k
            l.v[:, :, sl] = v
        for spec, idx in self._specs().values():
            layers = [self.layers[i] for i in idx]
            cos, sin = cos_sin(pos, spec, device=layers[0].rot_k.device)
            _apply_many([l.raw_k[:, :, sl] for l in layers], [l.rot_k[:, :, sl] for l in layers],
                        cos[:, None], sin[:, None], spec)
        for l in self.layers:
            l.n = n + S
        self.table.append(pos, segment=segment)
        return self

    def reserve_(self, slots: int) -> "PositionedKV":
        """Grow every buffer to hold at least `slots` slots (avoids regrowth while composing a large cache)."""
        slots = check_int("reserve_ slots", slots)
        for l in self.layers:
            if l.rot_k is not None:
                l.reserve(l.rot_k[:, :, :0], l.v[:, :, :0], slots)
        if self.table._pos is not None:
            self.table._reserve(self.table.batch_size, slots, self.table._pos.device)
        return self

    # -- transformers generate protocol (batch / beam / assisted decoding) -----------------------------------------
    def crop(self, max_length: int) -> None:
        """Drop slots from the end: crop(-k) removes k slots, crop(0) does nothing, crop(n > 0) keeps the first n
        (the legacy transformers meaning)."""
        n = self.table.n
        max_length = check_int("crop max_length", max_length)
        if max_length == 0:
            return
        keep = n + max_length if max_length < 0 else min(max_length, n)
        if keep < 0:
            fail("crop", f"at most {n} slots removed", -max_length)
        for l in self.layers:
            l.n = min(l.n, keep)
        self.table.truncate(min(self.table.n, keep))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder batch rows for beam search."""
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(torch.as_tensor(indices, dtype=torch.long))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.table.batch_size > 0:
            self._select_rows(torch.arange(self.table.batch_size).repeat_interleave(repeats))

    def _select_rows(self, rows: torch.Tensor) -> None:
        if self.table._pos is None:
            return
        for l in self.layers:
            l.select_rows_(rows)
        self.table.select_rows_(rows)

    def reset(self) -> None:
        for l in self.layers:
            l.clear()
        self.table = SlotTable()


def _common_specs(caches: Iterable[PositionedKV]) -> None:
    caches = list(caches)
    ref = caches[0]
    for j, c in enumerate(caches[1:], 1):
        if len(c.layers) != len(ref.layers):
            fail(f"concat caches[{j}]", f"{len(ref.layers)} layers", len(c.layers))
        for i, (a, b) in enumerate(zip(ref.layers, c.layers)):
            if a.spec.key() != b.spec.key():
                fail(f"concat caches[{j}] layer {i}", "the same RoPE spec as caches[0]", b.spec.describe())
