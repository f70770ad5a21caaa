"""PositionedKV: one storage per layer sharing one slot table; construction, properties, validation. Reads,
forward writes, position and structure operations come from the mixins of reads.py, forward.py, positions.py and
structure.py."""
from __future__ import annotations

from typing import Sequence

import torch

from .._checks import check_int, check_range, fail
from .storages import storage_mode
from ..rope import RopeSpec, _apply_many, cos_sin
from .buffers import MAX_POSITION, _grown, _grown_tight
from .forward import _Forward, _ForwardWrites, _Overwrite
from .layers import SlotLayer, layer_class
from .positions import _PositionOps
from .reads import _ReadState, _Reads
from .structure import _StructureOps
from .table import SlotTable


class PositionedKV(_Reads, _ForwardWrites, _PositionOps, _StructureOps):
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
        as int8: `kvpos.cache.layers_int8.QuantSlotLayer`; approximate, bytes in results/bench_memory.md; no recompute forwards).
        capacity: a fixed capacity in slots (buffers
        allocated once at that size, zero-filled, never regrown; attention receives all `capacity` slots and the
        mask hides the unused ones: static shapes for torch.compile(fullgraph=True), like transformers'
        StaticCache); None (default) grows as needed."""
        mode = storage_mode(storage, f"{type(self).__name__} storage")
        if capacity is not None:
            capacity = check_int(f"{type(self).__name__} capacity", capacity)
            if capacity < 1:
                fail(f"{type(self).__name__} capacity", "None or an int >= 1 (slots)", capacity)
            if not mode.fixed_capacity:
                fail(f"{type(self).__name__} capacity", f"None with storage={storage!r} (rotate-on-read has no "
                     "fixed-capacity mode)", capacity, "use storage='rotated' for a fixed-capacity cache")
        if mode.quantized and raw_dtype is not None:
            fail(f"{type(self).__name__} raw_dtype", "None with storage='int8' (keys are stored as int8 codes)",
                 raw_dtype)
        self.mode = mode                    # what the storage holds and can do (kvpos.cache.storages)
        self.storage = mode.name
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
        self.running_forward: _Forward | None = None
        self.running_overwrite: _Overwrite | None = None
        self.last_read: tuple[int, int] | None = None     # (layer, data pointer) of the last rotate-on-read
        self.map_tables: dict = {}          # factored position-map tables kept across forwards (_ReadState.factored)
        self.handout: _ReadState | None = None           # read state of the last write that handed out raw keys
        self._committed: tuple[int, dict] | None = None     # (n0, layer marks) of the last committed forward
        # slots [0, _shared) are shared with the snapshot of a running appending() block: an in-place write there
        # first copies the buffers (copy-on-write), so that the block's rollback finds them as they were
        self._shared = 0

    def _new_table(self) -> SlotTable:
        return SlotTable(self.capacity, _grown if self.mode.keeps_rotated else _grown_tight)

    def _new_layer(self, index: int, spec: RopeSpec) -> SlotLayer:
        """The storage object of layer `index` (engine adapters return their protocol subclass)."""
        return layer_class(self.mode)(spec, self.raw_dtype, self.capacity)

    @property
    def specs(self) -> list[RopeSpec]:
        return [l.spec for l in self.layers]

    # -- reading -------------------------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """T, the number of cached slots (hidden ones included)."""
        self.settle()
        return self.table.n

    @property
    def batch_size(self) -> int:
        """B, or -1 for a cache that never held a slot."""
        self.settle()
        return self.table.batch_size

    @property
    def positions(self) -> torch.Tensor:
        """[B, T] int64 copy of the slot positions."""
        self.settle()
        return self.table.pos.clone()

    @property
    def visible(self) -> torch.Tensor:
        """[B, T] bool copy: False where a slot is hidden."""
        self.settle()
        return self.table.visible.clone()

    @property
    def segments(self) -> torch.Tensor:
        """[B, T] int32 copy of the slot labels."""
        self.settle()
        return self.table.segment.clone()

    @property
    def dtype(self) -> torch.dtype | None:
        """dtype of the keys attention reads (None before the first slot)."""
        return self.layers[0].key_dtype

    def next_position(self) -> torch.Tensor:
        """[B] int64: one past the largest position of a visible slot per row (0 for an empty row)."""
        self.settle()
        t = self.table
        if t.n == 0:
            return torch.zeros(max(t.batch_size, 1), dtype=torch.long)
        p = t.pos.masked_fill(~t.visible, -1)
        return p.max(dim=1).values + 1

    def attention_mask(self, new_tokens: int = 0) -> torch.Tensor:
        """[B, T + new_tokens] int64 2-D mask for an engine: 1 = attend, 0 = hidden slot."""
        self.settle()
        vis = self.table.visible.long()
        if new_tokens:
            vis = torch.cat([vis, vis.new_ones(vis.shape[0], new_tokens)], 1)
        return vis

    def nbytes(self) -> int:
        """Bytes held by the key/value buffers of every layer (capacity, not just valid slots)."""
        return sum(l.nbytes() for l in self.layers)

    def raw_kv(self, start: int = 0, end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (raw_keys [B, H, S, D], values [B, H, S, D]) of slots [start, end): copies, safe to keep."""
        n = self.check_idle("raw_kv")
        end = n if end is None else end
        start, end = check_range("raw_kv", start, end, n)
        if n == 0:
            return []
        return [l.raw_slots(start, end, copy=True) for l in self.layers]

    def rotated_keys(self, layer: int) -> torch.Tensor:
        """Deprecated alias of `layer_keys` (one name, one meaning): [B, H, T, D] keys as attention sees them."""
        import warnings

        warnings.warn("PositionedKV.rotated_keys is deprecated: use layer_keys", DeprecationWarning, stacklevel=2)
        return self.layer_keys(layer)

    def layer_keys(self, index: int) -> torch.Tensor | None:
        """[B, H, T, D] keys of layer `index` rotated to their current positions: a view of the stored rotated keys
        (storage="rotated"), or rotated on read from the raw keys into a scratch buffer (storage="raw": valid until
        the next layer is read in the same forward; outside a forward a fresh tensor)."""
        l = self.layers[index]
        return l.read_keys(self, index) if l.allocated else None

    def holds_keys(self, index: int, keys: torch.Tensor) -> bool:
        """Whether `keys` are layer `index`'s keys as this cache handed them to attention (same storage)."""
        l = self.layers[index]
        if not l.allocated or keys.shape[2] != l.n:
            return False
        return l.holds(index, keys, self.last_read)

    # -- validation helpers ----------------------------------------------------------------------------------------
    def check_idle(self, op: str) -> int:
        """Settle an interrupted forward; all layers must hold the table's slots. Returns T."""
        self.settle()
        n = self.table.n
        for i, l in enumerate(self.layers):
            if l.n != n:
                fail(f"{op}: layer {i}", f"{n} slots like the slot table", f"{l.n}",
                     "position operations run between forwards, not during one")
        return n

    def _groups(self) -> dict[str, tuple[RopeSpec, list[int]]]:
        """Layers grouped by RoPE spec identity: {spec.identity: (spec, [layer indices])}."""
        groups: dict[str, tuple[RopeSpec, list[int]]] = {}
        for i, l in enumerate(self.layers):
            groups.setdefault(l.spec.identity, (l.spec, []))[1].append(i)
        return groups

    def check_new_positions(self, pos: torch.Tensor, what: str) -> None:
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
        if end <= start or not self.mode.keeps_rotated or not self.layers[0].allocated:
            return
        pos = self.table.pos[:, start:end]
        for spec, idx in self._groups().values():
            cos, sin = cos_sin(pos, spec, device=self.layers[idx[0]].rot_k.device)
            layers = [self.layers[i] for i in idx]
            _apply_many([l.raw_k[:, :, start:end] for l in layers], [l.rot_k[:, :, start:end] for l in layers],
                        cos[:, None], sin[:, None], spec)

    # -- the write path of an engine forward -----------------------------------------------------------------------

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layers={len(self.layers)}, batch={self.table.batch_size}, "
                f"slots={self.table.n}, bytes={self.nbytes()})")
