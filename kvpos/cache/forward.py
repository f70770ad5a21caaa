"""The forward write transaction: a forward begins at its first layer write, writes every layer, commits when the
last layer has written and rolls back if it raised part way; `appending()` and `overwriting()` scopes."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .._checks import check_slot_index, fail
from ..rope import _apply, cos_sin
from .reads import _ReadState


@dataclass
class _Forward:
    """The engine forward being written: slots [n0, n0 + S) at positions pos [B, S]; layers written so far."""

    n0: int
    S: int
    pos: torch.Tensor
    done: set = field(default_factory=set)
    marks: dict = field(default_factory=dict)     # layer index -> its mark before this forward (rollback point)
    unrot: dict = field(default_factory=dict)     # spec.identity -> (cos, -sin) [B, 1, S, R/2]
    read: "_ReadState | None" = None              # storage="raw": this forward's rotate-on-read state
    at: "torch.Tensor | None" = None              # fixed capacity under compile: the slot index [S] of the new slots


@dataclass
class _Overwrite:
    """A recompute forward writing into existing slots [S]; the old contents per layer, for rollback."""

    slots: torch.Tensor
    saved: dict = field(default_factory=dict)      # layer index -> its slots before the write (layer.saved_slots)
    pos: torch.Tensor | None = None                # positions of the running recompute forward (first layer's)
    read: "_ReadState | None" = None               # storage="raw": the recompute forward's rotate-on-read state


class ForwardWriter:
    """One engine forward written explicitly, layer by layer (the protocol an engine adapter drives):

        writer = kv.begin_forward(pos)                 # pos int64 [B, S]: the new tokens' positions
        for i in range(L):
            keys, values = writer.write(i, k_rot, v)   # k_rot / v [B, H, S, D], k_rot rotated at pos by the engine
        writer.commit()                                # every layer written, or it raises (and rolls back)

    `abort()` (or an exception inside `with kv.begin_forward(pos) as writer:`) rolls the forward back: the cache is
    as it was before `begin_forward`, whether 0, some or all layers were written. transformers' adapter writes
    through the same transaction implicitly (`write_rotated_` begins at a forward's first layer write)."""

    def __init__(self, kv: "_ForwardWrites", pos: torch.Tensor) -> None:
        self.kv, self.pos, self.n0 = kv, pos, kv.table.n
        self.state = "open"

    def write(self, index: int, k_rot: torch.Tensor, v: torch.Tensor, hand_raw: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s new keys and values (see PositionedKV.write_rotated_); returns what attention reads."""
        if self.state != "open":
            fail("ForwardWriter.write", "an open forward", f"a {self.state} one", "begin_forward() again")
        fw = self.kv.running_forward
        if (fw is None and self.kv.table.n != self.n0) or (fw is not None and fw.n0 != self.n0):
            self.state = "aborted"
            fail("ForwardWriter.write", f"the cache as begin_forward left it ({self.n0} slots before this forward)",
                 f"{self.kv.table.n} slots (another forward wrote in between)", "one forward at a time per cache")
        return self.kv.write_rotated_(index, k_rot, v, self.pos, hand_raw)

    def commit(self) -> None:
        """End the forward; every layer must have been written (else it is rolled back and this raises)."""
        if self.state != "open":
            fail("ForwardWriter.commit", "an open forward", f"a {self.state} one")
        fw = self.kv.running_forward
        if fw is not None or self.kv.table.n == self.n0:
            done = 0 if fw is None else len(fw.done)
            self.abort()
            fail("ForwardWriter.commit", f"all {len(self.kv.layers)} layers written", f"{done} written",
                 "write every layer of the forward (the cache was rolled back)")
        self.state = "committed"

    def abort(self) -> None:
        """Roll the forward back (no-op after commit or abort)."""
        if self.state != "open":
            return
        self.state = "aborted"
        self.kv.drop_tail_(self.n0)

    def __enter__(self) -> "ForwardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self.state == "open":
            self.commit()


class _ForwardWrites:
    """PositionedKV's forward writes (a mixin: every name it uses is PositionedKV's)."""

    def begin_forward(self, pos: torch.Tensor) -> ForwardWriter:
        """Begin an engine forward of S new tokens at `pos` int64 [B, S] (validated here); see ForwardWriter."""
        if not isinstance(pos, torch.Tensor) or pos.dtype != torch.long or pos.dim() != 2 or pos.shape[1] == 0:
            fail("begin_forward pos", "int64 [B, S] positions (S >= 1)",
                 f"{getattr(pos, 'dtype', type(pos).__name__)} {tuple(getattr(pos, 'shape', ()))}")
        if self.running_overwrite is not None:
            fail("begin_forward", "no overwrite in progress", "inside overwriting()", "write the recompute forward "
                 "with write_rotated_ inside overwriting()")
        self.check_idle("begin_forward")
        if self.table.batch_size > 0 and pos.shape[0] != self.table.batch_size:
            fail("begin_forward pos", f"batch {self.table.batch_size} (the cache's)", pos.shape[0])
        self.check_new_positions(pos, "begin_forward pos")
        return ForwardWriter(self, pos)

    def write_rotated_(self, index: int, k_rot: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                       hand_raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `index`'s S new keys, already rotated by the engine to `pos` [B, S] int64, and values.

        k_rot, v: [B, H, S, D]. The first layer written in a forward appends the slots to the table; the forward
        commits when every layer has written. Returns every (rotated key, value) of the layer, [B, H, T, D] views.
        Inside `overwriting(slots)` the S tokens replace existing slots instead (positions must match).
        hand_raw (storage="raw" only): return the RAW keys instead, for an attention that rotates them itself (a
        fused kernel); `fused_inputs_raw()` then gives their cos/sin. The caller must guarantee that reader."""
        if self.running_overwrite is not None:
            return self._overwrite_layer(index, k_rot, v, pos)
        if self.capacity is not None and torch.compiler.is_compiling():
            return self._write_counted(index, k_rot, v, pos)
        layer, fw = self.layers[index], self.running_forward
        if fw is not None and index in fw.done:      # the previous forward never finished (it raised): undo it
            self._rollback_forward()
            fw = None
        S = k_rot.shape[2]
        if fw is None:
            self._check_forward_start(index, k_rot, pos)
            fw = self.running_forward = _Forward(self.table.n, S, pos)
            self.table.append(pos)
        elif S != fw.S or layer.n != fw.n0:
            fail(f"write layer {index}", f"{fw.S} new slots after {fw.n0} (what earlier layers of this forward "
                 "wrote)", f"{S} new slots after {layer.n}", "all layers of one forward must receive the same tokens")
        cs = fw.unrot.get(layer.spec.identity)
        if cs is None:
            cos, sin = cos_sin(fw.pos, layer.spec, device=k_rot.device)
            cs = fw.unrot[layer.spec.identity] = (cos[:, None], -sin[:, None])
        raw = _apply(k_rot, cs[0], cs[1], layer.spec, 1.0 / layer.spec.attention_scaling)
        fw.marks[index] = layer.mark()
        layer.append(k_rot, v, raw)
        if hand_raw:
            keys, values = layer.handed_out()         # raw keys (int8: the codes) for a reader that rotates them
            self.handout = self.read_state()         # the forward's cos/sin, shared by its layers
        else:
            keys, values = layer.attended(self, index, fw.n0, k_rot, v)
        fw.done.add(index)
        if len(fw.done) == len(self.layers):
            self.running_forward = None                    # committed (the scratch goes with it)
            self._committed = (fw.n0, fw.marks)
        return keys, values

    def _write_counted(self, index: int, k_rot: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`write_rotated_` of a fixed-capacity cache inside a compiled forward: slots are placed by the table's
        tensor count, so the graph reads no Python slot count (static shapes and no guard on the count: one graph for
        every decode step, as transformers' StaticCache), and only rotated keys and values are written (StaticCache's
        work); the raw keys of these slots are un-rotated from them, and `n` re-synced, by the next eager access
        (`sync_count`). Checks are by shape."""
        layer, fw = self.layers[index], self.running_forward
        S = k_rot.shape[2]
        if fw is None:
            if k_rot.dim() != 4 or k_rot.shape[-1] != layer.spec.head_dim or tuple(pos.shape) != (k_rot.shape[0], S):
                fail(f"write layer {index}: keys / positions", f"[B, H, S, D={layer.spec.head_dim}] / [B, S]",
                     f"{tuple(k_rot.shape)} / {tuple(pos.shape)}")
            if self.table._pos is not None and k_rot.shape[0] != self.table.batch_size:
                fail(f"write layer {index}: keys", f"batch {self.table.batch_size}", k_rot.shape[0])
            fw = self.running_forward = _Forward(-1, S, pos)
            fw.at = self.table.append_counted(pos)
        layer.write_at(fw.at, k_rot, v)
        fw.done.add(index)
        if len(fw.done) == len(self.layers):
            self.running_forward = None
        return layer.rot_k[:, :, : self.capacity], layer.v[:, :, : self.capacity]

    def sync_count(self) -> None:
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
        n = self.check_idle(f"write layer {index}")
        l = self.layers[index]
        if k_rot.dim() != 4 or k_rot.shape[-1] != l.spec.head_dim:
            fail(f"write layer {index}: keys", f"[B, H, S, D={l.spec.head_dim}]", tuple(k_rot.shape))
        if n and (k_rot.shape[0] != self.table.batch_size or (l.allocated and (
                k_rot.shape[1] != l.heads or k_rot.dtype != l.key_dtype))):
            fail(f"write layer {index}: keys", f"batch {self.table.batch_size}, {l.heads} kv heads, "
                 f"{l.key_dtype} (what the cache holds)", f"{tuple(k_rot.shape)} {k_rot.dtype}",
                 "a cache serves one model and one batch; reset() it or build another")
        if not torch.compiler.is_compiling():
            # reading position values would split a compiled forward; traced forwards take the positions the model
            # rotated its keys with (PositionedCache refuses models whose RoPE has an exact-range limit there)
            self.check_new_positions(pos, f"write layer {index}: positions")

    def _rollback_forward(self) -> None:
        fw = self.running_forward
        self.running_forward = None
        if fw.n0 < 0:                                # a counted (compiled, fixed-capacity) forward: undo its count
            self.table.count.fill_(self.table.n)
            return
        for i in fw.done:
            self.layers[i].restore(fw.marks[i])
        self.table.truncate(fw.n0)

    def settle(self) -> None:
        """Undo a forward that raised part way (some layers written, not all); take in what compiled forwards of a
        fixed-capacity cache wrote (their slot count is a tensor); no-op otherwise."""
        if self.running_forward is not None:
            self._rollback_forward()
        self.sync_count()

    @contextlib.contextmanager
    def appending(self) -> Iterator[None]:
        """Within the block, an exception restores the cache to its state at entry, whatever layer or step raises:
        for engine calls (a forward, a generate loop). Appends, batch-row changes and crops are free; the first
        write inside the block to a slot that existed at entry (a crop below the entry length followed by an append,
        a position or structure operation) copies the buffers first (copy-on-write)."""
        n = self.check_idle("appending")
        table = self.table
        saved_table = (table._pos, table._vis, table._seg, table.n)
        saved_layers = [l.snapshot() for l in self.layers]
        outer = self._shared
        self._shared = max(outer, n)
        try:
            yield
        except BaseException:
            self.running_forward = None
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
        n = self.check_idle("overwriting")
        if self.mode.quantized:
            fail("overwriting", "a cache whose slots can be rewritten (storage 'rotated' or 'raw')",
                 "storage='int8' (quantized slots are written once)",
                 "recompute repairs (link-k, selective, PIE re-encode) need storage='raw' or 'rotated'")
        idx = check_slot_index("overwriting slots", slots, n)
        if self.running_overwrite is not None:
            fail("overwriting", "no overwrite already in progress", "a nested overwriting() block")
        if idx.numel():
            self._unshare_below(int(idx.min()))
        self.running_overwrite = ow = _Overwrite(idx)
        try:
            yield
        except BaseException:
            for i, saved in ow.saved.items():
                l = self.layers[i]
                l.restore_slots_(idx.to(l.slot_device), saved)
            raise
        finally:
            self.running_overwrite = None

    def _overwrite_layer(self, index: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        ow, l = self.running_overwrite, self.layers[index]
        if ow.slots.numel() != k.shape[2]:
            fail(f"write layer {index} (overwrite)", f"{ow.slots.numel()} tokens for the chosen slots", k.shape[2])
        held = self.table.pos[:, ow.slots.to(self.table.pos.device)]
        if tuple(pos.shape) != tuple(held.shape) or not torch.equal(held, pos.to(held.device)):
            fail(f"write layer {index} (overwrite)", "the positions the slots hold", pos.tolist())
        ow.pos = pos
        cos, sin = cos_sin(pos, l.spec, device=k.device)
        raw = _apply(k, cos[:, None], -sin[:, None], l.spec, 1.0 / l.spec.attention_scaling)
        idx = ow.slots.to(l.slot_device)
        if index not in ow.saved:
            ow.saved[index] = l.saved_slots(idx)
        l.overwrite_slots_(idx, k, raw, v)
        keys = l.overwritten(self, index, idx, k)
        return keys, l.values

    # -- position operations -------------------------------------------------------------------------------------
