"""The shared Redis client under a burst: more concurrent commands than it has connections."""

from __future__ import annotations

import asyncio

from shared.connection import MAX_CONNECTIONS, connect_redis


def test_a_burst_past_the_connection_limit_waits_its_turn(redis_url: str) -> None:
    # redis-py's default pool raises MaxConnectionsError at its 100th concurrent command; a
    # 200-request burst on one API process did exactly that (503 redis_unavailable under load).
    async def burst() -> list[object]:
        redis = connect_redis(redis_url)
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
