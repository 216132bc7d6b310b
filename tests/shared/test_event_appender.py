"""EventAppender's round trips: one per append, and a script cache Redis lost is refilled."""

from __future__ import annotations

import uuid

import redis as sync_redis

from shared.job_lifecycle import AppendRequest, AppendStatus, EventAppender
from shared.redis_keys import RedisKeys


def _script_exists_calls(client: sync_redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_script|exists", {}).get("calls", 0))


def test_an_append_after_the_script_cache_was_flushed_loads_it_and_checks_nothing_per_call(redis_url: str) -> None:
    client = sync_redis.Redis.from_url(redis_url)
    try:
        appender = EventAppender(client, RedisKeys(f"t{uuid.uuid4().hex[:8]}"))
        client.script_flush()  # as after a Redis restart
        unknown = [AppendRequest(f"no-such-job-{i}", 1, [(0, b"{}")], None) for i in range(3)]
        assert [reply.status for reply in appender.append(unknown)] == [AppendStatus.REFUSED] * 3
        before = _script_exists_calls(client)
        assert [reply.status for reply in appender.append(unknown)] == [AppendStatus.REFUSED] * 3
        assert _script_exists_calls(client) == before  # no SCRIPT EXISTS round trip per step
    finally:
        client.close()
