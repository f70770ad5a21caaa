"""The storages of one layer: SlotLayer (rotated: raw + rotated keys + values; raw: raw keys + values) and
QuantSlotLayer (int8 codes with per-channel scales over GROUP-slot groups)."""
from __future__ import annotations

from typing import Sequence

import torch

from .._checks import fail
from ..quant import GROUP, dequantize_keys, dequantize_values, quantize_key_groups, quantize_values
from .storages import storage_mode
from ..rope import RopeSpec
from .buffers import _OVERFLOW, _alloc, _dynamic_capacity, _grown, _grown_tight, _regrow, _sized, _static_buffer


class SlotLayer:
    """One layer's storage, first `n` of capacity C slots valid:

    storage="rotated": raw_k, rot_k, v [B, H, C, D] (attention reads rot_k; a position change re-rotates moved slots)
    storage="raw":     raw_k, v only; attention reads keys rotated on read (`PositionedKV.layer_keys`), a position
                       change touches only the slot table."""

    def __init__(self, spec: RopeSpec, raw_dtype: torch.dtype | None = None, storage: str = "rotated",
                 fixed: int | None = None) -> None:
        self.spec = spec
        self.raw_dtype = raw_dtype
        self.mode = storage_mode(storage, "SlotLayer storage")
        self.storage = self.mode.name
        self.fixed = fixed          # a fixed capacity C (buffers allocated once, zero-filled, never regrown), or None
        self.raw_k: torch.Tensor | None = None
        self.rot_k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.key_dtype: torch.dtype | None = None    # dtype of the keys attention reads (the model's)
        self.n = 0
        self.room = 0               # slots the first allocation makes room for at least (reserve_ before any slot)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return ("rot_k", "raw_k", "v") if self.mode.keeps_rotated else ("raw_k", "v")

    def buffers(self) -> list[torch.Tensor | None]:
        return [getattr(self, n) for n in self.buffer_names]

    def set_buffers(self, bufs: Sequence[torch.Tensor | None]) -> None:
        for n, b in zip(self.buffer_names, bufs):
            setattr(self, n, b)

    @property
    def allocated(self) -> bool:
        return self.v is not None

    # -- views ---------------------------------------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        """[B, H, T, D] keys rotated to their current positions: a view of rot_k (storage="rotated"); with
        storage="raw" a layer cannot rotate alone (it has no positions): read `PositionedKV.layer_keys(i)`."""
        if not self.mode.keeps_rotated:
            fail("SlotLayer.keys", "storage='rotated'", f"storage={self.storage!r}",
                 "read PositionedKV.layer_keys(layer) (rotated on read)")
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
        return 0 if self.v is None else self.v.shape[2] - (_OVERFLOW if self.fixed else 0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers() if t is not None)

    # -- growth --------------------------------------------------------------------------------------------------
    def _cap(self, old: int, need: int) -> int:
        return _sized(self.fixed, old, need, _grown if self.mode.keeps_rotated else _grown_tight)

    def reserve(self, like_k: torch.Tensor, like_v: torch.Tensor, need: int) -> None:
        """Make room for `need` slots (copies only the valid prefix; all-or-nothing)."""
        if self.v is None:
            B, H, _, D = like_k.shape
            cap = self._cap(0, max(need, self.room)) + (_OVERFLOW if self.fixed else 0)
            fill = 0 if self.fixed else None       # fixed: attention reads every slot (masked): never garbage
            raw = _alloc((B, H, cap, D), like_k.dtype if self.raw_dtype is None else self.raw_dtype, like_k.device,
                         fill)
            v = _alloc((B, H, cap, like_v.shape[-1]), like_v.dtype, like_v.device, fill)
            rot = _alloc((B, H, cap, D), like_k.dtype, like_k.device, fill) if self.mode.keeps_rotated else None
            mark = _static_buffer if self.fixed else (lambda t: _dynamic_capacity(t, 2))
            rot, raw, v = (None if t is None else mark(t) for t in (rot, raw, v))
            self.rot_k, self.raw_k, self.v, self.key_dtype = rot, raw, v, like_k.dtype
            return
        if need <= self.capacity:
            return
        self.set_buffers(_regrow(self.buffers(), 2, self._cap(self.capacity, need), self.n))

    def shrink_(self, cap: int) -> None:
        if self.v is not None and cap < self.capacity and self.fixed is None:
            self.set_buffers(_regrow(self.buffers(), 2, cap, self.n))

    def append(self, k_rot: torch.Tensor | None, v: torch.Tensor, k_raw: torch.Tensor) -> None:
        """Write S new slots after the valid ones. k_rot/k_raw/v: [B, H, S, D] (k_rot unused with storage="raw")."""
        S = k_raw.shape[2]
        self.reserve(k_raw if k_rot is None else k_rot, v, self.n + S)
        if torch.compiler.is_compiling():
            # an index write the compiler keeps in place (a slice assignment at a symbolic offset into a graph input
            # can be functionalised into a copy of the whole buffer)
            idx = torch.arange(S, device=v.device) + self.n
            if self.mode.keeps_rotated:
                self.rot_k.index_copy_(2, idx, k_rot)
            self.raw_k.index_copy_(2, idx, k_raw.to(self.raw_k.dtype))
            self.v.index_copy_(2, idx, v)
        else:
            sl = slice(self.n, self.n + S)
            if self.mode.keeps_rotated:
                self.rot_k[:, :, sl] = k_rot
            self.raw_k[:, :, sl] = k_raw
            self.v[:, :, sl] = v
        self.n += S

    def write_at(self, idx: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor) -> None:
        """Fixed capacity, inside a compiled forward: write S slots' rotated keys and values at slot index idx [S]
        (what StaticCache writes; the raw keys are derived from them when the count is next synced eagerly).
        k_rot/v: [B, H, S, D]."""
        if self.v is None:
            self.reserve(k_rot, v, k_rot.shape[2])
        self.rot_k.index_copy_(2, idx, k_rot)
        self.v.index_copy_(2, idx, v)

    def select_(self, idx: torch.Tensor) -> None:
        """Keep slots idx (1-D long) in that order, compacting them to the front."""
        for buf in self.buffers():
            buf[:, :, : idx.numel()] = buf[:, :, idx]
        self.n = idx.numel()

    def select_rows_(self, rows: torch.Tensor) -> None:
        """Batch rows `rows` (new tensors: the old buffers are left as they were)."""
        if self.v is not None:
            self.set_buffers([b[rows.to(b.device)] for b in self.buffers()])

    def clear(self) -> None:
        self.raw_k = self.rot_k = self.v = None
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
        if self.v is not None:
            self.set_buffers(_regrow(self.buffers(), 2, self.capacity, self.n, self.fixed is not None))

    def read_raw(self, start: int, end: int, copy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw keys, values) [B, H, end - start, D] of slots [start, end): views (copies with `copy`)."""
        k, v = self.raw_k[:, :, start:end], self.v[:, :, start:end]
        return (k.clone(), v.clone()) if copy else (k, v)

    def copy_into(self, other: "SlotLayer", cap: int, fixed: bool) -> None:
        """Give `other` (an empty layer of the same kind) a copy of the valid slots, capacity `cap`."""
        other.set_buffers(_regrow(self.buffers(), 2, cap, self.n, fixed))
        other.key_dtype, other.n = self.key_dtype, self.n


