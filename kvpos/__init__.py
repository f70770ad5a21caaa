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
  storage       how a cache holds its keys (`storage=`): "rotated" (raw + rotated keys), "raw" (raw keys only,
                rotated on read) or "int8" (raw keys and values as int8 codes with per-channel scales over 32-slot
                groups); a property of a cache, never of the store
  read          how attention gets rotated keys from raw storage (`read=`): "auto", "fused" (the C decode kernel
                rotates each key in registers) or "torch" (rotate into a buffer); rotated storage has no read mode
  store         the chunk store (ChunkStore over a memory / disk / Redis backend): entries of chunk KV kept across
                requests and processes; not the cache's storage, not the windowed far store (FarStore)
  scheme        how a store entry encodes its tensors: "float", "int8" or "int4" (per channel over the whole chunk)
  far store     FarStore: the windowed-retrieval index of far keys (int8, searchable), inside one cache
  fingerprint   what makes stored KV valid for a model: weights digest, RoPE spec, dtype, tokenizer (Fingerprint)

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
from .rope import RopeLayout, RopeSpec, UnsupportedRopeError, cos_sin, rotate, unrotate
from .store import (FORMAT_VERSION, ChunkKV, ChunkStore, CorruptChunkError, DiskBackend, Fingerprint,
                    FingerprintMismatch, MemoryBackend, RedisBackend, StoreUnavailable)

__version__ = "0.2.0"

__all__ = [
    "RopeLayout", "RopeSpec", "UnsupportedRopeError", "cos_sin", "rotate", "unrotate",
    "PositionedKV", "SlotLayer", "SlotTable", "FORMAT_VERSION", "Insert", "Delete", "Replace", "Strategy",
    "apply_edits", "diff_tokens", "ChunkKV", "ChunkStore", "CorruptChunkError", "DiskBackend", "Fingerprint",
    "FingerprintMismatch", "MemoryBackend", "RedisBackend", "StoreUnavailable",
]


def __getattr__(name: str):
    """`kvpos.rope_specs_from_model` moved to kvpos.integrations.hf (transformers introspection is not the core's
    job): kept as a deprecated alias for code that imported it from here."""
    if name == "rope_specs_from_model":
        import importlib
        import warnings

        warnings.warn("kvpos.rope_specs_from_model moved: import it from kvpos.integrations.hf", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module("kvpos.integrations.hf.specs").rope_specs_from_model
    raise AttributeError(f"module 'kvpos' has no attribute {name!r}")
