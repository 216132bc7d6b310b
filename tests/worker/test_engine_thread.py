"""A worker whose engine loop dies leaves the registry and exits, so that APIs hand its jobs to
another worker instead of waiting on it; a normally stopped loop is reported as such.

The worker here is the real one (tiny model, real Redis); only its engine's loop is replaced by
one that fails, which a real engine does only when its own failure handling fails.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from worker.kinds.base import Engine
from worker.service.engine_thread import EngineThread
from worker.service.main import EngineStopped, WorkerProcess
from worker.settings import WorkerSettings


def _settings(redis_url: str, model: Path) -> WorkerSettings:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    return WorkerSettings(
        redis_url=redis_url, key_prefix=prefix, model=str(model), served_model_name="tiny", worker_id=f"{prefix}-w",
        dtype="float32", max_model_len=256, heartbeat_interval_s=0.2,
    )  # fmt: skip


def _raise_on_run(engine: Engine[Any]) -> Engine[Any]:
    def run_forever() -> None:
        raise RuntimeError("engine loop failed")

    engine.run_forever = run_forever  # type: ignore[method-assign,misc]
    return engine


async def test_a_worker_whose_engine_loop_dies_deregisters_and_exits(redis_url: str, tiny_model_path: Path) -> None:
    settings = _settings(redis_url, tiny_model_path)
    process = WorkerProcess(settings)
    process.engine_thread = EngineThread(lambda: _raise_on_run(process.kind.start()))
    redis = Redis.from_url(redis_url)
    try:
        with pytest.raises(EngineStopped, match="engine loop failed"):
            await asyncio.wait_for(process.run(asyncio.Event()), 60)
        assert await redis.exists(settings.keys.worker(settings.worker_id)) == 0
        assert settings.worker_id.encode() not in await redis.smembers(settings.keys.model_workers("tiny"))
    finally:
        await redis.aclose()


async def test_a_stopped_engine_loop_is_reported_as_a_normal_exit(tiny_model_path: Path, redis_url: str) -> None:
    process = WorkerProcess(_settings(redis_url, tiny_model_path))
    thread = EngineThread(process.kind.start)
    engine = await thread.start()
    engine.stop()
    await asyncio.wait_for(thread.exited(), 10)
    await process.redis.aclose()
    process.publisher.close()
