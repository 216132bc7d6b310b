"""A worker's heartbeats against real Redis: it registers as loading before its model loads, and
the model's record speaks for ready workers only, so a loading worker never hides what a ready
one said (its capabilities, when the model was last served)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from shared.redis_keys import RedisKeys
from shared.registry import ModelRecord, WorkerInfo
from worker.service.registry import WorkerRegistration

MODEL = "m"


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


def _registration(redis: Redis, keys: RedisKeys, worker_id: str) -> WorkerRegistration:
    return WorkerRegistration(redis, keys, worker_id, MODEL, interval_s=1.0, task="generate")


async def _record(redis: Redis, keys: RedisKeys) -> ModelRecord:
    raw = await redis.hget(keys.models(), MODEL)
    assert raw is not None
    return ModelRecord.model_validate_json(raw)


async def _info(redis: Redis, keys: RedisKeys, worker_id: str) -> WorkerInfo:
    raw = await redis.get(keys.worker(worker_id))
    assert raw is not None
    return WorkerInfo.model_validate_json(raw)


async def test_a_loading_worker_makes_its_model_known_and_a_ready_one_fills_its_record(redis: Redis) -> None:
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    loading = _registration(redis, keys, "w1")
    await loading.beat()
    assert (await _info(redis, keys, "w1")).state == "loading"
    first = await _record(redis, keys)
    assert (first.task, first.max_model_len, first.vision) == ("generate", 0, False)

    loading.info.vision = True  # as the worker does once its vision tower loaded
    loading.set_ready(max_num_seqs=4, max_model_len=512, load_probe=lambda: (0, 0, 0.0, 0.0))
    await loading.beat()
    ready = await _record(redis, keys)
    assert (ready.max_model_len, ready.vision, ready.first_seen) == (512, True, first.first_seen)
    assert ready.last_seen >= first.last_seen


async def test_a_second_worker_loading_leaves_the_ready_workers_record_as_it_is(redis: Redis) -> None:
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    ready = _registration(redis, keys, "ready")
    ready.info.vision = True
    ready.set_ready(max_num_seqs=4, max_model_len=512, load_probe=lambda: (0, 0, 0.0, 0.0))
    await ready.beat()
    before = await _record(redis, keys)

    await _registration(redis, keys, "loading").beat()
    assert await _record(redis, keys) == before
    assert (await _info(redis, keys, "loading")).state == "loading"

    await ready.set_state("draining")  # a draining worker no longer speaks for the model either
    assert await _record(redis, keys) == before
