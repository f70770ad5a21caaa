"""Store errors and the names a key or namespace may have (nothing else reaches a path or a server)."""
from __future__ import annotations

import re
from typing import Any


from .._checks import fail


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


class FingerprintMismatch(ValueError):
    """A stored chunk was computed under another model / weights / dtype / anchor / format."""


class CorruptChunkError(ValueError):
    """A stored entry is truncated, altered, crafted or unreadable."""


class StoreUnavailable(ConnectionError):
    """The backend (e.g. redis-server) cannot serve the request: unreachable, timed out, or failing."""


class StoreServerError(StoreUnavailable):
    """The server answered with an error (out of memory under noeviction, read-only replica, ...)."""


def check_namespace(namespace: Any) -> str:
    """A namespace: 1-64 characters of [A-Za-z0-9._-], starting with a letter or digit, no '..'."""
    if not isinstance(namespace, str) or not _NAME.fullmatch(namespace) or len(namespace) > 64 or ".." in namespace:
        fail("namespace", "1-64 characters of [A-Za-z0-9._-] starting with a letter or digit, without '..'",
             repr(namespace), "namespaces become part of storage keys and file names")
    return namespace


def check_key(key: Any) -> str:
    """A storage key: 1-200 characters of [A-Za-z0-9._-], starting with a letter or digit, no '..'."""
    if not isinstance(key, str) or not _NAME.fullmatch(key) or ".." in key:
        fail("store key", "1-200 characters of [A-Za-z0-9._-] starting with a letter or digit, without '..'",
             repr(key)[:80], "keys come from content_key(ids, namespace)")
    return key
