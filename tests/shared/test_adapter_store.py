"""The adapter store against a real Redis: a worker's ``--lora`` adapters are written once, not at
every start, and written again where what Redis holds under the name is not them."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from shared.adapters import AdapterStore, digest
from shared.redis_keys import RedisKeys

CONFIG, WEIGHTS = b'{"r": 8}', b"\x01\x02" * 64


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[tuple[AdapterStore, Redis, RedisKeys]]:
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    client = Redis.from_url(redis_url)
    try:
        yield AdapterStore(client, keys), client, keys
    finally:
        await client.aclose()


async def test_the_same_files_are_stored_once(store: tuple[AdapterStore, Redis, RedisKeys]) -> None:
    adapters, _, _ = store
    assert await adapters.ensure("a", "base", CONFIG, WEIGHTS, 8, ["q_proj"])
    first = await adapters.record("a")
    assert not await adapters.ensure("a", "base", CONFIG, WEIGHTS, 8, ["q_proj"])
    assert await adapters.record("a") == first
    assert first is not None and await adapters.files(first) == (CONFIG, WEIGHTS)


async def test_other_files_another_base_or_lost_files_are_stored_again(
    store: tuple[AdapterStore, Redis, RedisKeys],
) -> None:
    adapters, redis, keys = store
    assert await adapters.ensure("a", "base", CONFIG, WEIGHTS, 8, ["q_proj"])
    changed = WEIGHTS + b"\x03"
    assert await adapters.ensure("a", "base", CONFIG, changed, 8, ["q_proj"])
    record = await adapters.record("a")
    assert record is not None and record.sha256 == digest(CONFIG, changed)
    assert await adapters.ensure("a", "other", CONFIG, changed, 8, ["q_proj"])
    await redis.delete(keys.adapter_files("a"))
    assert await adapters.ensure("a", "other", CONFIG, changed, 8, ["q_proj"])
    record = await adapters.record("a")
    assert record is not None and await adapters.files(record) == (CONFIG, changed)
