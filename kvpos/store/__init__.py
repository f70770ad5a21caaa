"""The chunk store: a chunk's KV (raw keys + values) computed once, kept under a content key, checked by a
fingerprint, verified byte for byte before use.

Rooms (each file one job; what each may import):
  errors.py       exceptions; the names a key or namespace may have                      (nothing of the store)
  fingerprint.py  Fingerprint and the digests of config, weights, anchor, RoPE           errors
  codecs.py       the int8 / int4 schemes' quantizers                                    (nothing of the store)
  format.py       ChunkKV, serialize / deserialize, header reads: the entry format,      errors, fingerprint, codecs
                  specified byte for byte in FORMAT.md beside this file
  backends.py     where blobs live: MemoryBackend (LRU, byte budget), TieredBackend      errors, fingerprint, format
                  (memory over a far backend), DiskBackend (one file per entry, atomic
                  rename), RedisBackend (shared by processes and machines)
  chunk_store.py  content_key, StoreStats, ChunkStore (get / put / contains)            all of the above

Keys are content addresses: namespace + sha256 of the token ids (and of the anchor). An entry made by another model,
dtype, weights or anchor is found and refused with an error that names both fingerprints (or recomputed, with
on_mismatch="recompute"), never silently used. Any damage surfaces as CorruptChunkError; the store drops the entry
and the caller recomputes it. Nothing is ever pickled or evaluated; no key reaches a path outside a DiskBackend's
root.
"""
from __future__ import annotations

from .backends import Backend, DiskBackend, MemoryBackend, RedisBackend, TieredBackend
from .chunk_store import ChunkStore, StoreStats, content_key
from .codecs import INT4_GROUP, SCHEMES, check_scheme, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from .errors import (CorruptChunkError, FingerprintMismatch, StoreServerError, StoreUnavailable, check_key,
                     check_namespace)
from .fingerprint import (FORMAT_VERSION, Fingerprint, WeightsDigest, checkpoint_digest, config_digest, ids_digest,
                          model_fingerprint, rope_digest, tensors_digest)
from .format import ChunkKV, _checksum, deserialize, header_fingerprint, header_length, serialize  # noqa: F401

__all__ = [
    "ChunkKV", "Fingerprint", "ChunkStore", "MemoryBackend", "DiskBackend", "RedisBackend", "TieredBackend",
    "StoreStats", "Backend",
    "FingerprintMismatch", "CorruptChunkError", "StoreUnavailable", "StoreServerError", "content_key",
    "model_fingerprint", "WeightsDigest", "serialize", "deserialize", "FORMAT_VERSION", "check_key",
    "check_namespace", "tensors_digest", "checkpoint_digest", "rope_digest", "config_digest", "SCHEMES",
    "quantize_int8", "dequantize_int8", "quantize_int4", "dequantize_int4", "INT4_GROUP", "header_fingerprint",
    "header_length", "ids_digest", "check_scheme",
]
