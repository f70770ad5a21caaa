"""A real redis-server for the tests (Debian package redis-server): a missing binary is a failure, never a skip."""
import shutil
import socket
import subprocess
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(directory) -> tuple[subprocess.Popen, int]:
    """A real redis-server on 127.0.0.1 (Debian package). A missing binary is a failure, never a skip."""
    from kvpos.store import RedisBackend, StoreUnavailable

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server not found: install the Debian package redis-server (make test / .ci/run do it)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            if RedisBackend(port=port, timeout_s=0.2).ping():
                return proc, port
        except StoreUnavailable:
            time.sleep(0.05)
    proc.kill()
    pytest.fail("redis-server did not start")
