"""A real redis-server for the tests (Debian package redis-server): a missing binary is a failure, never a skip."""
import pytest

from kvpos.integrations.servers import free_port, start_redis as _start

__all__ = ["free_port", "start_redis"]


def start_redis(directory):
    try:
        return _start(directory)
    except RuntimeError as e:
        pytest.fail(str(e))
