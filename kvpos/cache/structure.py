"""Structure operations: append stored raw KV, reserve, copy, concat, from_rotated, crop, reorder rows, reset."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from .._checks import as_positions, check_int, check_range, fail
from ..rope import RopeSpec, _apply_many, cos_sin
from .buffers import SEGMENT_RANGE, _grown, _sized

if TYPE_CHECKING:
    from .kv import PositionedKV


class _StructureOps:
    """PositionedKV's structure operations (a mixin: every name it uses is PositionedKV's)."""

    def append_raw_(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor | Sequence[int],
                    segment: int = 0, visible: torch.Tensor | None = None) -> "PositionedKV":
        """Append precomputed slots: kv[layer] = (raw_keys [B|1, H, S, D], values [B|1, H, S, D]) placed at
        `positions` ([S] or [B, S]). Keys are rotated once from raw. This is how stored chunks enter a cache.

        Keys and values must be floating tensors of the cache's dtype (the first append sets it); `segment` labels
        the new slots (an int, or [B, S] int32), `visible` [B, S] bool (default all visible)."""
        n = self.check_idle("append_raw_")
        B, S = self._check_raw_kv("append_raw_ kv", kv)
        dev = kv[0][0].device if self.table._pos is None else self.table._pos.device
        pos = as_positions("append_raw_ positions", positions, B, S, dev)
        self.check_new_positions(pos, "append_raw_ positions")
        if isinstance(segment, torch.Tensor):
            segment = segment.to(torch.int32)
        else:
            segment = check_int("append_raw_ segment", segment)
            if not SEGMENT_RANGE[0] <= segment <= SEGMENT_RANGE[1]:
                fail("append_raw_ segment", "an int32 label", segment)
        if S == 0:
            return self
        # validated: from here on nothing can fail except allocation, which is all-or-nothing per buffer set
        self._reserve_all(n + S, [(k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)) for k, v in kv])
        self.table.reserve(B, n + S, pos.device)
        sl = slice(n, n + S)
        if self.mode.quantized:
            self._append_quantized(kv, B)
        for l, (k, v) in zip(self.layers, kv if not self.mode.quantized else ()):
            l.raw_k[:, :, sl] = k
            l.v[:, :, sl] = v
        for spec, idx in self._groups().values() if self.mode.keeps_rotated else ():
            layers = [self.layers[i] for i in idx]
            cos, sin = cos_sin(pos, spec, device=layers[0].rot_k.device)
            _apply_many([l.raw_k[:, :, sl] for l in layers], [l.rot_k[:, :, sl] for l in layers],
                        cos[:, None], sin[:, None], spec)
        for l in self.layers:
            l.n = n + S
        self.table.append(pos, visible=visible, segment=segment)
        return self

    def _append_quantized(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], B: int) -> None:
        """storage="int8": quantize and append per-layer (raw_keys [B|1, H, S, D], values); all layers or none."""
        snaps = [l.snapshot() for l in self.layers]
        try:
            for l, (k, v) in zip(self.layers, kv):
                l.append(None, v.expand(B, -1, -1, -1), k.expand(B, -1, -1, -1))
        except BaseException:
            for l, snap in zip(self.layers, snaps):
                l.restore_snapshot(snap)
            raise

    def _check_raw_kv(self, what: str, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int]:
        """Validate per-layer (raw_keys, values) against this cache; returns (B, S)."""
        if isinstance(kv, (str, bytes)) or not hasattr(kv, "__len__") or len(kv) != len(self.layers):
            fail(what, f"one (raw_keys, values) pair per layer ({len(self.layers)})",
                 len(kv) if hasattr(kv, "__len__") else type(kv).__name__)
        B0 = self.table.batch_size
        shape0, dtype0 = None, self.dtype
        for i, (pair, l) in enumerate(zip(kv, self.layers)):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(t, torch.Tensor)
                                                                                  for t in pair):
                fail(f"{what}[{i}]", "a (raw_keys, values) pair of tensors", type(pair).__name__, exc=TypeError)
            k, v = pair
            if not k.is_floating_point() or not v.is_floating_point():
                fail(f"{what}[{i}]", "floating keys and values", f"{k.dtype} / {v.dtype}", exc=TypeError)
            want = dtype0 if dtype0 is not None else k.dtype
            if k.dtype != want or v.dtype != want:
                fail(f"{what}[{i}]", f"keys and values in {want} (the cache's dtype)", f"{k.dtype} / {v.dtype}",
                     "convert them first (.to(dtype)); kvpos never casts silently")
            dtype0 = want
            if k.dim() != 4 or v.dim() != 4:
                fail(f"{what}[{i}]", "[B, H, S, D] raw keys and values", f"{tuple(k.shape)} / {tuple(v.shape)}")
            shape0 = shape0 or tuple(k.shape)
            B = B0 if B0 > 0 else max(shape0[0], 1)
            H = l.heads if l.allocated else shape0[1]
            if k.shape[0] not in (1, B) or k.shape[1] != H or k.shape[2] != shape0[2] or k.shape[3] != l.spec.head_dim:
                fail(f"{what}[{i}] raw_keys", f"[B={B}|1, H={H}, S={shape0[2]}, D={l.spec.head_dim}]",
                     tuple(k.shape))
            Dv = l.value_dim if l.allocated else k.shape[3]
            if tuple(v.shape) != (k.shape[0], H, shape0[2], Dv):
                fail(f"{what}[{i}] values", f"[{k.shape[0]}, H={H}, S={shape0[2]}, Dv={Dv}]", tuple(v.shape))
            if l.allocated and k.device != l.slot_device:
                fail(f"{what}[{i}]", f"tensors on {l.slot_device}", str(k.device))
        B = B0 if B0 > 0 else max(shape0[0], 1)
        return B, shape0[2]

    def _reserve_all(self, need: int, like: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Grow every layer to `need` slots; if any allocation fails, no layer changes (all-or-nothing)."""
        before = [l.snapshot() for l in self.layers]
        try:
            for l, (k, v) in zip(self.layers, like):
                if not l.allocated:
                    l.reserve(k, v, need)
                else:
                    l.reserve(l.key_store[:, :, :0], l.value_store[:, :, :0], need)
        except BaseException:
            for l, snap in zip(self.layers, before):
                l.restore_snapshot(snap)
            raise

    def reserve_(self, slots: int) -> "PositionedKV":
        """Grow every buffer to hold at least `slots` slots (avoids regrowth while composing a large cache). On a
        cache with no slot yet (buffers not allocated: their shapes come with the first keys), the first
        allocation makes room for `slots`."""
        slots = check_int("reserve_ slots", slots)
        if slots < 0:
            fail("reserve_ slots", "an int >= 0", slots)
        self.check_idle("reserve_")
        _sized(self.capacity, 0, slots, _grown)              # a fixed-capacity cache refuses more than it holds
        for l in (l for l in self.layers if not l.allocated):
            l.room = max(l.room, slots)
        if self.layers[0].allocated:
            self._reserve_all(slots, [(l.key_store[:, :, :0], l.value_store[:, :, :0]) for l in self.layers])
        if self.table._pos is not None:
            self.table.reserve(self.table.batch_size, slots, self.table._pos.device)
        else:
            self.table.room = max(self.table.room, slots)
        return self

    # -- structure -------------------------------------------------------------------------------------------------
    def empty_like(self) -> "PositionedKV":
        """A new empty cache of the same type with the same RoPE specs (subclasses carry their own settings)."""
        return type(self)(self.specs, self.raw_dtype, self.origin, storage=self.storage, capacity=self.capacity)

    def copy(self, headroom: int = 0) -> "PositionedKV":
        """Deep copy of the valid slots (plus `headroom` free slots of capacity), not the source's whole capacity."""
        n = self.check_idle("copy")
        new = self.empty_like()
        for a, b in zip(self.layers, new.layers):
            if a.allocated:
                a.copy_into(b, self.capacity or max(n + headroom, 1), self.capacity is not None)
            b.n = a.n
        new.table = self.table.copy(headroom)
        return new

    def __deepcopy__(self, memo: dict) -> "PositionedKV":
        return self.copy()

    def append_from_(self, other: "PositionedKV", start: int = 0, end: int | None = None,
                     positions: torch.Tensor | Sequence[int] | None = None, segment: int | None = None
                     ) -> "PositionedKV":
        """Append slots [start, end) of `other` (raw keys re-rotated), at `positions` ([S] / [B, S]) or at their
        own; visibility travels with them, labels too unless `segment` is given. `other` is only read."""
        _common_specs("append_from_", [self, other])
        m = other.check_idle("append_from_ other")
        end = m if end is None else end
        start, end = check_range("append_from_", start, end, m)
        if end == start:
            return self
        pos = other.table.pos[:, start:end] if positions is None else positions
        seg = other.table.segment[:, start:end] if segment is None else segment
        return self.append_raw_([l.raw_slots(start, end) for l in other.layers], pos,
                                segment=seg, visible=other.table.visible[:, start:end])

    @classmethod
    def concat(cls, caches: Sequence["PositionedKV"]) -> "PositionedKV":
        """A new cache holding the slots of `caches` one after the other, each at its own positions."""
        if isinstance(caches, _StructureOps) or not caches:
            fail("concat caches", "a non-empty list of caches", "a cache" if caches else "an empty list")
        _common_specs("concat", caches)
        total = sum(c.num_slots for c in caches)
        out = caches[0].copy(headroom=total - caches[0].num_slots)
        for c in caches[1:]:
            out.append_from_(c)
        return out

    @classmethod
    def from_rotated(cls, specs: Sequence[RopeSpec], kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     positions: torch.Tensor | Sequence[int] | None = None, raw_dtype: torch.dtype | None = None,
                     **kw) -> "PositionedKV":
        """A cache from rotated keys and values per layer ([B, H, T, D] each) at `positions` (default 0..T-1): the
        rotated keys are kept as they are, raw keys come from one un-rotation. The inputs are not modified."""
        out = cls(specs, raw_dtype, **kw)
        if len(kv) != len(out.layers):
            fail("from_rotated kv", f"{len(out.layers)} layers", len(kv))
        if not kv or kv[0][0].shape[2] == 0:
            return out
        k0 = kv[0][0]
        B, T = k0.shape[0], k0.shape[2]
        pos = as_positions("from_rotated positions", torch.arange(T) if positions is None else positions, B, T,
                           k0.device)
        for i, (k, v) in enumerate(kv):
            if k.shape[2] != T:
                fail(f"from_rotated layer {i}", f"{T} cached keys (sliding-window layers keep fewer)", k.shape[2])
            out.write_rotated_(i, k, v, pos)
        return out

    # -- batch rows and cropping (what generate-style loops need) ------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Drop `-tokens_to_remove` slots from the end (all of them if that is more than T); 0 does nothing. A
        positive count is refused, as transformers' DynamicCache refuses it (use keep_ or delete_ instead)."""
        n = self.check_idle("crop")
        k = check_int("crop tokens_to_remove", tokens_to_remove)
        if k > 0:
            fail("crop tokens_to_remove", "a negative count of slots to remove from the end (or 0)", k,
                 "to keep the first n slots use delete_(n, num_slots)")
        keep = max(0, n + k)
        for l in self.layers:
            l.truncate(keep)
        self.table.truncate(keep)
        self._unshare_below(keep)          # later appends write from `keep` on

    def reorder_rows_(self, rows: torch.Tensor | Sequence[int]) -> None:
        """Batch rows become `rows` (1-D indices into the current rows; repeats allowed): beam reordering,
        repetition, selection."""
        self.check_idle("reorder_rows_")
        if not isinstance(rows, torch.Tensor):
            try:
                rows = torch.as_tensor(rows)
            except (TypeError, ValueError, RuntimeError):
                fail("rows", "a non-empty 1-D integer index", type(rows).__name__, exc=TypeError)
        idx = rows
        if idx.dim() != 1 or idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool or idx.numel() == 0:
            fail("rows", "a non-empty 1-D integer index", f"{tuple(idx.shape)} {idx.dtype}")
        if self.table.batch_size < 0:
            return
        idx = idx.long()
        B = self.table.batch_size
        if int(idx.min()) < 0 or int(idx.max()) >= B:
            fail("rows", f"indices in [0, {B})", f"min {int(idx.min())}, max {int(idx.max())}")
        for l in self.layers:
            l.select_rows_(idx)
        self.table.select_rows_(idx)

    def reset(self) -> None:
        """Drop every slot (the RoPE specs stay)."""
        self.running_forward = None
        for l in self.layers:
            l.clear()
        self.table = self._new_table()


