"""ChunkStore: content keys, per-store statistics and the verified get / put / contains over a backend."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._checks import fail
from .backends import _UNKNOWN, Backend
from .errors import CorruptChunkError, FingerprintMismatch, StoreUnavailable, check_namespace
from .fingerprint import Fingerprint, _sha, ids_digest
from .format import ChunkKV


def content_key(ids: torch.Tensor, namespace: str = "default", anchor: str = "") -> str:
    """Storage key of a chunk: namespace + sha256 of its int64 token ids, and of the anchor digest it was encoded
    after (Fingerprint.anchor) when one is given: the same passage under two anchors is two entries."""
    digest = ids_digest(ids)
    if anchor:
        digest = _sha(f"{anchor}|{digest}".encode())
    return f"{check_namespace(namespace)}-{digest}"


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    mismatches: int = 0
    corrupt: int = 0
    unavailable: int = 0
    events: list = field(default_factory=list)

    def note(self, kind: str, key: str, detail: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.events.append({"kind": kind, "key": key, "detail": detail})
        del self.events[:-100]


class ChunkStore:
    """Chunk KV by content key, checked against this store's fingerprint on every read.

    on_mismatch: "error" (default) raises FingerprintMismatch naming both fingerprints; "recompute" treats the entry
    as a miss (the caller recomputes and overwrites it). Corrupt entries (any damage, any crafted field) are always
    reported in `stats`, deleted and treated as misses (the caller recomputes them); with strict=True they raise
    CorruptChunkError instead (and stay, for inspection). on_unavailable: "error" (default) raises StoreUnavailable; "recompute" reports it and
    treats it as a miss (get) or a skipped write (put).
    """

    def __init__(self, backend: Backend, fingerprint: Fingerprint, namespace: str = "default",
                 on_mismatch: str = "error", on_unavailable: str = "error", strict: bool = False) -> None:
        if on_mismatch not in ("error", "recompute"):
            fail("ChunkStore on_mismatch", "'error' or 'recompute'", repr(on_mismatch))
        if on_unavailable not in ("error", "recompute"):
            fail("ChunkStore on_unavailable", "'error' or 'recompute'", repr(on_unavailable))
        if not isinstance(fingerprint, Fingerprint):
            fail("ChunkStore fingerprint", "a Fingerprint", type(fingerprint).__name__, exc=TypeError)
        if backend is None or not all(callable(getattr(backend, m, None)) for m in ("get", "put", "delete")):
            fail("ChunkStore backend", "a backend with get/put/delete (MemoryBackend, DiskBackend, RedisBackend)",
                 type(backend).__name__, exc=TypeError)
        self.backend = backend
        self.fingerprint = fingerprint
        self.namespace = check_namespace(namespace)
        self.on_mismatch = on_mismatch
        self.on_unavailable = on_unavailable
        self.strict = strict
        self.stats = StoreStats()

    def with_fingerprint(self, fingerprint: Fingerprint) -> "ChunkStore":
        """The same backend, namespace and settings (stats shared) under another fingerprint (e.g. new weights)."""
        out = ChunkStore(self.backend, fingerprint, self.namespace, self.on_mismatch, self.on_unavailable,
                         self.strict)
        out.stats = self.stats
        return out

    def key(self, ids: torch.Tensor) -> str:
        return content_key(ids, self.namespace, self.fingerprint.anchor)

    def contains(self, ids: torch.Tensor) -> bool:
        """Whether an entry for `ids` is stored under this store's fingerprint: the header's claim where the backend
        can read headers alone (`peek`: memory, disk, Redis), existence otherwise. Cheap and unverified: `get`
        verifies every byte and may still miss. An unavailable backend answers False under
        on_unavailable='recompute'; an unreadable header is False (`get` drops the entry)."""
        key = self.key(ids)
        peek = getattr(self.backend, "peek", None)
        try:
            if peek is None:
                return self.backend.contains(key)
            fp = peek(key)
            return fp is _UNKNOWN or fp == self.fingerprint
        except CorruptChunkError:
            return False
        except StoreUnavailable as e:
            if self.on_unavailable == "error":
                raise
            self.stats.note("unavailable", key, str(e))
            return False

    def get(self, ids: torch.Tensor) -> ChunkKV | None:
        """The stored chunk for `ids`, or None (miss). See the class docstring for mismatches and damage."""
        key = self.key(ids)
        try:
            chunk = self.backend.get(key)
        except StoreUnavailable as e:
            if self.on_unavailable == "error":
                raise
            self.stats.note("unavailable", key, str(e))
            return None
        except CorruptChunkError as e:
            if self.strict:
                raise
            self.stats.note("corrupt", key, str(e))
            self._delete_quietly(key)
            return None
        if chunk is None:
            self.stats.misses += 1
            return None
        if chunk.fingerprint != self.fingerprint:
            msg = (f"chunk {key[:24]}: computed with [{chunk.fingerprint.short()}], this store serves "
                   f"[{self.fingerprint.short()}]; recompute the chunk, use another namespace, or pass "
                   "on_mismatch='recompute'")
            if self.on_mismatch == "error":
                raise FingerprintMismatch(msg)
            self.stats.note("mismatches", key, msg)
            return None
        if not torch.equal(chunk.ids, torch.as_tensor(ids, dtype=torch.long).flatten()):
            if self.strict:
                raise CorruptChunkError(f"chunk {key[:24]}: ids differ from the key")
            self.stats.note("corrupt", key, "ids differ from the key (hash collision or tampering)")
            self._delete_quietly(key)
            return None
        self.stats.hits += 1
        return chunk

    def put(self, chunk: ChunkKV) -> bool:
        if not isinstance(chunk, ChunkKV):
            fail("ChunkStore.put chunk", "a ChunkKV", type(chunk).__name__, exc=TypeError)
        if chunk.fingerprint != self.fingerprint:
            fail("ChunkStore.put chunk", f"fingerprint [{self.fingerprint.short()}]", f"[{chunk.fingerprint.short()}]")
        key = self.key(chunk.ids)
        try:
            return self.backend.put(key, chunk)
        except StoreUnavailable as e:
            if self.on_unavailable == "error":
                raise
            self.stats.note("unavailable", key, str(e))
            return False

    def _delete_quietly(self, key: str) -> None:
        try:
            self.backend.delete(key)
        except StoreUnavailable:
            pass
