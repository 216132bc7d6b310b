"""Reading a job's event log: every event a worker sent, in order (the Redis Stream beside the
pub/sub channel). The API fills gaps and replays reconnects from it; a worker resumes a job
whose worker died from the token ids in it."""

from __future__ import annotations

from redis.asyncio import Redis

from shared.events import AnyEvent, decode_event
from shared.redis_keys import RedisKeys


async def read_event_log(redis: Redis, keys: RedisKeys, job_id: str) -> list[AnyEvent]:
    entries = await redis.xrange(keys.job_event_log(job_id))
    return [decode_event(fields[b"e"]) for _entry_id, fields in entries]
