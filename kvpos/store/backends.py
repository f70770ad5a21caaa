"""Backends: where entry blobs live (memory LRU, tiered memory over a far backend, disk, Redis). Each stores
opaque blobs under validated keys; verification is the format's job."""
from __future__ import annotations

import math
import os
import re
import tempfile
import threading
from collections import OrderedDict
from typing import Protocol


from .._checks import fail
from .codecs import check_scheme
from .errors import CorruptChunkError, StoreServerError, StoreUnavailable, check_key
from .fingerprint import Fingerprint
from .format import ChunkKV, deserialize, header_fingerprint, header_length, serialize


_UNKNOWN = object()   # peek of a far backend that can only say "exists": the fingerprint is checked by get



class Backend(Protocol):
    def get(self, key: str) -> ChunkKV | None: ...
    def put(self, key: str, chunk: ChunkKV) -> bool: ...
    def delete(self, key: str) -> None: ...
    def contains(self, key: str) -> bool: ...
    # optional: the fingerprint an entry's header claims (None: no entry), reading the header only
    def peek(self, key: str) -> Fingerprint | None: ...


class MemoryBackend:
    """In-process LRU with a byte budget: the sum of stored entries' bytes never exceeds `max_bytes`.

    An entry larger than the budget is not stored (put returns False). Entries are kept as tensors (no copy on get:
    treat them as read-only)."""

    def __init__(self, max_bytes: int = 2 << 30) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            fail("MemoryBackend max_bytes", "a positive int", max_bytes)
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: OrderedDict[str, ChunkKV] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._d)

    def __bool__(self) -> bool:       # an empty backend is still a backend (never replaced by `x or default`)
        return True

    def get(self, key: str) -> ChunkKV | None:
        check_key(key)
        with self._lock:
            c = self._d.get(key)
            if c is not None:
                self._d.move_to_end(key)
            return c

    def put(self, key: str, chunk: ChunkKV) -> bool:
        check_key(key)
        size = chunk.nbytes()
        if size > self.max_bytes:
            return False
        stored = ChunkKV(chunk.ids.clone(), chunk.raw_keys.clone(), chunk.values.clone(), chunk.start,
                         chunk.fingerprint, dict(chunk.meta))
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
        check_key(key)
        with self._lock:
            c = self._d.pop(key, None)
            if c is not None:
                self.bytes -= c.nbytes()

    def contains(self, key: str) -> bool:
        """Whether an entry is held under `key` (not verified: `get` verifies)."""
        return check_key(key) in self._d

    def peek(self, key: str) -> Fingerprint | None:
        c = self._d.get(check_key(key))
        return None if c is None else c.fingerprint

    def keys(self) -> frozenset:
        """The keys held now."""
        with self._lock:
            return frozenset(self._d)


class TieredBackend:
    """A near MemoryBackend in front of a far backend (disk, Redis): gets try near first and copy far hits near;
    puts go far first, then near (a far failure raises and leaves both as they were); deletes remove both.

    Entries in the near tier were verified when they came in (from the far tier) or were computed here."""

    def __init__(self, near: MemoryBackend, far: Backend) -> None:
        if not isinstance(near, MemoryBackend):
            fail("TieredBackend near", "a MemoryBackend", type(near).__name__, exc=TypeError)
        for what in ("get", "put", "delete", "contains"):
            if not callable(getattr(far, what, None)):
                fail("TieredBackend far", f"a backend with {what}()", type(far).__name__, exc=TypeError)
        self.near, self.far = near, far

    def __bool__(self) -> bool:
        return True

    def get(self, key: str) -> ChunkKV | None:
        c = self.near.get(key)
        if c is not None:
            return c
        c = self.far.get(key)
        if c is not None:
            self.near.put(key, c)
        return c

    def put(self, key: str, chunk: ChunkKV) -> bool:
        """Far first, then near; the near tier holds what the far one serves (a quantized far scheme: the chunk as
        it reads back from it), so every engine sharing the far store serves the same KV for one passage."""
        ok = self.far.put(key, chunk)
        scheme = getattr(self.far, "scheme", "float")
        self.near.put(key, chunk if scheme == "float" else deserialize(serialize(chunk, scheme)))
        return ok

    def delete(self, key: str) -> None:
        self.far.delete(key)
        self.near.delete(key)

    def contains(self, key: str) -> bool:
        return self.near.contains(key) or self.far.contains(key)

    def peek(self, key: str) -> Fingerprint | None:
        fp = self.near.peek(key)
        if fp is not None:
            return fp
        peek = getattr(self.far, "peek", None)
        if peek is None:
            return None if not self.far.contains(key) else _UNKNOWN
        return peek(key)


