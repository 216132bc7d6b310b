"""The shared Redis client under a burst (more concurrent commands than it has connections) and
after a Redis restart (every pooled socket dead)."""

from __future__ import annotations

import asyncio

from relaylm.redis_launcher import find_redis_server, start_redis
from shared.redis import MAX_CONNECTIONS, RedisTarget, connect_redis


def test_a_burst_past_the_connection_limit_waits_its_turn(redis_url: str) -> None:
    # redis-py's default pool raises MaxConnectionsError at its 100th concurrent command; a
    # 200-request burst on one API process did exactly that (503 redis_unavailable under load).
    async def burst() -> list[object]:
        redis = connect_redis(RedisTarget(redis_url))
        try:
            # BLPOP on an empty list holds its connection for its whole timeout.
            slow = [redis.blpop(["relaylm-test:never-filled"], timeout=0.3) for _ in range(MAX_CONNECTIONS)]
            fast = [redis.ping() for _ in range(3 * MAX_CONNECTIONS)]
            return await asyncio.gather(*slow, *fast)
        finally:
            await redis.aclose()

    results = asyncio.run(burst())
    assert results[:MAX_CONNECTIONS] == [None] * MAX_CONNECTIONS
    assert results[MAX_CONNECTIONS:] == [True] * (3 * MAX_CONNECTIONS)


def test_every_pooled_connection_recovers_after_a_redis_restart() -> None:
    # A restart leaves each pooled socket dead; each one used to fail one request (503) after Redis
    # was back. Now a dead socket is replaced and the command sent again, once.
    binary = find_redis_server()
    assert binary is not None
    first = start_redis(binary)
    assert first.process is not None
    killed = first.process
    port = int(first.url.rsplit(":", 1)[1].split("/")[0])

    async def scenario() -> list[object]:
        redis = connect_redis(RedisTarget(first.url))
        try:
            # Sixteen connections in the pool, each held open by a short BLPOP at once.
            await asyncio.gather(*(redis.blpop(["relaylm-test:empty"], timeout=0.1) for _ in range(16)))
            killed.kill()
            killed.wait()
            second = start_redis(binary, port=port)
            try:
                assert second.url == first.url
                return [await redis.set(f"relaylm-test:after-restart:{i}", i) for i in range(32)]
            finally:
                second.stop()
        finally:
            await redis.aclose()

    try:
        assert asyncio.run(scenario()) == [True] * 32
    finally:
        first.stop()