class QuantSlotLayer(SlotLayer):
    """storage="int8": one layer's raw keys and values in int8 (`kvpos.quant`), the first `n` of C slots valid.

        raw_k [B, H, C, D] int8   key codes of the sealed slots [0, q): per channel over groups of GROUP tokens
        rows  [C] int32           each sealed slot's scale row in ks
        ks    [B, H, R, D]        key scales (the keys' dtype); rows [0, nrows) in use
        v     [B, H, C, Dv] int8  value codes of the sealed slots, vs [B, H, C, 1] their per-token scales
        kt, vt [B, H, GROUP, D]   the tail: keys and values of slots [q, n) unquantized (n - q <= GROUP), like
                                  KIVI's residual; a group is sealed from it when a write would leave more than
                                  GROUP there, so the newest GROUP tokens or fewer are always exact

    A write never changes what an earlier state reads (scale rows go after the used ones, codes after the sealed
    slots, sealing takes new tail tensors), so buffer references plus counts are a complete rollback point. Deleting
    or reordering slots moves codes and row numbers only; the tail stays a tail when its kept slots stay the last
    ones in order, else it is sealed first as one (shorter) group."""

    def __init__(self, spec: RopeSpec, raw_dtype: torch.dtype | None = None, storage: str = "int8",
                 fixed: int | None = None) -> None:
        SlotLayer.__init__(self, spec, None, storage, None)
        self.rows: torch.Tensor | None = None
        self.ks: torch.Tensor | None = None
        self.vs: torch.Tensor | None = None
        self.kt: torch.Tensor | None = None
        self.vt: torch.Tensor | None = None
        self.q = 0
        self.nrows = 0

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return ("raw_k", "v", "vs", "rows", "ks", "kt", "vt")

    @property
    def raw_keys(self) -> torch.Tensor | None:
        """[B, H, T, D] keys before RoPE, dequantized (a new tensor)."""
        return None if self.v is None else self.dequant_keys(0, self.n)

    @property
    def values(self) -> torch.Tensor | None:
        """[B, H, T, Dv] values, dequantized (a new tensor)."""
        return None if self.v is None else self.dequant_values(0, self.n)

    def _new_tails(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, _, D = self.raw_k.shape
        dev = self.raw_k.device
        return (_alloc((B, H, GROUP, D), self.key_dtype, dev), _alloc((B, H, GROUP, self.v.shape[3]),
                                                                     self.key_dtype, dev))

    def reserve(self, like_k: torch.Tensor, like_v: torch.Tensor, need: int) -> None:
        if self.v is None:
            B, H, _, D = like_k.shape
            cap, kd, dev = _grown_tight(0, max(need, self.room)), like_k.dtype, like_k.device
            raw_k = _alloc((B, H, cap, D), torch.int8, dev)
            v = _alloc((B, H, cap, like_v.shape[-1]), torch.int8, dev)
            vs = _alloc((B, H, cap, 1), kd, dev)
            rows = _alloc((cap,), torch.int32, dev)
            ks = _alloc((B, H, max(4, cap // GROUP + 2), D), kd, dev)
            self.raw_k, self.v, self.vs, self.rows, self.ks, self.key_dtype = raw_k, v, vs, rows, ks, kd
            self.kt, self.vt = self._new_tails()
            return
        if need > self.capacity:
            self._regrow_slots(_grown_tight(self.capacity, need))

    def _regrow_slots(self, cap: int) -> None:
        a = _regrow([self.raw_k, self.v, self.vs], 2, cap, self.q)
        r = _regrow([self.rows], 0, cap, self.q)
        self.raw_k, self.v, self.vs, self.rows = a[0], a[1], a[2], r[0]

    def shrink_(self, cap: int) -> None:
        if self.v is not None and cap < self.capacity:
            self._regrow_slots(max(cap, self.n))

    def _ensure_rows(self, need: int) -> None:
        if need > self.ks.shape[2]:
            self.ks = _regrow([self.ks], 2, max(need, 2 * self.ks.shape[2]), self.nrows)[0]

    def _seal_(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize keys / values [B, H, m, D] as the slots [q, q + m): key groups of GROUP (the last may be shorter)
        in new scale rows, values per token."""
        m = keys.shape[2]
        groups = -(-m // GROUP)
        codes, scales = quantize_key_groups(keys, GROUP)
        vc, vsc = quantize_values(values)
        self._ensure_rows(self.nrows + groups)
        q = self.q
        self.ks[:, :, self.nrows: self.nrows + groups] = scales
        self.raw_k[:, :, q: q + m], self.v[:, :, q: q + m], self.vs[:, :, q: q + m] = codes, vc, vsc
        self.rows[q: q + m] = (torch.arange(m, device=self.rows.device) // GROUP + self.nrows).int()
        self.nrows += groups
        self.q = q + m

    def append(self, k_rot: torch.Tensor | None, v: torch.Tensor, k_raw: torch.Tensor) -> None:
        """Write S new slots after the valid ones, through the tail (whole groups sealed from it)."""
        if torch.compiler.is_compiling():
            fail("PositionedKV(storage='int8') under torch.compile", "an eager forward", "a compiled one",
                 "use storage='raw' or 'rotated' for compiled decoding")
        S = k_raw.shape[2]
        self.reserve(k_raw, v, self.n + S)
        n, t = self.n, self.n - self.q
        M = t + S
        groups = (M - 1) // GROUP
        if groups == 0:
            self.kt[:, :, t:M], self.vt[:, :, t:M] = k_raw, v
        else:
            m = groups * GROUP
            keys = torch.cat([self.kt[:, :, :t], k_raw.to(self.key_dtype)], 2)
            vals = torch.cat([self.vt[:, :, :t], v.to(self.key_dtype)], 2)
            self._seal_(keys[:, :, :m], vals[:, :, :m])
            kt, vt = self._new_tails()
            kt[:, :, : M - m], vt[:, :, : M - m] = keys[:, :, m:], vals[:, :, m:]
            self.kt, self.vt = kt, vt
        self.n = n + S

    def write_at(self, idx: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor) -> None:
        fail("PositionedKV(storage='int8')", "eager forwards", "a fixed-capacity compiled write")

    def mark(self) -> object:
        return self.n, self.q, self.nrows, self.kt, self.vt

    def restore(self, mark: object) -> None:
        self.n, self.q, self.nrows, self.kt, self.vt = mark

    def truncate(self, n: int) -> None:
        if n >= self.n:
            return
        if n >= self.q:
            self.n = n
        else:       # later seals write codes from slot n on, which an earlier state (a rollback point) still reads:
            self.n = self.q = n               # new slot buffers (copy-on-write), the old ones stay as they were
            self._regrow_slots(self.capacity)
            self.kt, self.vt = self._new_tails()

    def dequant_keys(self, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Raw keys [B, H, end - start, D] of slots [start, end) in the keys' dtype (into `out` if given)."""
        B, H, _, D = self.raw_k.shape
        res = out if out is not None else _alloc((B, H, end - start, D), self.key_dtype, self.raw_k.device)
        a, b = start, min(end, self.q)
        if b > a:
            dequantize_keys(self.raw_k[:, :, a:b], self.rows[a:b], self.ks, self.key_dtype, out=res[:, :, : b - a])
        a = max(start, self.q)
        if end > a:
            res[:, :, a - start:] = self.kt[:, :, a - self.q: end - self.q]
        return res

    def dequant_values(self, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Values [B, H, end - start, Dv] of slots [start, end) in the keys' dtype (into `out` if given)."""
        B, H, _, Dv = self.v.shape
        res = out if out is not None else _alloc((B, H, end - start, Dv), self.key_dtype, self.v.device)
        a, b = start, min(end, self.q)
        if b > a:
            dequantize_values(self.v[:, :, a:b], self.vs[:, :, a:b], self.key_dtype, out=res[:, :, : b - a])
        a = max(start, self.q)
        if end > a:
            res[:, :, a - start:] = self.vt[:, :, a - self.q: end - self.q]
        return res

    def read_raw(self, start: int, end: int, copy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dequant_keys(start, end), self.dequant_values(start, end)

    def _seal_tail_(self) -> None:
        """Seal the whole tail now, as one group of n - q tokens."""
        t = self.n - self.q
        if t:
            self._seal_(self.kt[:, :, :t], self.vt[:, :, :t])
            self.kt, self.vt = self._new_tails()

    def select_(self, idx: torch.Tensor) -> None:
        """Keep slots idx (1-D long) in that order, compacting them (and the scale rows they use) to the front."""
        k = idx.numel()
        in_tail = idx >= self.q
        m = int(in_tail.sum())
        tail_idx = idx[k - m:]
        if m and not (bool(in_tail[k - m:].all()) and bool((tail_idx[1:] > tail_idx[:-1]).all())):
            self._seal_tail_()                      # the kept tail slots move among sealed ones: seal them first
            m, tail_idx = 0, idx[k:]
        sealed = idx[: k - m]
        for buf in (self.raw_k, self.v, self.vs):
            buf[:, :, : k - m] = buf[:, :, sealed]
        rows = self.rows[sealed]
        used = torch.unique(rows)                                   # sorted
        if used.numel() < self.nrows:
            self.ks[:, :, : used.numel()] = self.ks[:, :, used.long()]
            rows = torch.searchsorted(used, rows).int()
            self.nrows = used.numel()
        self.rows[: k - m] = rows
        kt, vt = self._new_tails()
        t_src = (tail_idx - self.q).to(self.kt.device)
        kt[:, :, :m], vt[:, :, :m] = self.kt[:, :, t_src], self.vt[:, :, t_src]
        self.kt, self.vt, self.q, self.n = kt, vt, k - m, k

    def select_rows_(self, rows: torch.Tensor) -> None:
        if self.v is not None:
            r = rows.to(self.v.device)
            self.raw_k, self.v, self.vs, self.ks, self.kt, self.vt = (
                b[r] for b in (self.raw_k, self.v, self.vs, self.ks, self.kt, self.vt))

    def clear(self) -> None:
        SlotLayer.clear(self)
        self.rows = self.ks = self.vs = self.kt = self.vt = None
        self.q = self.nrows = 0

    def copy_into(self, other: "SlotLayer", cap: int, fixed: bool) -> None:
        other.raw_k, other.v, other.vs = _regrow([self.raw_k, self.v, self.vs], 2, cap, self.q)
        other.rows = _regrow([self.rows], 0, cap, self.q)[0]
        other.ks = _regrow([self.ks], 2, max(self.nrows, 4), self.nrows)[0]
        other.kt, other.vt = self.kt.clone(), self.vt.clone()
        other.key_dtype, other.n, other.q, other.nrows = self.key_dtype, self.n, self.q, self.nrows

    def unshare_(self) -> None:
        if self.v is not None:
            self._regrow_slots(self.capacity)
            self.ks = _regrow([self.ks], 2, self.ks.shape[2], self.nrows)[0]
            self.kt, self.vt = self.kt.clone(), self.vt.clone()