def _common_specs(op: str, caches: Iterable[PositionedKV]) -> None:
    """Refuse to mix caches of different layer counts, RoPE specs or dtypes."""
    caches = list(caches)
    ref = caches[0]
    for j, c in enumerate(caches):
        if not isinstance(c, _StructureOps):
            fail(f"{op} caches[{j}]", "a PositionedKV", type(c).__name__, exc=TypeError)
        if len(c.layers) != len(ref.layers):
            fail(f"{op} caches[{j}]", f"{len(ref.layers)} layers", len(c.layers))
        for i, (a, b) in enumerate(zip(ref.layers, c.layers)):
            if a.spec.identity != b.spec.identity:
                fail(f"{op} caches[{j}] layer {i}", "the same RoPE spec as caches[0]", b.spec.describe())
        if ref.origin is not None and c.origin is not None and c.origin != ref.origin:
            fail(f"{op} caches[{j}]", "a cache of the same model as caches[0]", "a cache of another model",
                 "KV from two models cannot share a cache; recompute it with one model")
        if ref.dtype is not None and c.dtype is not None and c.dtype != ref.dtype:
            fail(f"{op} caches[{j}]", f"keys in {ref.dtype} like caches[0]", c.dtype,
                 "convert one of them first; kvpos never casts silently")
