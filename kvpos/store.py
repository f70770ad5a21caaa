"""ChunkStore: a chunk's KV (raw keys + values) computed once, kept under a content key, checked by a fingerprint.

Letters: L layers · H kv heads · S chunk tokens · D head_dim.

An entry holds, for one chunk of token ids encoded after an anchor prefix:

    ids    [S]           int64 token ids (the content)
    raw_keys [L, H, S, D]  keys before RoPE, model dtype (stored under the tensor name "keys")
    values [L, H, S, D]  values
    start  int           the position of the chunk's first token when it was encoded (= anchor length)
    fingerprint          model config, weights identity, dtype, anchor ids, RoPE, kvpos format version

Keys are content addresses: sha256 of the token ids, under a namespace. The fingerprint is not part of the key: an
entry made by another model, dtype or anchor is found and *refused* with an error that names both fingerprints
(or recomputed, with on_mismatch="recompute"), never silently used. Use one namespace per model to share a store.

Backends (all store one self-describing safetensors blob per entry; the disk and Redis ones verify a checksum):
  MemoryBackend  LRU with a byte budget, never exceeded
  DiskBackend    one file per entry, written to a temp file then renamed (atomic); never pickle
  RedisBackend   a redis-server shared by processes/machines; SET of one blob (atomic)
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

import torch

from ._checks import fail

__all__ = [
    "ChunkKV", "Fingerprint", "ChunkStore", "MemoryBackend", "DiskBackend", "RedisBackend",
    "FingerprintMismatch", "CorruptChunkError", "StoreUnavailable", "content_key", "model_fingerprint",
]

FORMAT_VERSION = 1


class FingerprintMismatch(ValueError):
    """A stored chunk was computed under another model / dtype / anchor / format."""


class CorruptChunkError(ValueError):
    """A stored entry is truncated, altered or unreadable."""


class StoreUnavailable(ConnectionError):
    """The backend (e.g. redis-server) cannot be reached."""


# ---------------------------------------------------------------------------------------------------------------------
# fingerprints
# ---------------------------------------------------------------------------------------------------------------------

def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ids_digest(ids: torch.Tensor) -> str:
    """sha256 of int64 token ids (the content address of a chunk or an anchor)."""
    return _sha(torch.as_tensor(ids, dtype=torch.long).flatten().numpy().tobytes())


@dataclass(frozen=True)
class Fingerprint:
    """Identity of everything a chunk's KV depends on besides its own tokens."""

    model: str       # sha256 of the model config
    weights: str     # sha256 over every parameter's shape/dtype and a strided sample of its bytes
    dtype: str
    anchor: str      # sha256 of the anchor prefix ids
    rope: str        # sha256 of the per-layer RoPE specs
    format: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "Fingerprint":
        try:
            return cls(**json.loads(s))
        except (TypeError, ValueError) as e:
            raise CorruptChunkError(f"fingerprint: expected a JSON object of {sorted(cls.__annotations__)}, got {s[:80]!r}") from e

    def short(self) -> str:
        return (f"model={self.model[:10]} weights={self.weights[:10]} dtype={self.dtype} anchor={self.anchor[:10]} "
                f"rope={self.rope[:10]} format={self.format}")

    def with_anchor(self, anchor_ids: torch.Tensor) -> "Fingerprint":
        return Fingerprint(self.model, self.weights, self.dtype, ids_digest(anchor_ids), self.rope, self.format)


def _config_digest(config: Any) -> str:
    d = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    for k in ("_name_or_path", "transformers_version", "_attn_implementation", "_attn_implementation_internal",
              "dtype", "torch_dtype", "_commit_hash"):
        d.pop(k, None)
    return _sha(json.dumps(d, sort_keys=True, default=str).encode())


@torch.no_grad()
def _weights_digest(model: torch.nn.Module, sample: int = 4096) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // sample)
        part = flat[::step][:sample].float().cpu().numpy().tobytes()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(part)
    return h.hexdigest()


def model_fingerprint(model: torch.nn.Module, anchor_ids: torch.Tensor, specs: Iterable[Any] = ()) -> Fingerprint:
    """Fingerprint of (model config, weights, dtype, anchor ids, RoPE specs, kvpos format). Weights are hashed once
    per model object (cached on it)."""
    w = getattr(model, "_kvpos_weights_digest", None)
    if w is None:
        w = _weights_digest(model)
        try:
            model._kvpos_weights_digest = w
        except AttributeError:
            pass
    cfg = getattr(model, "config", None)
    rope = _sha(json.dumps([s.describe() for s in specs], sort_keys=True).encode())
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return Fingerprint(_config_digest(cfg) if cfg is not None else "none", w, dtype, ids_digest(anchor_ids), rope)


# ---------------------------------------------------------------------------------------------------------------------
# entries
# ---------------------------------------------------------------------------------------------------------------------

