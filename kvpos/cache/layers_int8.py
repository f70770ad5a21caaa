"""storage="int8": QuantSlotLayer, one layer's keys and values as int8 codes with scales (kvpos.quant)."""
from __future__ import annotations

from typing import Any

import torch

from .._checks import fail
from ..quant import GROUP, dequantize_keys, dequantize_values, quantize_key_groups, quantize_values
from ..rope import RopeSpec
from .buffers import _alloc, _grown_tight, _regrow
from .layers import SlotLayer
from .storages import INT8

__all__ = ["QuantSlotLayer"]


class QuantSlotLayer(SlotLayer):
    """storage="int8": one layer's raw keys and values in int8 (`kvpos.quant`), the first `n` of C slots valid.

        k_codes [B, H, C, D] int8   raw-key codes of the sealed slots [0, q): per channel over groups of GROUP tokens
        rows  [C] int32             each sealed slot's scale row in ks
        ks    [B, H, R, D]          key scales (the keys' dtype); rows [0, nrows) in use
        v_codes [B, H, C, Dv] int8  value codes of the sealed slots, vs [B, H, C, 1] their per-token scales
        kt, vt [B, H, GROUP, D]     the tail: keys and values of slots [q, n) unquantized (n - q <= GROUP), like
                                  KIVI's residual; a group is sealed from it when a write would leave more than
                                  GROUP there, so the newest GROUP tokens or fewer are always exact

    A write never changes what an earlier state reads (scale rows go after the used ones, codes after the sealed
    slots, sealing takes new tail tensors), so buffer references plus counts are a complete rollback point. Deleting
    or reordering slots moves codes and row numbers only; the tail stays a tail when its kept slots stay the last
    ones in order, else it is sealed first as one (shorter) group."""

    mode = INT8

    def __init__(self, spec: RopeSpec, raw_dtype: torch.dtype | None = None, fixed: int | None = None) -> None:
        SlotLayer.__init__(self, spec, None, None)
        del self.raw_k, self.v                       # this storage holds codes (k_codes, v_codes), never raw keys
        self.k_codes: torch.Tensor | None = None
        self.v_codes: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.ks: torch.Tensor | None = None
        self.vs: torch.Tensor | None = None
        self.kt: torch.Tensor | None = None
        self.vt: torch.Tensor | None = None
        self.q = 0
        self.nrows = 0

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return ("k_codes", "v_codes", "vs", "rows", "ks", "kt", "vt")

    @property
    def key_store(self) -> torch.Tensor | None:
        return self.k_codes

    @property
    def value_store(self) -> torch.Tensor | None:
        return self.v_codes

    def valid_raw_keys(self) -> torch.Tensor | None:
        """[B, H, T, D] keys before RoPE, dequantized (a new tensor)."""
        return None if self.v_codes is None else self.dequant_keys(0, self.n)

    def valid_values(self) -> torch.Tensor | None:
        """[B, H, T, Dv] values, dequantized (a new tensor)."""
        return None if self.v_codes is None else self.dequant_values(0, self.n)

    def _new_tails(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, _, D = self.k_codes.shape
        dev = self.k_codes.device
        return (_alloc((B, H, GROUP, D), self.key_dtype, dev), _alloc((B, H, GROUP, self.v_codes.shape[3]),
                                                                     self.key_dtype, dev))

    def reserve(self, like_k: torch.Tensor, like_v: torch.Tensor, need: int) -> None:
        if self.v_codes is None:
            B, H, _, D = like_k.shape
            cap, kd, dev = _grown_tight(0, max(need, self.room)), like_k.dtype, like_k.device
            k_codes = _alloc((B, H, cap, D), torch.int8, dev)
            v_codes = _alloc((B, H, cap, like_v.shape[-1]), torch.int8, dev)
            vs = _alloc((B, H, cap, 1), kd, dev)
            rows = _alloc((cap,), torch.int32, dev)
            ks = _alloc((B, H, max(4, cap // GROUP + 2), D), kd, dev)
            self.k_codes, self.v_codes, self.vs, self.rows, self.ks, self.key_dtype = k_codes, v_codes, vs, rows, ks, kd
            self.kt, self.vt = self._new_tails()
            return
        if need > self.capacity:
            self._regrow_slots(_grown_tight(self.capacity, need))

    def _regrow_slots(self, cap: int) -> None:
        a = _regrow([self.k_codes, self.v_codes, self.vs], 2, cap, self.q)
        r = _regrow([self.rows], 0, cap, self.q)
        self.k_codes, self.v_codes, self.vs, self.rows = a[0], a[1], a[2], r[0]

    def shrink_(self, cap: int) -> None:
        if self.v_codes is not None and cap < self.capacity:
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
        self.k_codes[:, :, q: q + m], self.v_codes[:, :, q: q + m], self.vs[:, :, q: q + m] = codes, vc, vsc
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
        B, H, _, D = self.k_codes.shape
        res = out if out is not None else _alloc((B, H, end - start, D), self.key_dtype, self.k_codes.device)
        a, b = start, min(end, self.q)
        if b > a:
            dequantize_keys(self.k_codes[:, :, a:b], self.rows[a:b], self.ks, self.key_dtype, out=res[:, :, : b - a])
        a = max(start, self.q)
        if end > a:
            res[:, :, a - start:] = self.kt[:, :, a - self.q: end - self.q]
        return res

    def dequant_values(self, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Values [B, H, end - start, Dv] of slots [start, end) in the keys' dtype (into `out` if given)."""
        B, H, _, Dv = self.v_codes.shape
        res = out if out is not None else _alloc((B, H, end - start, Dv), self.key_dtype, self.v_codes.device)
        a, b = start, min(end, self.q)
        if b > a:
            dequantize_values(self.v_codes[:, :, a:b], self.vs[:, :, a:b], self.key_dtype, out=res[:, :, : b - a])
        a = max(start, self.q)
        if end > a:
            res[:, :, a - start:] = self.vt[:, :, a - self.q: end - self.q]
        return res

    def raw_slots(self, start: int, end: int, copy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
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
        for buf in (self.k_codes, self.v_codes, self.vs):
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
        if self.v_codes is not None:
            r = rows.to(self.v_codes.device)
            self.k_codes, self.v_codes, self.vs, self.ks, self.kt, self.vt = (
                b[r] for b in (self.k_codes, self.v_codes, self.vs, self.ks, self.kt, self.vt))

    def clear(self) -> None:
        SlotLayer.clear(self)
        self.q = self.nrows = 0

    # -- what attention reads (rotate-on-read from dequantized keys) -----------------------------------------------
    def handed_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key codes, value codes) [B, H, T, D] int8: what the fused int8 reader takes (with `fused_inputs_int8`)."""
        return self.k_codes[:, :, : self.n], self.v_codes[:, :, : self.n]

    def raw_source(self, upto: int) -> torch.Tensor:
        return self.dequant_keys(0, upto)

    def values_on_read(self, state: Any, fresh: tuple[Any, torch.Tensor] | None = None) -> torch.Tensor:
        """Values dequantized into the forward's value buffer; `fresh` = (slots, values) copied in as the engine
        computed them (a forward's new tail slots [m, n) when slots is an int m)."""
        n = self.n
        upto = fresh[0] if fresh is not None and isinstance(fresh[0], int) else n
        out = state.value_buffer(self)[:, :, :n]
        if upto:
            self.dequant_values(0, upto, out=out[:, :, :upto])
        if fresh is not None:
            out[:, :, upto:] = fresh[1].to(out.dtype)
        return out

    def saved_slots(self, idx: torch.Tensor) -> tuple:
        fail("overwriting slots", "storage 'rotated' or 'raw'", "storage='int8' (quantized slots are written once)")

    overwrite_slots_ = restore_slots_ = saved_slots

    def copy_into(self, other: "SlotLayer", cap: int, fixed: bool) -> None:
        other.k_codes, other.v_codes, other.vs = _regrow([self.k_codes, self.v_codes, self.vs], 2, cap, self.q)
        other.rows = _regrow([self.rows], 0, cap, self.q)[0]
        other.ks = _regrow([self.ks], 2, max(self.nrows, 4), self.nrows)[0]
        other.kt, other.vt = self.kt.clone(), self.vt.clone()
        other.key_dtype, other.n, other.q, other.nrows = self.key_dtype, self.n, self.q, self.nrows

    def unshare_(self) -> None:
        if self.v_codes is not None:
            self._regrow_slots(self.capacity)
            self.ks = _regrow([self.ks], 2, self.ks.shape[2], self.nrows)[0]
            self.kt, self.vt = self.kt.clone(), self.vt.clone()
