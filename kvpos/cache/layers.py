"""The storages of one layer, one class per storage behind one interface (`SlotLayer`):

    RawSlotLayer      storage="raw"      raw keys + values; attention reads keys rotated on read
    RotatedSlotLayer  storage="rotated"  raw keys + rotated keys + values; attention reads the rotated keys
    QuantSlotLayer    storage="int8"     int8 key / value codes + scales (kvpos.cache.layers_int8)

What differs between storages is a method of the class (what attention reads after a write, what a fused reader
is handed, where rotate-on-read takes its raw keys, what an overwrite saves); what a storage can do at all is its
`mode` (kvpos.cache.storages.StorageMode). `layer_class(mode)` is the one place a mode picks its class."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from .._checks import fail
from ..rope import RopeSpec
from .buffers import _OVERFLOW, _alloc, _dynamic_capacity, _grown, _grown_tight, _regrow, _sized, _static_buffer
from .storages import RAW, ROTATED, StorageMode

if TYPE_CHECKING:
    from .kv import PositionedKV
    from .reads import _ReadState

__all__ = ["SlotLayer", "RawSlotLayer", "RotatedSlotLayer", "layer_class"]


class SlotLayer:
    """One layer's storage, first `n` of capacity C slots valid: raw_k [B, H, C, D] keys before RoPE and
    v [B, H, C, Dv] values (the raw storage's buffers; subclasses add or replace buffers). The interface every
    storage class implements; `mode` names the storage and its capabilities."""

    mode: StorageMode = RAW

    def __init__(self, spec: RopeSpec, raw_dtype: torch.dtype | None = None, fixed: int | None = None) -> None:
        self.spec = spec
        self.raw_dtype = raw_dtype
        self.storage = self.mode.name
        self.fixed = fixed          # a fixed capacity C (buffers allocated once, zero-filled, never regrown), or None
        self.raw_k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.key_dtype: torch.dtype | None = None    # dtype of the keys attention reads (the model's)
        self.n = 0
        self.room = 0               # slots the first allocation makes room for at least (reserve_ before any slot)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return ("raw_k", "v")

    def buffers(self) -> list[torch.Tensor | None]:
        return [getattr(self, n) for n in self.buffer_names]

    def set_buffers(self, bufs: Sequence[torch.Tensor | None]) -> None:
        for n, b in zip(self.buffer_names, bufs):
            setattr(self, n, b)

    @property
    def key_store(self) -> torch.Tensor | None:
        """The [B, H, C, D] buffer holding the keys as stored (raw keys; int8: their codes)."""
        return self.raw_k

    @property
    def value_store(self) -> torch.Tensor | None:
        """The [B, H, C, Dv] buffer holding the values as stored (int8: their codes)."""
        return self.v

    @property
    def allocated(self) -> bool:
        return self.value_store is not None

    @property
    def heads(self) -> int:
        """H, the layer's kv heads (allocated layers)."""
        return self.value_store.shape[1]

    @property
    def value_dim(self) -> int:
        """Dv, the values' head size (allocated layers)."""
        return self.value_store.shape[3]

    @property
    def slot_device(self) -> torch.device:
        """Where the layer's buffers are (allocated layers)."""
        return self.value_store.device

    # -- views ---------------------------------------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        """[B, H, T, D] keys rotated to their current positions: only storage="rotated" holds them; other storages
        have no positions per layer: read `PositionedKV.layer_keys(i)` (rotated on read)."""
        fail("SlotLayer.keys", "storage='rotated'", f"storage={self.storage!r}",
             "read PositionedKV.layer_keys(layer) (rotated on read)")

    @property
    def values(self) -> torch.Tensor | None:
        """[B, H, T, Dv] values (int8: dequantized, a new tensor)."""
        return self.valid_values()

    @property
    def raw_keys(self) -> torch.Tensor | None:
        """[B, H, T, D] keys before RoPE (int8: dequantized, a new tensor)."""
        return self.valid_raw_keys()

    def valid_values(self) -> torch.Tensor | None:
        """The `values` property as a method (what protocol subclasses overriding the property call)."""
        return None if self.v is None else self.v[:, :, : self.n]

    def valid_raw_keys(self) -> torch.Tensor | None:
        """The `raw_keys` property as a method."""
        return None if self.raw_k is None else self.raw_k[:, :, : self.n]

    @property
    def capacity(self) -> int:
        return 0 if self.value_store is None else self.value_store.shape[2] - (_OVERFLOW if self.fixed else 0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers() if t is not None)

    # -- growth --------------------------------------------------------------------------------------------------
    def _cap(self, old: int, need: int) -> int:
        return _sized(self.fixed, old, need, _grown_tight)

    def _new_buffers(self, like_k: torch.Tensor, like_v: torch.Tensor, cap: int, fill: float | None) -> dict:
        """The storage's buffers for `cap` slots, by name (unmarked)."""
        B, H, _, D = like_k.shape
        raw = _alloc((B, H, cap, D), like_k.dtype if self.raw_dtype is None else self.raw_dtype, like_k.device, fill)
        return {"raw_k": raw, "v": _alloc((B, H, cap, like_v.shape[-1]), like_v.dtype, like_v.device, fill)}

    def reserve(self, like_k: torch.Tensor, like_v: torch.Tensor, need: int) -> None:
        """Make room for `need` slots (copies only the valid prefix; all-or-nothing)."""
        if self.v is None:
            cap = self._cap(0, max(need, self.room)) + (_OVERFLOW if self.fixed else 0)
            fill = 0 if self.fixed else None       # fixed: attention reads every slot (masked): never garbage
            mark = _static_buffer if self.fixed else (lambda t: _dynamic_capacity(t, 2))
            for name, t in self._new_buffers(like_k, like_v, cap, fill).items():
                setattr(self, name, mark(t))
            self.key_dtype = like_k.dtype
            return
        if need <= self.capacity:
            return
        self.set_buffers(_regrow(self.buffers(), 2, self._cap(self.capacity, need), self.n))

    def shrink_(self, cap: int) -> None:
        if self.v is not None and cap < self.capacity and self.fixed is None:
            self.set_buffers(_regrow(self.buffers(), 2, cap, self.n))

    def _write_slots(self, where: slice | torch.Tensor, k_rot: torch.Tensor | None, v: torch.Tensor,
                     k_raw: torch.Tensor) -> None:
        """Write keys / values [B, H, S, D] at slots `where` (a slice, or an index the compiler keeps in place)."""
        if isinstance(where, slice):
            self.raw_k[:, :, where] = k_raw
            self.v[:, :, where] = v
        else:
            self.raw_k.index_copy_(2, where, k_raw.to(self.raw_k.dtype))
            self.v.index_copy_(2, where, v)

    def _like_keys(self, k_rot: torch.Tensor | None, k_raw: torch.Tensor) -> torch.Tensor:
        """The keys whose dtype attention reads (the first allocation takes it)."""
        return k_raw

    def append(self, k_rot: torch.Tensor | None, v: torch.Tensor, k_raw: torch.Tensor) -> None:
        """Write S new slots after the valid ones. k_rot/k_raw/v: [B, H, S, D] (k_rot: the engine's rotated keys,
        kept by storages that store them)."""
        S = k_raw.shape[2]
        self.reserve(self._like_keys(k_rot, k_raw), v, self.n + S)
        if torch.compiler.is_compiling():
            # an index write the compiler keeps in place (a slice assignment at a symbolic offset into a graph input
            # can be functionalised into a copy of the whole buffer)
            self._write_slots(torch.arange(S, device=v.device) + self.n, k_rot, v, k_raw)
        else:
            self._write_slots(slice(self.n, self.n + S), k_rot, v, k_raw)
        self.n += S

    def write_at(self, idx: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor) -> None:
        """Fixed capacity, inside a compiled forward: write S slots' rotated keys and values at slot index idx [S]
        (what StaticCache writes). Only storages that keep rotated keys serve it."""
        fail(f"PositionedKV(storage={self.storage!r}) under torch.compile with a fixed capacity", "storage='rotated'",
             repr(self.storage))

    # -- what attention reads --------------------------------------------------------------------------------------
    def attended(self, kv: "PositionedKV", index: int, n0: int, k_rot: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) attention reads right after a forward wrote slots [n0, n) of this layer (index `index` of
        `kv`): raw storage rotates the older slots on read and copies the engine's own rotated keys `k_rot` in."""
        return kv.rotate_on_read(index, (n0, k_rot)), self.values_on_read(kv.read_state(), (n0, v))

    def read_keys(self, kv: "PositionedKV", index: int) -> torch.Tensor:
        """[B, H, T, D] keys at their current positions (rotated on read into the forward's scratch buffer)."""
        return kv.rotate_on_read(index)

    def holds(self, index: int, keys: torch.Tensor, last_read: tuple[int, int] | None) -> bool:
        """Whether `keys` are what this layer (layer `index` of its cache) handed attention; `last_read`: the
        cache's last rotate-on-read, (layer index, data pointer)."""
        return last_read == (index, keys.data_ptr())

    def handed_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [B, H, T, D] as stored, for a reader that rotates on read itself (a fused kernel)."""
        return self.raw_k[:, :, : self.n], self.v[:, :, : self.n]

    def raw_source(self, upto: int) -> torch.Tensor:
        """Raw keys [B, H, upto, D] of slots [0, upto) for rotate-on-read (views where the storage holds them)."""
        return self.raw_k[:, :, :upto]

    def values_on_read(self, state: "_ReadState", fresh: tuple[Any, torch.Tensor] | None = None) -> torch.Tensor:
        """[B, H, T, Dv] values as attention reads them (the stored ones; int8 dequantizes into `state`)."""
        return self.values

    # -- overwrites (recompute forwards) ---------------------------------------------------------------------------
    def saved_slots(self, idx: torch.Tensor) -> tuple:
        """Copies of what slots idx [S] hold, for `restore_slots_`."""
        return self.raw_k[:, :, idx].clone(), self.v[:, :, idx].clone()

    def overwrite_slots_(self, idx: torch.Tensor, k_rot: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> None:
        """Replace slots idx [S] with new keys / values [B, H, S, D]."""
        self.raw_k[:, :, idx] = k_raw.to(self.raw_k.dtype)
        self.v[:, :, idx] = v.to(self.v.dtype)

    def restore_slots_(self, idx: torch.Tensor, saved: tuple) -> None:
        self.raw_k[:, :, idx], self.v[:, :, idx] = saved

    def overwritten(self, kv: "PositionedKV", index: int, idx: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
        """[B, H, T, D] keys attention reads after a recompute forward rewrote slots idx [S] with the engine's
        rotated keys k_rot [B, H, S, D] (copied in as they are)."""
        return kv.rotate_on_read(index, (idx, k_rot))

    # -- slot and row operations -----------------------------------------------------------------------------------
    def select_(self, idx: torch.Tensor) -> None:
        """Keep slots idx (1-D long) in that order, compacting them to the front."""
        for buf in self.buffers():
            buf[:, :, : idx.numel()] = buf[:, :, idx]
        self.n = idx.numel()

    def select_rows_(self, rows: torch.Tensor) -> None:
        """Batch rows `rows` (new tensors: the old buffers are left as they were)."""
        if self.allocated:
            self.set_buffers([b[rows.to(b.device)] for b in self.buffers()])

    def clear(self) -> None:
        self.set_buffers([None] * len(self.buffer_names))
        self.key_dtype = None
        self.n = 0

    # -- what the cache's transactional operations use (overridden by quantized storage) ----------------------------
    def mark(self) -> object:
        """A rollback point for appends (slots are only ever written after the valid ones)."""
        return self.n

    def restore(self, mark: object) -> None:
        self.n = mark

    def snapshot(self) -> tuple:
        """Buffers, dtype and mark: everything `restore_snapshot` needs to undo appends, growth and row changes."""
        return list(self.buffers()), self.key_dtype, self.mark()

    def restore_snapshot(self, snap: tuple) -> None:
        bufs, self.key_dtype, mark = snap
        self.set_buffers(bufs)
        self.restore(mark)

    def truncate(self, n: int) -> None:
        """Forget every slot from `n` on."""
        self.n = min(self.n, n)

    def unshare_(self) -> None:
        """Copy-on-write: new buffers holding the valid slots (same capacity), so that a snapshot taken before keeps
        the old ones intact whatever is written next."""
        if self.allocated:
            self.set_buffers(_regrow(self.buffers(), 2, self.capacity, self.n, self.fixed is not None))

    def raw_slots(self, start: int, end: int, copy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw keys, values) [B, H, end - start, D] of slots [start, end): views (copies with `copy`)."""
        k, v = self.raw_k[:, :, start:end], self.v[:, :, start:end]
        return (k.clone(), v.clone()) if copy else (k, v)

    def copy_into(self, other: "SlotLayer", cap: int, fixed: bool) -> None:
        """Give `other` (an empty layer of the same kind) a copy of the valid slots, capacity `cap`."""
        other.set_buffers(_regrow(self.buffers(), 2, cap, self.n, fixed))
        other.key_dtype, other.n = self.key_dtype, self.n


class RawSlotLayer(SlotLayer):
    """storage="raw": raw keys + values only (the size of a plain cache); attention reads keys rotated on read
    (`PositionedKV.layer_keys`), a position change touches only the slot table."""

    mode = RAW


class RotatedSlotLayer(SlotLayer):
    """storage="rotated": raw_k, rot_k, v [B, H, C, D]; attention reads rot_k (views), a position change re-rotates
    the moved slots from raw_k (never a chain of delta rotations)."""

    mode = ROTATED

    def __init__(self, spec: RopeSpec, raw_dtype: torch.dtype | None = None, fixed: int | None = None) -> None:
        SlotLayer.__init__(self, spec, raw_dtype, fixed)
        self.rot_k: torch.Tensor | None = None

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return ("rot_k", "raw_k", "v")

    @property
    def keys(self) -> torch.Tensor | None:
        """[B, H, T, D] keys rotated to their current positions (a view of rot_k)."""
        return None if self.rot_k is None else self.rot_k[:, :, : self.n]

    def _cap(self, old: int, need: int) -> int:
        return _sized(self.fixed, old, need, _grown)

    def _like_keys(self, k_rot: torch.Tensor | None, k_raw: torch.Tensor) -> torch.Tensor:
        return k_rot

    def _new_buffers(self, like_k: torch.Tensor, like_v: torch.Tensor, cap: int, fill: float | None) -> dict:
        bufs = SlotLayer._new_buffers(self, like_k, like_v, cap, fill)
        B, H, _, D = like_k.shape
        return {"rot_k": _alloc((B, H, cap, D), like_k.dtype, like_k.device, fill), **bufs}

    def _write_slots(self, where: slice | torch.Tensor, k_rot: torch.Tensor | None, v: torch.Tensor,
                     k_raw: torch.Tensor) -> None:
        if isinstance(where, slice):
            self.rot_k[:, :, where] = k_rot
        else:
            self.rot_k.index_copy_(2, where, k_rot)
        SlotLayer._write_slots(self, where, k_rot, v, k_raw)

    def write_at(self, idx: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor) -> None:
        """Fixed capacity, inside a compiled forward: write S slots' rotated keys and values at slot index idx [S]
        (what StaticCache writes; the raw keys are derived from them when the count is next synced eagerly).
        k_rot/v: [B, H, S, D]."""
        if self.v is None:
            self.reserve(k_rot, v, k_rot.shape[2])
        self.rot_k.index_copy_(2, idx, k_rot)
        self.v.index_copy_(2, idx, v)

    def attended(self, kv: "PositionedKV", index: int, n0: int, k_rot: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the stored rotated keys and values (fixed capacity: every slot, static shapes; the mask hides
        the unused ones)."""
        end = self.fixed if self.fixed is not None else self.n
        return self.rot_k[:, :, :end], self.v[:, :, :end]

    def read_keys(self, kv: "PositionedKV", index: int) -> torch.Tensor:
        return self.rot_k[:, :, : self.n]

    def holds(self, index: int, keys: torch.Tensor, last_read: tuple[int, int] | None) -> bool:
        return keys.data_ptr() == self.rot_k.data_ptr()

    def handed_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        fail("handing raw keys to attention", "storage='raw' or 'int8' (raw keys rotated on read)",
             "storage='rotated' (attention reads the stored rotated keys)")

    def saved_slots(self, idx: torch.Tensor) -> tuple:
        return (self.rot_k[:, :, idx].clone(),) + SlotLayer.saved_slots(self, idx)

    def overwrite_slots_(self, idx: torch.Tensor, k_rot: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> None:
        self.rot_k[:, :, idx] = k_rot.to(self.rot_k.dtype)
        SlotLayer.overwrite_slots_(self, idx, k_rot, k_raw, v)

    def restore_slots_(self, idx: torch.Tensor, saved: tuple) -> None:
        self.rot_k[:, :, idx] = saved[0]
        SlotLayer.restore_slots_(self, idx, saved[1:])

    def overwritten(self, kv: "PositionedKV", index: int, idx: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
        return self.rot_k[:, :, : self.n]


def layer_class(mode: StorageMode) -> type[SlotLayer]:
    """The storage class of `mode` (kvpos.cache.storages): the one place a mode picks its class."""
    from .layers_int8 import QuantSlotLayer

    for cls in (RotatedSlotLayer, RawSlotLayer, QuantSlotLayer):
        if cls.mode is mode:
            return cls
    fail("layer_class mode", "a StorageMode of kvpos.cache.storages", repr(mode))
