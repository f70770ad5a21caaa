"""kvpos: positions as data in the KV cache of RoPE language models.

Core (torch only): RopeSpec / rotate / unrotate, the PositionedKV slot store and its position operations.
transformers-facing names (PositionedCache, load_default_model, ...) are loaded lazily from kvpos.integrations.hf.
"""
from __future__ import annotations

from typing import Any

from .cache import PositionedKV, SlotLayer, SlotTable
from .edits import Delete, Insert, Replace, apply_edits, diff_tokens
from .rope import RopeLayout, RopeSpec, UnsupportedRopeError, cos_sin, rope_specs_from_model, rotate, unrotate
from .store import (ChunkKV, ChunkStore, CorruptChunkError, DiskBackend, Fingerprint, FingerprintMismatch,
                    MemoryBackend, RedisBackend, StoreUnavailable)

__version__ = "0.1.0"
FORMAT_VERSION = 1  # the stored-chunk layout version (kvpos.store.FORMAT_VERSION)

_LAZY = {
    "PositionedCache": "kvpos.integrations.hf",
    "load_default_model": "kvpos.integrations.hf",
    "load_model": "kvpos.integrations.hf",
    "generate": "kvpos.integrations.hf",
    "extend": "kvpos.integrations.hf",
}

__all__ = [
    "RopeLayout", "RopeSpec", "UnsupportedRopeError", "cos_sin", "rope_specs_from_model", "rotate", "unrotate",
    "PositionedKV", "SlotLayer", "SlotTable", "FORMAT_VERSION", "Insert", "Delete", "Replace", "apply_edits",
    "diff_tokens", "ChunkKV", "ChunkStore", "CorruptChunkError", "DiskBackend", "Fingerprint", "FingerprintMismatch",
    "MemoryBackend", "RedisBackend", "StoreUnavailable", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvpos' has no attribute {name!r}")
