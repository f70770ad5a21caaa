"""Local servers the tests and benchmarks start for themselves.

    proc, port = start_redis(tmp_dir)        # a private redis-server on 127.0.0.1, nothing persisted
    ...
    proc.terminate()
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from typing import Any

__all__ = ["free_port", "start_redis"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(directory: Any, timeout_s: float = 10.0) -> tuple[subprocess.Popen, int]:
    """Start redis-server on 127.0.0.1 at a free port, persisting nothing, working in `directory`; returns
    (process, port) once it answers PING. Raises RuntimeError when the binary is missing or it does not start."""
    from kvpos.store import RedisBackend, StoreUnavailable

    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found: install the Debian package redis-server "
                           "(`make test` and .ci/run do it)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if RedisBackend(port=port, timeout_s=0.2).ping():
                return proc, port
        except StoreUnavailable:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not answer on 127.0.0.1:{port} within {timeout_s} s")