@dataclass
class ChunkKV:
    """One chunk's KV: ids [S], raw_keys / values [L, H, S, D] (keys before RoPE), encoded at positions
    start..start+S-1."""

    ids: torch.Tensor
    raw_keys: torch.Tensor
    values: torch.Tensor
    start: int
    fingerprint: Fingerprint
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.raw_keys.dim() != 4:
            fail("ChunkKV.raw_keys", "[L, H, S, D]", tuple(self.raw_keys.shape))
        if self.values.dim() != 4 or self.values.shape[:3] != self.raw_keys.shape[:3]:
            fail("ChunkKV.values", f"[L, H, S, D] with L, H, S of keys {tuple(self.raw_keys.shape)}",
                 tuple(self.values.shape))
        if self.ids.dim() != 1 or self.ids.numel() != self.raw_keys.shape[-2]:
            fail("ChunkKV.ids", f"[S]={self.raw_keys.shape[-2]} token ids", tuple(self.ids.shape))

    @property
    def num_tokens(self) -> int:
        return int(self.ids.numel())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.raw_keys, self.values))

    @classmethod
    def from_raw_kv(cls, ids: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], start: int,
                    fingerprint: "Fingerprint", meta: dict | None = None) -> "ChunkKV":
        """A chunk from per-layer (raw_keys [1, H, S, D], values [1, H, S, D]), e.g. PositionedKV.raw_kv(a, b)."""
        keys = torch.stack([k[0] for k, _ in kv]).contiguous()
        values = torch.stack([v[0] for _, v in kv]).contiguous()
        return cls(torch.as_tensor(ids, dtype=torch.long).flatten().clone(), keys, values, start, fingerprint,
                   dict(meta or {}))

    def layer_kv(self, start: int = 0, end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (raw_keys [1, H, s, D], values [1, H, s, D]) of tokens [start, end): views, no copy."""
        end = self.num_tokens if end is None else end
        return [(self.raw_keys[i, None, :, start:end], self.values[i, None, :, start:end]) for i in range(self.raw_keys.shape[0])]


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def serialize(chunk: ChunkKV) -> bytes:
    """One safetensors blob: tensors + metadata (fingerprint, start, checksum, format). No pickle anywhere."""
    from safetensors.torch import save

    tensors = {"ids": chunk.ids.contiguous(), "keys": chunk.raw_keys.contiguous(), "values": chunk.values.contiguous()}
    meta = {"format": str(FORMAT_VERSION), "start": str(int(chunk.start)), "fingerprint": chunk.fingerprint.to_json(),
            "checksum": _checksum(tensors), "meta": json.dumps(chunk.meta)}
    return save(tensors, metadata=meta)


def _header(blob: bytes) -> dict:
    if len(blob) < 8:
        raise CorruptChunkError(f"entry: expected a safetensors blob, got {len(blob)} bytes")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8 or n > 100_000_000:
        raise CorruptChunkError(f"entry: header of {n} bytes in a blob of {len(blob)} (truncated)")
    try:
        return json.loads(blob[8:8 + n])
    except ValueError as e:
        raise CorruptChunkError("entry: unreadable safetensors header") from e


def deserialize(blob: bytes) -> ChunkKV:
    """Parse and verify a blob; raises CorruptChunkError on truncation, alteration or a foreign format."""
    from safetensors.torch import load

    meta = _header(blob).get("__metadata__") or {}
    if meta.get("format") != str(FORMAT_VERSION):
        raise CorruptChunkError(f"entry: expected kvpos format {FORMAT_VERSION}, got {meta.get('format')!r}")
    try:
        tensors = load(blob)
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for damaged data
        raise CorruptChunkError(f"entry: unreadable tensors ({type(e).__name__}: {e})") from e
    if set(tensors) != {"ids", "keys", "values"}:
        raise CorruptChunkError(f"entry: expected tensors ids/keys/values, got {sorted(tensors)}")
    if _checksum(tensors) != meta.get("checksum"):
        raise CorruptChunkError("entry: checksum mismatch (the stored bytes were altered)")
    return ChunkKV(tensors["ids"], tensors["keys"], tensors["values"], int(meta["start"]),
                   Fingerprint.from_json(meta["fingerprint"]), json.loads(meta.get("meta", "{}")))


# ---------------------------------------------------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------------------------------------------------

class Backend(Protocol):
    def get(self, key: str) -> ChunkKV | None: ...
    def put(self, key: str, chunk: ChunkKV) -> bool: ...
    def delete(self, key: str) -> None: ...


class MemoryBackend:
    """In-process LRU with a byte budget: the sum of stored entries' bytes never exceeds `max_bytes`.

    An entry larger than the budget is not stored (put returns False). Entries are kept as tensors (no copy on get:
    treat them as read-only)."""

    def __init__(self, max_bytes: int = 2 << 30) -> None:
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            fail("MemoryBackend max_bytes", "a positive int", max_bytes)
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: OrderedDict[str, ChunkKV] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: str) -> ChunkKV | None:
        with self._lock:
            c = self._d.get(key)
            if c is not None:
                self._d.move_to_end(key)
            return c

    def put(self, key: str, chunk: ChunkKV) -> bool:
        size = chunk.nbytes()
        if size > self.max_bytes:
            return False
        stored = ChunkKV(chunk.ids.clone(), chunk.raw_keys.clone(), chunk.values.clone(), chunk.start, chunk.fingerprint,
                         dict(chunk.meta))
        with self._lock:
            if key in self._d:
                self.bytes -= self._d.pop(key).nbytes()
            while self._d and self.bytes + size > self.max_bytes:
                _, old = self._d.popitem(last=False)
                self.bytes -= old.nbytes()
                self.evictions += 1
            self._d[key] = stored
            self.bytes += size
            assert self.bytes <= self.max_bytes, "MemoryBackend: byte budget exceeded"
        return True

    def delete(self, key: str) -> None:
        with self._lock:
            c = self._d.pop(key, None)
            if c is not None:
                self.bytes -= c.nbytes()


class DiskBackend:
    """One safetensors file per entry under `root`; atomic writes (temp file + fsync + rename)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.fspath(root)
        os.makedirs(self.root, exist_ok=True)

    def path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], f"{key}.safetensors")

    def get(self, key: str) -> ChunkKV | None:
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        try:
            return deserialize(blob)
        except CorruptChunkError as e:
            raise CorruptChunkError(f"{p}: {e}") from e

    def put(self, key: str, chunk: ChunkKV) -> bool:
        p = self.path(key)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        blob = serialize(chunk)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(p), prefix=".tmp-", suffix=".safetensors")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return True

    def delete(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass


class RedisBackend:
    """Entries as one blob per key in a redis-server (SET is atomic). Connection problems raise StoreUnavailable."""

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, db: int = 0, prefix: str = "kvpos:",
                 timeout_s: float = 5.0, ttl_s: int | None = None) -> None:
        try:
            import redis
        except ImportError as e:
            raise ImportError("RedisBackend: expected the `redis` package, got none; pip install 'kvpos[redis]'") from e
        self._redis = redis
        self.address = f"{host}:{port}/{db}"
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.client = redis.Redis(host=host, port=port, db=db, socket_timeout=timeout_s,
                                  socket_connect_timeout=timeout_s)

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except (self._redis.exceptions.ConnectionError, self._redis.exceptions.TimeoutError, OSError) as e:
            raise StoreUnavailable(
                f"redis {what}: expected a redis-server at {self.address}, got {type(e).__name__}: {e}; start "
                "redis-server, or build the ChunkStore with on_unavailable='recompute'") from e

    def ping(self) -> bool:
        return bool(self._call("ping", self.client.ping))

    def get(self, key: str) -> ChunkKV | None:
        blob = self._call("get", self.client.get, self.prefix + key)
        if blob is None:
            return None
        try:
            return deserialize(blob)
        except CorruptChunkError as e:
            raise CorruptChunkError(f"redis key {self.prefix + key}: {e}") from e

    def put(self, key: str, chunk: ChunkKV) -> bool:
        blob = serialize(chunk)
        if self.ttl_s:
            self._call("set", self.client.set, self.prefix + key, blob, self.ttl_s)
        else:
            self._call("set", self.client.set, self.prefix + key, blob)
        return True

    def delete(self, key: str) -> None:
        self._call("delete", self.client.delete, self.prefix + key)


