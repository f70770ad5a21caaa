"""The positioned KV cache (a package, one job per file): per-layer UNROTATED keys + rotated keys + values, and
one slot table of positions.

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

Rooms:
  buffers.py    allocation and geometric / fixed growth (all-or-nothing), the shared limits
  table.py      SlotTable: positions, visibility, segments
  layers.py     one class per storage behind one interface: SlotLayer (the interface), RawSlotLayer ("raw"),
                RotatedSlotLayer ("rotated"); layer_class(mode) picks one
  layers_int8.py  QuantSlotLayer ("int8": key / value codes + scales)
  reads.py      rotate-on-read, fused decode reads, int8 dequantizing reads
  forward.py    the forward write transaction (begin at the first layer, commit at the last, rollback), appending(),
                overwriting()
  positions.py  shift / set / delete / keep / hide / segment operations
  structure.py  append stored raw KV, reserve, copy, concat, from_rotated, crop, reorder rows, reset
  storages.py   StorageMode: each storage mode's capabilities; storage_mode() resolves storage= once
  kv.py         PositionedKV: construction, properties, validation; composes the four operation mixins
"""
from __future__ import annotations

from .buffers import GROWTH, MAX_POSITION, SEGMENT_RANGE
from .forward import ForwardWriter
from .kv import PositionedKV
from .layers import RawSlotLayer, RotatedSlotLayer, SlotLayer, layer_class
from .layers_int8 import QuantSlotLayer
from .storages import INT8, RAW, ROTATED, STORAGE_MODES, STORAGES, StorageMode, storage_mode
from .table import SlotTable

__all__ = ["ForwardWriter", "SlotLayer", "RawSlotLayer", "RotatedSlotLayer", "QuantSlotLayer", "layer_class", "SlotTable", "PositionedKV", "GROWTH", "MAX_POSITION", "SEGMENT_RANGE",
           "STORAGES", "StorageMode", "storage_mode", "STORAGE_MODES", "ROTATED", "RAW", "INT8"]