class DiskBackend:
    """One safetensors file per entry under `root`; atomic writes (temp file + fsync + rename). Keys are
    validated and every path is checked to resolve inside the root (symbolic links included)."""

    def __init__(self, root: str | os.PathLike, scheme: str = "float") -> None:
        """scheme: how new entries hold keys and values ("float", "int8" or "int4", see SCHEMES); entries of any scheme
        are read."""
        self.scheme = check_scheme(scheme, "DiskBackend scheme")
        self.root = os.path.realpath(os.fspath(root))
        os.makedirs(self.root, exist_ok=True)

    def path(self, key: str) -> str:
        check_key(key)
        p = os.path.join(self.root, key[:2], f"{key}.safetensors")
        if os.path.commonpath([os.path.realpath(p), self.root]) != self.root:
            fail("store key", f"a path inside {self.root}", os.path.realpath(p), "remove the link that points out")
        return p

    def get(self, key: str) -> ChunkKV | None:
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"disk store {p}: {type(e).__name__}: {e}") from e
        try:
            return deserialize(blob)
        except CorruptChunkError as e:
            raise CorruptChunkError(f"{p}: {e}") from e

    def put(self, key: str, chunk: ChunkKV) -> bool:
        p = self.path(key)
        blob = serialize(chunk, self.scheme)
        os.makedirs(os.path.dirname(p), exist_ok=True)
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

    def contains(self, key: str) -> bool:
        """Whether a file is held under `key` (not verified: `get` verifies)."""
        return os.path.exists(self.path(key))

    def peek(self, key: str) -> Fingerprint | None:
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                head = f.read(8)
                head += f.read(header_length(head) - 8)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"disk store {p}: {type(e).__name__}: {e}") from e
        return header_fingerprint(head)


class RedisBackend:
    """Entries as one blob per key in a redis-server (SET is atomic). Every failure is a StoreUnavailable:
    unreachable or timed out (no retries: `timeout_s` bounds each call), or an error the server answered
    (StoreServerError: out of memory, read-only, ...). A key holding another Redis type is a corrupt entry."""

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, db: int = 0, prefix: str = "kvpos:",
                 timeout_s: float = 5.0, ttl_s: int | None = None, scheme: str = "float") -> None:
        """scheme: how new entries hold keys and values ("float", "int8" or "int4", see SCHEMES); entries of any scheme
        are read."""
        self.scheme = check_scheme(scheme, "RedisBackend scheme")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError("RedisBackend: expected the `redis` package, got none; pip install 'kvpos[redis]'") from e
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
                or timeout_s <= 0:
            fail("RedisBackend timeout_s", "a finite number of seconds > 0", timeout_s)
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s <= 0):
            fail("RedisBackend ttl_s", "None or an int number of seconds > 0", ttl_s)
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9._:-]{0,64}", prefix):
            fail("RedisBackend prefix", "up to 64 characters of [A-Za-z0-9._:-]", repr(prefix))
        self._redis = redis
        self.address = f"{host}:{port}/{db}"
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.timeout_s = float(timeout_s)
        self.client = redis.Redis(host=host, port=port, db=db, socket_timeout=timeout_s,
                                  socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))

    def _call(self, what: str, fn, *args, **kw):
        E = self._redis.exceptions
        try:
            return fn(*args, **kw)
        except E.ResponseError as e:
            if "WRONGTYPE" in str(e):
                raise CorruptChunkError(f"redis {what}: the key holds another Redis type ({e})") from e
            raise StoreServerError(f"redis {what} at {self.address}: the server answered {type(e).__name__}: {e}; "
                                   "fix the server (memory, replica role), or build the ChunkStore with "
                                   "on_unavailable='recompute'") from e
        except (E.RedisError, OSError) as e:
            raise StoreUnavailable(
                f"redis {what}: expected a redis-server at {self.address} answering within {self.timeout_s}s, got "
                f"{type(e).__name__}: {e}; start redis-server, or build the ChunkStore with "
                "on_unavailable='recompute'") from e

    def ping(self) -> bool:
        return bool(self._call("ping", self.client.ping))

    def get(self, key: str) -> ChunkKV | None:
        k = self.prefix + check_key(key)
        blob = self._call("get", self.client.get, k)
        if blob is None:
            return None
        try:
            return deserialize(blob)
        except CorruptChunkError as e:
            raise CorruptChunkError(f"redis key {k}: {e}") from e

    def put(self, key: str, chunk: ChunkKV) -> bool:
        k = self.prefix + check_key(key)
        blob = serialize(chunk, self.scheme)
        self._call("set", self.client.set, k, blob, ex=self.ttl_s)
        return True

    def delete(self, key: str) -> None:
        self._call("delete", self.client.delete, self.prefix + check_key(key))

    def contains(self, key: str) -> bool:
        """Whether the server holds `key` (not verified: `get` verifies)."""
        return bool(self._call("exists", self.client.exists, self.prefix + check_key(key)))

    def peek(self, key: str) -> Fingerprint | None:
        """The fingerprint in the entry's header: one GETRANGE of its first 16 KiB (a second if the header is
        longer), never the tensors."""
        k = self.prefix + check_key(key)
        head = self._call("getrange", self.client.getrange, k, 0, (16 << 10) - 1)
        if not head:
            return None
        n = header_length(head)
        if n > len(head):
            head += self._call("getrange", self.client.getrange, k, len(head), n - 1)
        return header_fingerprint(head)
