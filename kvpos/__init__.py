"""kvpos: positions as data in the KV cache of RoPE language models (the torch-only core).

Glossary (one meaning per name):
  slot          one cached token's storage: a raw key, a rotated key and a value per layer, plus a table entry
  position      the int64 RoPE position a slot's key is rotated to (data: shift it, set it, reuse it)
  segment       an int32 label per slot (anchor / chunk i / query), read by attention backends such as APE
  chunk         a token sequence whose raw KV is computed once (after an anchor) and stored (ChunkKV, ChunkStore)
  anchor        the shared prefix every chunk was encoded after (system prompt + template head)
  raw keys      keys before RoPE: the source of truth, rotated once whenever a position changes
  rotated keys  raw keys rotated to their slot's current position: what attention reads
  cache         a PositionedKV (engine-neutral) or its transformers shim PositionedCache; nothing else

Shape letters (used in every docstring): B batch · H kv heads · Hq query heads · G = Hq / H · T cached slots ·
S new slots or tokens · N keys an attention call reads · D head_dim · R rotary_dim · L layers · V vocab ·
C buffer capacity · F far slots · W local slots (sinks + window) · A anchor tokens · q queries.

Floors: kvpos/ is torch only (RoPE, storage, position operations, composition plans, APE and windowed attention
mathematics, edit planning and the strategy grammar, the chunk store, data helpers). Engine glue lives in
kvpos.integrations (transformers: kvpos.integrations.hf).
"""
from __future__ import annotations

from .cache import PositionedKV, SlotLayer, SlotTable
from .edits import Delete, Insert, Replace, Strategy, apply_edits, diff_tokens
from .rope import RopeLayout, RopeSpec, UnsupportedRopeError, cos_sin, rope_specs_from_model, rotate, unrotate
from .store import (FORMAT_VERSION, ChunkKV, ChunkStore, CorruptChunkError, DiskBackend, Fingerprint,
                    FingerprintMismatch, MemoryBackend, RedisBackend, StoreUnavailable)

__version__ = "0.2.0"

__all__ = [
    "RopeLayout", "RopeSpec", "UnsupportedRopeError", "cos_sin", "rope_specs_from_model", "rotate", "unrotate",
    "PositionedKV", "SlotLayer", "SlotTable", "FORMAT_VERSION", "Insert", "Delete", "Replace", "Strategy",
    "apply_edits", "diff_tokens", "ChunkKV", "ChunkStore", "CorruptChunkError", "DiskBackend", "Fingerprint",
    "FingerprintMismatch", "MemoryBackend", "RedisBackend", "StoreUnavailable",
]
