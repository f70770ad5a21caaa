"""The positioned KV cache: per-layer UNROTATED keys + rotated keys + values, and one slot table of positions.

Letters (kvpos glossary): B batch · H kv heads · T cached slots · S new slots · D head_dim · C capacity (>= T).

Storage per layer (buffers grow geometrically, the first T slots are valid):

    raw_k [B, H, C, D]   keys before RoPE (what the model's k_proj produced)   <- the source of truth
    rot_k [B, H, C, D]   raw_k rotated to the slot's *current* position        <- what attention reads
    v     [B, H, C, D]   values (RoPE never touches them)

Slot table, shared by all layers (every layer holds the same slots):

    pos     [B, C] int64  logical position of each slot (per batch row: left padding gives rows different positions)
    visible [B, C] bool   False = hidden (kept in memory, masked out of attention)
    segment [B, C] int32  free label per slot (compose() marks anchor / chunk / query slots with it)

Invariant: rot_k[..., j, :] == rotate(raw_k[..., j, :], pos[j]) for every valid slot j, computed by ONE rotation from
raw_k whenever pos[j] changes (no chains of delta rotations, so no drift). Keys written by an engine's forward keep the
engine's own rotated keys (bit-identical to its plain cache) and get raw_k = unrotate(k, pos).

`PositionedKV` is engine-neutral (torch only). An engine adapter (transformers: kvpos.integrations.hf) feeds a forward
layer by layer through `write_rotated_`; everything else is a position or structure operation between forwards.

Failure semantics: every operation validates its arguments before touching anything, and growth allocates every new
buffer before replacing any, so a failed call leaves the cache as it was. A forward that raises part way (an error
in a later layer, Ctrl-C) is rolled back before the cache is used again. Operations that mutate end in "_".
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch

from ._checks import as_positions, check_int, check_range, check_slot_index, fail
from ._kernels import decode_q8_kernel, decode_raw_kernel
from .quant import GROUP, dequantize_keys, dequantize_values, quantize_key_groups, quantize_values
from .rope import RopeLayout, RopeSpec, _apply, _apply_many, cos_sin

__all__ = ["SlotLayer", "QuantSlotLayer", "SlotTable", "PositionedKV", "GROWTH", "MAX_POSITION", "SEGMENT_RANGE",
           "STORAGES"]

GROWTH = 2.0            # capacity multiplier when a buffer is full
# fixed capacity C: buffers hold C + 1 slots; a compiled forward past C writes into the last one (never a valid
# slot) and then raises, instead of indexing past the buffer in generated code
_OVERFLOW = 1
_MIN_CAPACITY = 64
MAX_POSITION = 2 ** 40  # positions must stay below this (far beyond any RoPE context; keeps int64 math exact)
SEGMENT_RANGE = (-(2 ** 31), 2 ** 31 - 1)   # segment labels are int32


def _grown(old_cap: int, need: int) -> int:
    cap = max(old_cap, _MIN_CAPACITY)
    while cap < need:
        cap = int(math.ceil(cap * GROWTH))
    return cap


def _alloc(shape: Sequence[int], dtype: torch.dtype, device: torch.device, fill: float | bool | None = None
           ) -> torch.Tensor:
    """torch.empty (or full, with `fill`) whose failure is a MemoryError naming the size (torch raises a RuntimeError)."""
    try:
        t = torch.empty(tuple(shape), dtype=dtype, device=device)
        return t if fill is None else t.fill_(fill)
    except (RuntimeError, MemoryError) as e:
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        raise MemoryError(f"cache buffer: expected {n / 2**30:.2f} GiB for shape {list(shape)} {dtype}, got an "
                          f"allocation failure ({type(e).__name__}); the cache is unchanged") from e


def _sized(fixed: int | None, old: int, need: int, grow: Callable[[int, int], int]) -> int:
    """The capacity for `need` slots: `grow(old, need)`, or the fixed capacity (refusing more than it holds)."""
    if fixed is None:
        return grow(old, need)
    if need > fixed:
        fail("fixed-capacity cache", f"at most {fixed} slots (its capacity)", f"{need} slots",
             "build the cache with a larger capacity=, or without capacity= (buffers then grow)")
    return fixed


def _static_buffer(t: torch.Tensor) -> torch.Tensor:
    """Tell torch.compile that a fixed-capacity buffer keeps its address (as transformers' StaticCache does: the
    compiler then treats it like a module buffer, and CUDA graphs can capture it); no effect on eager code."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)
    return t