# ---------------------------------------------------------------------------------------------------------------------
# the store
# ---------------------------------------------------------------------------------------------------------------------

def content_key(ids: torch.Tensor, namespace: str = "default") -> str:
    """Storage key of a chunk: namespace + sha256 of its int64 token ids."""
    return f"{namespace}-{ids_digest(ids)}"


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
    as a miss (the caller recomputes and overwrites it). Corrupt entries are always reported in `stats` and treated
    as misses (deleted, then recomputed by the caller); with strict=True they raise CorruptChunkError instead.
    on_unavailable: "error" (default) raises StoreUnavailable; "recompute" reports it and treats it as a miss.
    """

    def __init__(self, backend: Backend, fingerprint: Fingerprint, namespace: str = "default",
                 on_mismatch: str = "error", on_unavailable: str = "error", strict: bool = False) -> None:
        if on_mismatch not in ("error", "recompute"):
            fail("ChunkStore on_mismatch", "'error' or 'recompute'", repr(on_mismatch))
        if on_unavailable not in ("error", "recompute"):
            fail("ChunkStore on_unavailable", "'error' or 'recompute'", repr(on_unavailable))
        if not isinstance(fingerprint, Fingerprint):
            fail("ChunkStore fingerprint", "a Fingerprint", type(fingerprint).__name__, exc=TypeError)
        self.backend = backend
        self.fingerprint = fingerprint
        self.namespace = namespace
        self.on_mismatch = on_mismatch
        self.on_unavailable = on_unavailable
        self.strict = strict
        self.stats = StoreStats()

    def key(self, ids: torch.Tensor) -> str:
        return content_key(ids, self.namespace)

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
            self.stats.note("corrupt", key, "ids differ from the key (hash collision or tampering)")
            return None
        self.stats.hits += 1
        return chunk

    def put(self, chunk: ChunkKV) -> bool:
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
