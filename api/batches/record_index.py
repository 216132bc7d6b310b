"""Paging through records listed in a Redis sorted set (files, batches): ids come from the index
by creation time, records from their own keys; ids whose record expired are pruned on the way."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from redis.asyncio import Redis

from shared.redis_replies import as_bytes, texts

Record = TypeVar("Record")
_CHUNK = 256


async def page_of_records(
    redis: Redis,
    index_key: str,
    record_key: Callable[[str], str],
    parse: Callable[[bytes], Record],
    limit: int,
    after: str | None,
    newest_first: bool = True,
    keep: Callable[[Record], bool] | None = None,
) -> tuple[list[Record], bool]:
    """Up to ``limit`` records after the id ``after`` (that ``keep`` accepts), and whether more follow."""
    ids = texts(await redis.zrange(index_key, 0, -1, desc=newest_first))
    if after is not None:
        ids = ids[ids.index(after) + 1 :] if after in ids else []
    found: list[Record] = []
    expired: list[str] = []
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        for record_id, raw in zip(chunk, await redis.mget([record_key(i) for i in chunk]), strict=True):
            if raw is None:
                expired.append(record_id)
                continue
            record = parse(as_bytes(raw))
            if keep is None or keep(record):
                found.append(record)
        if len(found) > limit:
            break
    if expired:
        await redis.zrem(index_key, *expired)
    return found[:limit], len(found) > limit