def _dynamic_capacity(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Tell torch.compile that `t`'s capacity dimension changes (a regrow then reuses the compiled graphs instead of
    specialising on each size); no effect on eager code. Inside a trace the new buffer is already symbolic."""
    if not torch.compiler.is_compiling():
        torch._dynamo.maybe_mark_dynamic(t, dim)
    return t


def _regrow(bufs: Sequence[torch.Tensor], dim: int, cap: int, valid: int, fixed: bool = False) -> list[torch.Tensor]:
    """New buffers of capacity `cap` along `dim` holding the first `valid` entries of each of `bufs` (fixed: a
    fixed-capacity cache's buffers: zeros beyond `valid`, static size under torch.compile).

    All new buffers are allocated before any copy, so an allocation failure leaves the caller's buffers in use."""
    new = []
    for b in bufs:
        shape = list(b.shape)
        shape[dim] = cap + _OVERFLOW if fixed else cap
        new.append(_static_buffer(_alloc(shape, b.dtype, b.device, 0)) if fixed else
                   _dynamic_capacity(_alloc(shape, b.dtype, b.device), dim))
    for b, n in zip(bufs, new):
        n.narrow(dim, 0, valid).copy_(b.narrow(dim, 0, valid))
    return new


class SlotTable:
    """Positions, visibility and segment labels of the cached slots; [B, C] buffers, first `n` valid."""

    def __init__(self, fixed: int | None = None, grow: Callable[[int, int], int] | None = None) -> None:
        self._pos: torch.Tensor | None = None
        self._vis: torch.Tensor | None = None
        self._seg: torch.Tensor | None = None
        self.fixed = fixed          # a fixed capacity (never grows nor shrinks), or None
        # fixed capacity: the slot count also as a 0-d int64 tensor, the one compiled forwards advance (a Python int
        # would specialise or recompile every step); eager code reads `n`, re-synced from it (PositionedKV._sync_count)
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

    def copy(self, headroom: int = 0) -> "SlotTable":
        """A copy holding the valid slots (plus `headroom` free ones), not the whole capacity (a fixed-capacity
        table copies into its fixed capacity)."""
        t = SlotTable(self.fixed, self.grow)
        if self._pos is not None:
            cap = self.fixed or max(self.n + headroom, 1)
            t._pos, t._vis, t._seg = _regrow([self._pos, self._vis, self._seg], 1, cap, self.n, self.fixed is not None)
        t.n = self.n
        return t


STORAGES = ("rotated", "raw", "int8")


def _grown_tight(old_cap: int, need: int) -> int:
    """Capacity for storage="raw": `need` plus a small step (at most ~0.8% slack beyond 2k slots; a regrow copies
    the valid slots once per step, still far less than a cat per token)."""
    return max(old_cap, need + max(16, need // 128)) if need > old_cap else old_cap


class SlotLayer:
    """One layer's storage, first `n` of capacity C slots valid:

    storage="rotated": raw_k, rot_k, v [B, H, C, D] (attention reads rot_k; a position change re-rotates moved slots)
    storage="raw":     raw_k, v only; attention reads keys rotated on read (`PositionedKV.layer_keys`), a position
                       change touches only the slot table."""

    def __init__(self, spec: RopeSpec, raw_dtype: torch.dtype | None = None, storage: str = "rotated",
                 fixed: int | None = None) -> None:
        self.spec = spec
        self.raw_dtype = raw_dtype
        self.storage = storage
        self.fixed = fixed          # a fixed capacity C (buffers allocated once, zero-filled, never regrown), or None
        self.raw_k: torch.Tensor | None = None
        self.rot_k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.key_dtype: torch.dtype | None = None    # dtype of the keys attention reads (the model's)
        self.n = 0
        self.room = 0               # slots the first allocation makes room for at least (reserve_ before any slot)

    @property
    def _names(self) -> tuple[str, ...]:
        return ("rot_k", "raw_k", "v") if self.storage == "rotated" else ("raw_k", "v")

    def buffers(self) -> list[torch.Tensor | None]:
        return [getattr(self, n) for n in self._names]

    def set_buffers(self, bufs: Sequence[torch.Tensor | None]) -> None:
        for n, b in zip(self._names, bufs):
            setattr(self, n, b)

    @property
    def allocated(self) -> bool:
        return self.v is not None

    # -- views ---------------------------------------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        """[B, H, T, D] keys rotated to their current positions: a view of rot_k (storage="rotated"); with
        storage="raw" a layer cannot rotate alone (it has no positions): read `PositionedKV.layer_keys(i)`."""
        if self.storage != "rotated":
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
        return _sized(self.fixed, old, need, _grown if self.storage == "rotated" else _grown_tight)

    def reserve(self, like_k: torch.Tensor, like_v: torch.Tensor, need: int) -> None:
        """Make room for `need` slots (copies only the valid prefix; all-or-nothing)."""
        if self.v is None:
            B, H, _, D = like_k.shape
            cap = self._cap(0, max(need, self.room)) + (_OVERFLOW if self.fixed else 0)
            fill = 0 if self.fixed else None       # fixed: attention reads every slot (masked): never garbage
            raw = _alloc((B, H, cap, D), like_k.dtype if self.raw_dtype is None else self.raw_dtype, like_k.device,
                         fill)
            v = _alloc((B, H, cap, like_v.shape[-1]), like_v.dtype, like_v.device, fill)
            rot = _alloc((B, H, cap, D), like_k.dtype, like_k.device, fill) if self.storage == "rotated" else None
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
            if self.storage == "rotated":
                self.rot_k.index_copy_(2, idx, k_rot)
            self.raw_k.index_copy_(2, idx, k_raw.to(self.raw_k.dtype))
            self.v.index_copy_(2, idx, v)
        else:
            sl = slice(self.n, self.n + S)
            if self.storage == "rotated":
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
    def _names(self) -> tuple[str, ...]:
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


@dataclass
class _Forward:
    """The engine forward being written: slots [n0, n0 + S) at positions pos [B, S]; layers written so far."""

    n0: int
    S: int
    pos: torch.Tensor
    done: set = field(default_factory=set)
    marks: dict = field(default_factory=dict)     # layer index -> its mark before this forward (rollback point)
    unrot: dict = field(default_factory=dict)     # id(spec) -> (cos, -sin) [B, 1, S, R/2]
    read: "_ReadState | None" = None              # storage="raw": this forward's rotate-on-read state
    at: "torch.Tensor | None" = None              # fixed capacity under compile: the slot index [S] of the new slots


@dataclass
class _ReadState:
    """Rotate-on-read state (storage="raw") for one forward: cos/sin of the first `n` slot positions per RoPE spec
    and one scratch buffer that every layer rotates into (the layers run one after the other), dropped with the
    forward so that nothing beyond the raw keys and values stays resident."""

    n: int
    cs: dict = field(default_factory=dict)        # id(spec) -> (cos, sin) [B, 1, n, R/2]; ("scaled", id) [B, n, R/2]
    scratch: dict = field(default_factory=dict)   # (B, H, D, dtype, device) -> [B, H, n, D]

    def cos_sin(self, spec: RopeSpec, pos: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cs = self.cs.get(id(spec))
        if cs is None:
            cos, sin = cos_sin(pos[:, : self.n], spec, device=device)
            cs = self.cs[id(spec)] = (cos[:, None], sin[:, None])
        return cs

    def scaled_cos_sin(self, spec: RopeSpec, pos: torch.Tensor, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, n, R/2] multiplied by the spec's attention scaling: what a fused reader takes (once per
        spec and forward, shared by its layers)."""
        key = ("scaled", id(spec))
        cs = self.cs.get(key)
        if cs is None:
            cos, sin = self.cos_sin(spec, pos, device)
            s = spec.attention_scaling
            cos, sin = cos[:, 0], sin[:, 0]
            cs = self.cs[key] = (cos * s, sin * s) if s != 1.0 else (cos, sin)
        return cs

    def value_buffer(self, layer: "SlotLayer") -> torch.Tensor:
        """[B, H, n, Dv] in the keys' dtype: where storage="int8" dequantizes a layer's values (shared by layers)."""
        B, H, _, Dv = layer.v.shape
        key = ("v", B, H, Dv, layer.key_dtype, layer.v.device)
        buf = self.scratch.get(key)
        if buf is None:
            buf = self.scratch[key] = _alloc((B, H, self.n, Dv), layer.key_dtype, layer.v.device)
        return buf

    def buffer(self, layer: "SlotLayer") -> torch.Tensor:
        B, H, _, D = layer.raw_k.shape
        key = (B, H, D, layer.key_dtype, layer.raw_k.device)
        buf = self.scratch.get(key)
        if buf is None:
            buf = self.scratch[key] = _alloc((B, H, self.n, D), layer.key_dtype, layer.raw_k.device)
        return buf


@dataclass
class _Overwrite:
    """A recompute forward writing into existing slots [S]; the old contents per layer, for rollback."""

    slots: torch.Tensor
    saved: dict = field(default_factory=dict)      # layer index -> (rot, raw, v) of the slots before the write
    pos: torch.Tensor | None = None                # positions of the running recompute forward (first layer's)
    read: "_ReadState | None" = None               # storage="raw": the recompute forward's rotate-on-read state


class PositionedKV:
    """A positioned KV cache: one SlotLayer per model layer sharing one SlotTable, and every position operation.

        kv = PositionedKV(specs)                                   # one RopeSpec per layer
        kv.append_raw_([(raw_k, v), ...], positions)               # stored chunks enter like this
        kv.shift_(0, 10, +500)                                     # keys re-rotated once from raw
        kv.layers[i].keys                                          # [B, H, T, D] what attention reads

    Engine adapters subclass it (kvpos.integrations.hf.PositionedCache adds the transformers Cache protocol) and feed
    forwards through `write_rotated_`.
    """

    def __init__(self, specs: Sequence[RopeSpec], raw_dtype: torch.dtype | None = None, origin: object = None,
                 storage: str = "rotated", capacity: int | None = None) -> None:
        """specs: one RopeSpec per layer; raw_dtype: dtype of the raw keys (default: the keys' own); origin: an opaque
        identity of the model that writes the slots (caches of different origins are never mixed; None = unknown);
        storage: "rotated" (raw + rotated keys + values: attention reads stored keys, 1.5x a plain cache), "raw"
        (raw keys + values only, keys rotated on read into one scratch layer per forward: the size of a plain
        cache; position operations touch only the slot table) or "int8" (like "raw" with keys and values stored
        as int8: `QuantSlotLayer`; approximate, bytes in results/bench_memory.md; no recompute forwards).
        capacity: a fixed capacity in slots (buffers
        allocated once at that size, zero-filled, never regrown; attention receives all `capacity` slots and the
        mask hides the unused ones: static shapes for torch.compile(fullgraph=True), like transformers'
        StaticCache); None (default) grows as needed."""
        if storage not in STORAGES:
            fail(f"{type(self).__name__} storage", " or ".join(repr(x) for x in STORAGES), repr(storage))
        if capacity is not None:
            capacity = check_int(f"{type(self).__name__} capacity", capacity)
            if capacity < 1:
                fail(f"{type(self).__name__} capacity", "None or an int >= 1 (slots)", capacity)
            if storage != "rotated":
                fail(f"{type(self).__name__} capacity", f"None with storage={storage!r} (rotate-on-read has no "
                     "fixed-capacity mode)", capacity, "use storage='rotated' for a fixed-capacity cache")
        if storage == "int8" and raw_dtype is not None:
            fail(f"{type(self).__name__} raw_dtype", "None with storage='int8' (keys are stored as int8 codes)",
                 raw_dtype)
        self.storage = storage
        self.capacity = capacity
        if isinstance(specs, RopeSpec) or not isinstance(specs, (list, tuple)) or not specs:
            fail(f"{type(self).__name__} specs", "a non-empty list with one RopeSpec per layer",
                 type(specs).__name__ if not isinstance(specs, (list, tuple)) else "an empty list", exc=TypeError
                 if not isinstance(specs, (list, tuple)) else ValueError)
        for i, s in enumerate(specs):
            if not isinstance(s, RopeSpec):
                fail(f"{type(self).__name__} specs[{i}]", "a RopeSpec", type(s).__name__, exc=TypeError)
        if raw_dtype is not None and (not isinstance(raw_dtype, torch.dtype) or not raw_dtype.is_floating_point):
            fail(f"{type(self).__name__} raw_dtype", "None or a floating torch.dtype", raw_dtype, exc=TypeError)
        self.raw_dtype = raw_dtype
        self.origin = origin
        self.layers: list[SlotLayer] = [self._new_layer(i, s) for i, s in enumerate(specs)]
        self.table = self._new_table()
        self._forward: _Forward | None = None
        self._overwrite: _Overwrite | None = None
        self._last_read: tuple[int, int] | None = None    # (layer, data pointer) of the last rotate-on-read
        self._handout: _ReadState | None = None           # read state of the last write that handed out raw keys
        self._committed: tuple[int, dict] | None = None     # (n0, layer marks) of the last committed forward
        # slots [0, _shared) are shared with the snapshot of a running appending() block: an in-place write there
        # first copies the buffers (copy-on-write), so that the block's rollback finds them as they were
        self._shared = 0

    def _new_table(self) -> SlotTable:
        return SlotTable(self.capacity, _grown if self.storage == "rotated" else _grown_tight)

    def _new_layer(self, index: int, spec: RopeSpec) -> SlotLayer:
        """The storage object of layer `index` (engine adapters return their protocol subclass)."""
        cls = QuantSlotLayer if self.storage == "int8" else SlotLayer
        return cls(spec, self.raw_dtype, self.storage, self.capacity)

    @property
    def specs(self) -> list[RopeSpec]:
        return [l.spec for l in self.layers]

    # -- reading -------------------------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """T, the number of cached slots (hidden ones included)."""
        self._settle()
        return self.table.n

    @property
    def batch_size(self) -> int:
        """B, or -1 for a cache that never held a slot."""
        self._settle()
        return self.table.batch_size

    @property
    def positions(self) -> torch.Tensor:
        """[B, T] int64 copy of the slot positions."""
        self._settle()
        return self.table.pos.clone()

    @property
    def visible(self) -> torch.Tensor:
        """[B, T] bool copy: False where a slot is hidden."""
        self._settle()
        return self.table.visible.clone()

    @property
    def segments(self) -> torch.Tensor:
        """[B, T] int32 copy of the slot labels."""
        self._settle()
        return self.table.segment.clone()

    @property
    def dtype(self) -> torch.dtype | None:
        """dtype of the keys attention reads (None before the first slot)."""
        return self.layers[0].key_dtype

    def next_position(self) -> torch.Tensor:
        """[B] int64: one past the largest position of a visible slot per row (0 for an empty row)."""
        self._settle()
        t = self.table
        if t.n == 0:
            return torch.zeros(max(t.batch_size, 1), dtype=torch.long)
        p = t.pos.masked_fill(~t.visible, -1)
        return p.max(dim=1).values + 1

    def attention_mask(self, new_tokens: int = 0) -> torch.Tensor:
        """[B, T + new_tokens] int64 2-D mask for an engine: 1 = attend, 0 = hidden slot."""
        self._settle()
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
        if n == 0:
            return []
        return [l.read_raw(start, end, copy=True) for l in self.layers]

    def rotated_keys(self, layer: int) -> torch.Tensor:
        """[B, H, T, D] keys of `layer` as attention sees them (see `layer_keys`)."""
        return self.layer_keys(layer)

    def layer_keys(self, index: int) -> torch.Tensor | None:
        """[B, H, T, D] keys of layer `index` rotated to their current positions: a view of the stored rotated keys
        (storage="rotated"), or rotated on read from the raw keys into a scratch buffer (storage="raw": valid until
        the next layer is read in the same forward; outside a forward a fresh tensor)."""
        l = self.layers[index]
        if l.storage == "rotated" or not l.allocated:
            return l.rot_k[:, :, : l.n] if l.allocated else None
        return self._rotate_on_read(index)

    def raw_read(self, index: int, state: "_ReadState | None" = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """storage="raw": layer `index`'s (raw keys, values [B, H, T, D], cos, sin [B, T, R/2] float32 of the slots'
        positions, multiplied by the RoPE attention scaling): what an attention needs to rotate keys on read itself.
        `state`: the forward's read state (`write_rotated_(..., hand_raw=True)` leaves it in `_handout`)."""
        l, cos, sin = self._fused_read_setup("raw_read", index, "raw", state)
        return l.raw_k[:, :, : l.n], l.v[:, :, : l.n], cos, sin

    def _fused_read_setup(self, op: str, index: int, storage: str, state: "_ReadState | None"
                          ) -> tuple[SlotLayer, torch.Tensor, torch.Tensor]:
        """Layer `index` (checked: allocated, of `storage`) and its slots' scaled cos / sin [B, T, R/2]."""
        l = self.layers[index]
        if l.storage != storage or not l.allocated:
            fail(f"{op} layer {index}", f"an allocated layer with storage={storage!r}",
                 f"storage={l.storage!r}, allocated={l.allocated}")
        st = self._read_state() if state is None or state.n != l.n else state
        cos, sin = st.scaled_cos_sin(l.spec, self.table.pos, l.raw_k.device)
        return l, cos, sin

    def _drop_tail_(self, n0: int) -> None:
        """Forget every slot from `n0` on (a step that failed in attention, running or just committed); positions,
        keys untouched."""
        if self._forward is not None and self._forward.n0 == n0:
            self._rollback_forward()
            return
        self._forward = None
        marks = self._committed
        for i, l in enumerate(self.layers):
            if marks is not None and marks[0] == n0 and i in marks[1]:
                l.restore(marks[1][i])
            else:
                l.truncate(n0)
        self.table.truncate(n0)

    def _read_state(self) -> _ReadState:
        """The running forward's (or recompute's) rotate-on-read state, else a transient one."""
        for run in (self._overwrite, self._forward):
            if run is not None:
                if run.read is None or run.read.n != self.table.n:
                    run.read = _ReadState(self.table.n)
                return run.read
        return _ReadState(self.table.n)

    def _rotate_on_read(self, index: int, fresh: tuple[int | torch.Tensor, torch.Tensor] | None = None
                        ) -> torch.Tensor:
        """Layer `index`'s keys rotated from raw to the table's positions. `fresh` = (slots, keys [B, H, S, D] the
        engine rotated itself) are copied in as they are (bit-identical to a plain cache): slots an int m for the
        tail [m, n) (a forward's new slots: only [0, m) is rotated), or a slot index [S] (a recompute)."""
        l = self.layers[index]
        st = self._read_state()
        n = l.n
        upto = fresh[0] if fresh is not None and isinstance(fresh[0], int) else n
        cos, sin = st.cos_sin(l.spec, self.table.pos, l.raw_k.device)
        out = st.buffer(l)[:, :, :n]
        if upto:
            src = l.dequant_keys(0, upto) if l.storage == "int8" else l.raw_k[:, :, :upto]
            _apply(src, cos[:, :, :upto], sin[:, :, :upto], l.spec, l.spec.attention_scaling, out=out[:, :, :upto])
        if fresh is None:
            pass
        elif isinstance(fresh[0], int):
            out[:, :, upto:] = fresh[1].to(out.dtype)
        else:
            out[:, :, fresh[0].to(out.device)] = fresh[1].to(out.dtype)
        if not torch.compiler.is_compiling():          # attention backends (which read it) run eagerly
            self._last_read = (index, out.data_ptr())    # what holds_keys accepts (the forward may commit first)
        return out

    def _values_on_read(self, index: int, fresh: tuple[int | torch.Tensor, torch.Tensor] | None = None
                        ) -> torch.Tensor:
        """Layer `index`'s values [B, H, T, Dv] as attention reads them: the stored ones, or (storage="int8")
        dequantized into the forward's value buffer, `fresh` = (slots, values) copied in as the engine computed
        them (like `_rotate_on_read`)."""
        l = self.layers[index]
        if l.storage != "int8":
            return l.values
        n = l.n
        upto = fresh[0] if fresh is not None and isinstance(fresh[0], int) else n
        out = self._read_state().value_buffer(l)[:, :, :n]
        if upto:
            l.dequant_values(0, upto, out=out[:, :, :upto])
        if fresh is not None:
            out[:, :, upto:] = fresh[1].to(out.dtype)
        return out

    def read_layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s (keys rotated to their positions, values) as attention reads them (read buffers for
        storage="raw" / "int8": valid until the next layer is read in the same forward)."""
        return self.layer_keys(index), self._values_on_read(index)

    def quant_read(self, index: int, state: "_ReadState | None" = None) -> dict:
        """storage="int8": what a fused reader needs of layer `index`: key codes [B, H, T, D] int8 (sealed slots
        [0, q)), rows [T] int32, scales ks [B, H, R, D], the tail kt / vt [B, H, >= T - q, D], value codes
        [B, H, T, Dv] int8 and scales vs [B, H, T, 1] (sealed slots), q, and cos / sin [B, T, R/2] float32 (scaled like
        `raw_read`)."""
        l, cos, sin = self._fused_read_setup("quant_read", index, "int8", state)
        n = l.n
        return dict(codes=l.raw_k[:, :, :n], rows=l.rows[:n], ks=l.ks, kt=l.kt, vcodes=l.v[:, :, :n],
                    vs=l.vs[:, :, :n], vt=l.vt, q=l.q, cos=cos, sin=sin)

    def decode_fused(self, index: int, state: "_ReadState | None", q: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor | None:
        """Attention of one query token per row q [B, Hq, D] over layer `index` by the fused kernel of this storage
        (raw keys rotated in registers; int8: dequantized and rotated in registers): [B, Hq, D] float32, or None
        where the kernel cannot serve. mask: None or additive float32 [B|1, T]."""
        spec = self.layers[index].spec
        inter = spec.layout is RopeLayout.INTERLEAVED
        if self.storage == "int8":
            d = self.quant_read(index, state)
            return decode_q8_kernel(q, d["codes"], d["rows"], d["ks"], d["kt"], d["q"], d["vcodes"], d["vs"],
                                    d["vt"], d["cos"], d["sin"], mask, scale, spec.rotary_dim, inter)
        k, v, cos, sin = self.raw_read(index, state)
        return decode_raw_kernel(q, k, v, cos, sin, mask, scale, spec.rotary_dim, inter)

    def holds_keys(self, index: int, keys: torch.Tensor) -> bool:
        """Whether `keys` are layer `index`'s keys as this cache handed them to attention (same storage)."""
        l = self.layers[index]
        if not l.allocated or keys.shape[2] != l.n:
            return False
        if l.storage == "rotated":
            return keys.data_ptr() == l.rot_k.data_ptr()
        return self._last_read == (index, keys.data_ptr())

    # -- validation helpers ----------------------------------------------------------------------------------------
    def _check_idle(self, op: str) -> int:
        """Settle an interrupted forward; all layers must hold the table's slots. Returns T."""
        self._settle()
        n = self.table.n
        for i, l in enumerate(self.layers):
            if l.n != n:
                fail(f"{op}: layer {i}", f"{n} slots like the slot table", f"{l.n}",
                     "position operations run between forwards, not during one")
        return n

    def _groups(self) -> dict[int, tuple[RopeSpec, list[int]]]:
        """Layers grouped by RoPE spec object: {id(spec): (spec, [layer indices])}."""
        groups: dict[int, tuple[RopeSpec, list[int]]] = {}
        for i, l in enumerate(self.layers):
            groups.setdefault(id(l.spec), (l.spec, []))[1].append(i)
        return groups

    def _check_new_positions(self, pos: torch.Tensor, what: str) -> None:
        """Positions must be >= 0, below MAX_POSITION and within every spec's exact range."""
        if pos.numel():
            lo, hi = int(pos.min()), int(pos.max())
            if lo < 0:
                fail(what, "positions >= 0", f"min {lo}")
            if hi >= MAX_POSITION:
                fail(what, f"positions < 2**40 (MAX_POSITION)", f"max {hi}", "keep positions within a RoPE context")
        for spec, _ in self._groups().values():
            spec.check_positions(pos, what)

    def _rerotate(self, start: int, end: int) -> None:
        """Recompute rot_k of slots [start, end) from raw_k, every layer; cos/sin computed once per distinct spec."""
        if end <= start or self.storage != "rotated" or not self.layers[0].allocated:
            return
        pos = self.table.pos[:, start:end]
        for spec, idx in self._groups().values():
            cos, sin = cos_sin(pos, spec, device=self.layers[idx[0]].rot_k.device)
            layers = [self.layers[i] for i in idx]
            _apply_many([l.raw_k[:, :, start:end] for l in layers], [l.rot_k[:, :, start:end] for l in layers],
                        cos[:, None], sin[:, None], spec)

    # -- the write path of an engine forward -----------------------------------------------------------------------
    def write_rotated_(self, index: int, k_rot: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                       hand_raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `index`'s S new keys, already rotated by the engine to `pos` [B, S] int64, and values.

        k_rot, v: [B, H, S, D]. The first layer written in a forward appends the slots to the table; the forward
        commits when every layer has written. Returns every (rotated key, value) of the layer, [B, H, T, D] views.
        Inside `overwriting(slots)` the S tokens replace existing slots instead (positions must match).
        hand_raw (storage="raw" only): return the RAW keys instead, for an attention that rotates them itself (a
        fused kernel); `raw_read()` then gives their cos/sin. The caller must guarantee that reader."""
        if self._overwrite is not None:
            return self._overwrite_layer(index, k_rot, v, pos)
        if self.capacity is not None and torch.compiler.is_compiling():
            return self._write_counted(index, k_rot, v, pos)
        layer, fw = self.layers[index], self._forward
        if fw is not None and index in fw.done:      # the previous forward never finished (it raised): undo it
            self._rollback_forward()
            fw = None
        S = k_rot.shape[2]
        if fw is None:
            self._check_forward_start(index, k_rot, pos)
            fw = self._forward = _Forward(self.table.n, S, pos)
            self.table.append(pos)
        elif S != fw.S or layer.n != fw.n0:
            fail(f"write layer {index}", f"{fw.S} new slots after {fw.n0} (what earlier layers of this forward "
                 "wrote)", f"{S} new slots after {layer.n}", "all layers of one forward must receive the same tokens")
        cs = fw.unrot.get(id(layer.spec))
        if cs is None:
            cos, sin = cos_sin(fw.pos, layer.spec, device=k_rot.device)
            cs = fw.unrot[id(layer.spec)] = (cos[:, None], -sin[:, None])
        raw = _apply(k_rot, cs[0], cs[1], layer.spec, 1.0 / layer.spec.attention_scaling)
        fw.marks[index] = layer.mark()
        layer.append(k_rot if layer.storage == "rotated" else None, v, raw)
        values = None
        if layer.storage != "rotated" and hand_raw:
            self._handout = self._read_state()       # the forward's cos/sin, shared by its layers
            keys, values = layer.raw_k[:, :, : layer.n], layer.v[:, :, : layer.n]   # (int8: the codes)
        elif layer.storage != "rotated":
            keys = self._rotate_on_read(index, (fw.n0, k_rot))
            values = self._values_on_read(index, (fw.n0, v))
        elif self.capacity is not None:
            keys = layer.rot_k[:, :, : self.capacity]   # fixed capacity: every slot (static shape), the mask hides the rest
        else:
            keys = layer.rot_k[:, :, : layer.n]
        fw.done.add(index)
        if len(fw.done) == len(self.layers):
            self._forward = None                    # committed (the scratch goes with it)
            self._committed = (fw.n0, fw.marks)
        if values is None:
            values = layer.v[:, :, : self.capacity] if self.capacity is not None else layer.values
        return keys, values

    def _write_counted(self, index: int, k_rot: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`write_rotated_` of a fixed-capacity cache inside a compiled forward: slots are placed by the table's
        tensor count, so the graph reads no Python slot count (static shapes and no guard on the count: one graph for
        every decode step, as transformers' StaticCache), and only rotated keys and values are written (StaticCache's
        work); the raw keys of these slots are un-rotated from them, and `n` re-synced, by the next eager access
        (`_sync_count`). Checks are by shape."""
        layer, fw = self.layers[index], self._forward
        S = k_rot.shape[2]
        if fw is None:
            if k_rot.dim() != 4 or k_rot.shape[-1] != layer.spec.head_dim or tuple(pos.shape) != (k_rot.shape[0], S):
                fail(f"write layer {index}: keys / positions", f"[B, H, S, D={layer.spec.head_dim}] / [B, S]",
                     f"{tuple(k_rot.shape)} / {tuple(pos.shape)}")
            if self.table._pos is not None and k_rot.shape[0] != self.table.batch_size:
                fail(f"write layer {index}: keys", f"batch {self.table.batch_size}", k_rot.shape[0])
            fw = self._forward = _Forward(-1, S, pos)
            fw.at = self.table.append_counted(pos)
        layer.write_at(fw.at, k_rot, v)
        fw.done.add(index)
        if len(fw.done) == len(self.layers):
            self._forward = None
        return layer.rot_k[:, :, : self.capacity], layer.v[:, :, : self.capacity]

    def _sync_count(self) -> None:
        """Fixed capacity: take in the slots compiled forwards appended (their count is a tensor): un-rotate their
        raw keys from the rotated keys they wrote (the write path's own un-rotation, deferred), then the counts."""
        t = self.table
        if t.count is None or t._pos is None or torch.compiler.is_compiling():
            return
        c, n = int(t.count), t.n
        if c == n:
            return
        pos = t._pos[:, n:c]
        for spec, idx in self._groups().values():
            cos, sin = cos_sin(pos, spec, device=self.layers[idx[0]].rot_k.device)
            for i in idx:
                l = self.layers[i]
                l.raw_k[:, :, n:c] = _apply(l.rot_k[:, :, n:c], cos[:, None], -sin[:, None], spec,
                                            1.0 / spec.attention_scaling).to(l.raw_k.dtype)
        t.n = c
        for l in self.layers:
            l.n = c

    def _check_forward_start(self, index: int, k_rot: torch.Tensor, pos: torch.Tensor) -> None:
        """Validate a new forward's first write: positions, shapes against what the cache already holds."""
        if not isinstance(pos, torch.Tensor) or pos.dtype != torch.long or pos.dim() != 2 \
                or tuple(pos.shape) != (k_rot.shape[0], k_rot.shape[2]):
            fail(f"write layer {index}: positions", f"int64 [B, S]={(k_rot.shape[0], k_rot.shape[2])}",
                 f"{getattr(pos, 'dtype', type(pos).__name__)} {tuple(getattr(pos, 'shape', ()))}")
        n = self._check_idle(f"write layer {index}")
        l = self.layers[index]
        if k_rot.dim() != 4 or k_rot.shape[-1] != l.spec.head_dim:
            fail(f"write layer {index}: keys", f"[B, H, S, D={l.spec.head_dim}]", tuple(k_rot.shape))
        if n and (k_rot.shape[0] != self.table.batch_size or (l.allocated and (
                k_rot.shape[1] != l.v.shape[1] or k_rot.dtype != l.key_dtype))):
            fail(f"write layer {index}: keys", f"batch {self.table.batch_size}, {l.v.shape[1]} kv heads, "
                 f"{l.key_dtype} (what the cache holds)", f"{tuple(k_rot.shape)} {k_rot.dtype}",
                 "a cache serves one model and one batch; reset() it or build another")
        if not torch.compiler.is_compiling():
            # reading position values would split a compiled forward; traced forwards take the positions the model
            # rotated its keys with (PositionedCache refuses models whose RoPE has an exact-range limit there)
            self._check_new_positions(pos, f"write layer {index}: positions")

    def _rollback_forward(self) -> None:
        fw = self._forward
        self._forward = None
        if fw.n0 < 0:                                # a counted (compiled, fixed-capacity) forward: undo its count
            self.table.count.fill_(self.table.n)
            return
        for i in fw.done:
            self.layers[i].restore(fw.marks[i])
        self.table.truncate(fw.n0)

    def _settle(self) -> None:
        """Undo a forward that raised part way (some layers written, not all); take in what compiled forwards of a
        fixed-capacity cache wrote (their slot count is a tensor); no-op otherwise."""
        if self._forward is not None:
            self._rollback_forward()
        self._sync_count()

    @contextlib.contextmanager
    def appending(self) -> Iterator[None]:
        """Within the block, an exception restores the cache to its state at entry, whatever layer or step raises:
        for engine calls (a forward, a generate loop). Appends, batch-row changes and crops are free; the first
        write inside the block to a slot that existed at entry (a crop below the entry length followed by an append,
        a position or structure operation) copies the buffers first (copy-on-write)."""
        n = self._check_idle("appending")
        table = self.table
        saved_table = (table._pos, table._vis, table._seg, table.n)
        saved_layers = [l.snapshot() for l in self.layers]
        outer = self._shared
        self._shared = max(outer, n)
        try:
            yield
        except BaseException:
            self._forward = None
            self.table = table
            table._pos, table._vis, table._seg, table.n = saved_table
            for l, snap in zip(self.layers, saved_layers):
                l.restore_snapshot(snap)
            raise
        finally:
            self._shared = outer

    def _unshare_below(self, lo: int) -> None:
        """Before an in-place write to slots from `lo` on: if a running appending() block's snapshot shares them,
        give the cache its own buffers (once per block)."""
        if lo < self._shared:
            for l in self.layers:
                l.unshare_()
            self.table.unshare_()
            self._shared = 0

    @contextlib.contextmanager
    def overwriting(self, slots: torch.Tensor) -> Iterator[None]:
        """Within the block, forwards write their S tokens into the existing `slots` [S] (in order) instead of
        appending: the recompute step of link / selective repairs. Positions must equal what the slots hold. On an
        exception every overwritten slot gets its old keys and values back (cache: modified in place)."""
        n = self._check_idle("overwriting")
        if self.storage == "int8":
            fail("overwriting", "a cache whose slots can be rewritten (storage 'rotated' or 'raw')",
                 "storage='int8' (quantized slots are written once)",
                 "recompute repairs (link-k, selective, PIE re-encode) need storage='raw' or 'rotated'")
        idx = check_slot_index("overwriting slots", slots, n)
        if self._overwrite is not None:
            fail("overwriting", "no overwrite already in progress", "a nested overwriting() block")
        if idx.numel():
            self._unshare_below(int(idx.min()))
        self._overwrite = ow = _Overwrite(idx)
        try:
            yield
        except BaseException:
            for i, (rot, raw, v) in ow.saved.items():
                l = self.layers[i]
                d = l.v.device
                if rot is not None:
                    l.rot_k[:, :, idx.to(d)] = rot
                l.raw_k[:, :, idx.to(d)], l.v[:, :, idx.to(d)] = raw, v
            raise
        finally:
            self._overwrite = None

    def _overwrite_layer(self, index: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        ow, l = self._overwrite, self.layers[index]
        if ow.slots.numel() != k.shape[2]:
            fail(f"write layer {index} (overwrite)", f"{ow.slots.numel()} tokens for the chosen slots", k.shape[2])
        held = self.table.pos[:, ow.slots.to(self.table.pos.device)]
        if tuple(pos.shape) != tuple(held.shape) or not torch.equal(held, pos.to(held.device)):
            fail(f"write layer {index} (overwrite)", "the positions the slots hold", pos.tolist())
        ow.pos = pos
        cos, sin = cos_sin(pos, l.spec, device=k.device)
        raw = _apply(k, cos[:, None], -sin[:, None], l.spec, 1.0 / l.spec.attention_scaling)
        idx = ow.slots.to(l.v.device)
        rotated = l.storage == "rotated"
        if index not in ow.saved:
            ow.saved[index] = (l.rot_k[:, :, idx].clone() if rotated else None, l.raw_k[:, :, idx].clone(),
                               l.v[:, :, idx].clone())
        if rotated:
            l.rot_k[:, :, idx] = k.to(l.rot_k.dtype)
        l.raw_k[:, :, idx] = raw.to(l.raw_k.dtype)
        l.v[:, :, idx] = v.to(l.v.dtype)
        keys = l.rot_k[:, :, : l.n] if rotated else self._rotate_on_read(index, (idx, k))
        return keys, l.values

    # -- position operations -------------------------------------------------------------------------------------
    def shift_(self, start: int, end: int, delta: int) -> "PositionedKV":
        """Move slots [start, end) by `delta` positions (all rows); keys re-rotated once from raw. Returns self.

            before: | ... | p_start .. p_end-1              | ... |
            after:  | ... | p_start+delta .. p_end-1+delta  | ... |
        """
        n = self._check_idle("shift_")
        start, end = check_range("shift_", start, end, n)
        delta = check_int("shift_ delta", delta)
        if abs(delta) >= MAX_POSITION:
            fail("shift_ delta", f"|delta| < 2**40 (MAX_POSITION)", delta)
        new = self.table.pos[:, start:end] + delta
        self._check_new_positions(new, f"shift_ (delta={delta})")
        self._unshare_below(start)
        self.table.pos[:, start:end] = new
        self._rerotate(start, end)
        return self

    def set_positions_(self, start: int, end: int, positions: torch.Tensor | Sequence[int]) -> "PositionedKV":
        """Give slots [start, end) the positions `positions` ([S] or [B, S] int64). Returns self."""
        n = self._check_idle("set_positions_")
        start, end = check_range("set_positions_", start, end, n)
        B = max(self.table.batch_size, 1)
        pos = as_positions("set_positions_ positions", positions, B, end - start, self.table.pos.device)
        self._check_new_positions(pos, "set_positions_ positions")
        self._unshare_below(start)
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
        n = self._check_idle("keep_")
        idx = check_slot_index("keep_ slots", slots, n)
        self._select(idx)
        return self

    def _select(self, idx: torch.Tensor) -> None:
        self._unshare_below(0)
        for l in self.layers:
            if l.allocated:
                l.select_(idx.to(l.v.device))
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
        n = self._check_idle(op)
        start, end = check_range(op, start, end, n)
        if end > start:
            self._unshare_below(start)
            self.table._vis[:, start:end] = value
        return self

    def set_segment_(self, start: int, end: int, label: int) -> "PositionedKV":
        """Label slots [start, end) with `label` (an int32 tag read by attention backends such as APE)."""
        n = self._check_idle("set_segment_")
        start, end = check_range("set_segment_", start, end, n)
        label = check_int("set_segment_ label", label)
        if not SEGMENT_RANGE[0] <= label <= SEGMENT_RANGE[1]:
            fail("set_segment_ label", f"an int32 label in [{SEGMENT_RANGE[0]}, {SEGMENT_RANGE[1]}]", label)
        if end > start:
            self._unshare_below(start)
            self.table._seg[:, start:end] = label
        return self

    def append_raw_(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor | Sequence[int],
                    segment: int = 0, visible: torch.Tensor | None = None) -> "PositionedKV":
        """Append precomputed slots: kv[layer] = (raw_keys [B|1, H, S, D], values [B|1, H, S, D]) placed at
        `positions` ([S] or [B, S]). Keys are rotated once from raw. This is how stored chunks enter a cache.

        Keys and values must be floating tensors of the cache's dtype (the first append sets it); `segment` labels
        the new slots (an int, or [B, S] int32), `visible` [B, S] bool (default all visible)."""
        n = self._check_idle("append_raw_")
        B, S = self._check_raw_kv("append_raw_ kv", kv)
        dev = kv[0][0].device if self.table._pos is None else self.table._pos.device
        pos = as_positions("append_raw_ positions", positions, B, S, dev)
        self._check_new_positions(pos, "append_raw_ positions")
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
        if self.storage == "int8":
            self._append_quantized(kv, B)
        for l, (k, v) in zip(self.layers, kv if self.storage != "int8" else ()):
            l.raw_k[:, :, sl] = k
            l.v[:, :, sl] = v
        for spec, idx in self._groups().values() if self.storage == "rotated" else ():
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
            H = l.v.shape[1] if l.allocated else shape0[1]
            if k.shape[0] not in (1, B) or k.shape[1] != H or k.shape[2] != shape0[2] or k.shape[3] != l.spec.head_dim:
                fail(f"{what}[{i}] raw_keys", f"[B={B}|1, H={H}, S={shape0[2]}, D={l.spec.head_dim}]",
                     tuple(k.shape))
            Dv = l.v.shape[3] if l.v is not None else k.shape[3]
            if tuple(v.shape) != (k.shape[0], H, shape0[2], Dv):
                fail(f"{what}[{i}] values", f"[{k.shape[0]}, H={H}, S={shape0[2]}, Dv={Dv}]", tuple(v.shape))
            if l.allocated and k.device != l.v.device:
                fail(f"{what}[{i}]", f"tensors on {l.v.device}", str(k.device))
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
                    l.reserve(l.raw_k[:, :, :0], l.v[:, :, :0], need)
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
        self._check_idle("reserve_")
        _sized(self.capacity, 0, slots, _grown)              # a fixed-capacity cache refuses more than it holds
        for l in (l for l in self.layers if not l.allocated):
            l.room = max(l.room, slots)
        if self.layers[0].allocated:
            self._reserve_all(slots, [(l.raw_k[:, :, :0], l.v[:, :, :0]) for l in self.layers])
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
        n = self._check_idle("copy")
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
        m = other._check_idle("append_from_ other")
        end = m if end is None else end
        start, end = check_range("append_from_", start, end, m)
        if end == start:
            return self
        pos = other.table.pos[:, start:end] if positions is None else positions
        seg = other.table.segment[:, start:end] if segment is None else segment
        return self.append_raw_([l.read_raw(start, end) for l in other.layers], pos,
                                segment=seg, visible=other.table.visible[:, start:end])

    @classmethod
    def concat(cls, caches: Sequence["PositionedKV"]) -> "PositionedKV":
        """A new cache holding the slots of `caches` one after the other, each at its own positions."""
        if isinstance(caches, PositionedKV) or not caches:
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
        n = self._check_idle("crop")
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
        self._check_idle("reorder_rows_")
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
        self._forward = None
        for l in self.layers:
            l.clear()
        self.table = self._new_table()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layers={len(self.layers)}, batch={self.table.batch_size}, "
                f"slots={self.table.n}, bytes={self.nbytes()})")


def _common_specs(op: str, caches: Iterable[PositionedKV]) -> None:
    """Refuse to mix caches of different layer counts, RoPE specs or dtypes."""
    caches = list(caches)
    ref = caches[0]
    for j, c in enumerate(caches):
        if not isinstance(c, PositionedKV):
            fail(f"{op} caches[{j}]", "a PositionedKV", type(c).__name__, exc=TypeError)
        if len(c.layers) != len(ref.layers):
            fail(f"{op} caches[{j}]", f"{len(ref.layers)} layers", len(c.layers))
        for i, (a, b) in enumerate(zip(ref.layers, c.layers)):
            if a.spec.key() != b.spec.key():
                fail(f"{op} caches[{j}] layer {i}", "the same RoPE spec as caches[0]", b.spec.describe())
        if ref.origin is not None and c.origin is not None and c.origin != ref.origin:
            fail(f"{op} caches[{j}]", "a cache of the same model as caches[0]", "a cache of another model",
                 "KV from two models cannot share a cache; recompute it with one model")
        if ref.dtype is not None and c.dtype is not None and c.dtype != ref.dtype:
            fail(f"{op} caches[{j}]", f"keys in {ref.dtype} like caches[0]", c.dtype,
                 "convert one of them first; kvpos never casts silently")
