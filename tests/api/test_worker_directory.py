"""What the API reads from the worker registry: a loading worker is not live (it claims no job),
yet its model is served (a request waits for it); capabilities come from ready workers only; a
record of an older release's worker still reads. Pure readings first, then against real Redis."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from api.jobs.housekeeping import Housekeeper
from api.jobs.results import ResultStore
from api.jobs.worker_directory import ModelWorkers, WorkerDirectory
from shared.contract import CONTRACT_VERSION, ChatJob, Delivery, Generate, Message, encode_job
from shared.errors import ErrorKind, RelayError
from shared.events import ErrorEvent
from shared.job_lifecycle import JobLifecycle, JobState
from shared.redis_keys import RedisKeys
from shared.registry import ModelRecord, WorkerInfo, WorkerState

MODEL = "m"
GRACE_S = 0.3


def _info(
    worker_id: str, state: WorkerState, vision: bool = False, contract_version: int = CONTRACT_VERSION
) -> WorkerInfo:
    now = time.time()
    return WorkerInfo(
        worker_id=worker_id, instance=worker_id, model=MODEL, state=state, host="h", pid=1, started_at=now,
        heartbeat_at=now, vision=vision, contract_version=contract_version,
    )  # fmt: skip


# -- one reading ------------------------------------------------------------------------------
def test_a_reading_sorts_workers_by_state() -> None:
    reading = ModelWorkers((_info("a", "loading"), _info("b", "ready"), _info("c", "draining")))
    assert [w.worker_id for w in reading.ready] == ["b"]
    assert [w.worker_id for w in reading.loading] == ["a"]
    assert ModelWorkers().ready == ModelWorkers().loading == []


def test_images_are_refused_only_on_a_ready_workers_word() -> None:
    assert not ModelWorkers().refuses_images
    # A loading worker has not said whether it takes images: its record's vision is not yet filled in.
    assert not ModelWorkers((_info("loading", "loading"),)).refuses_images
    assert ModelWorkers((_info("text", "ready"), _info("loading", "loading"))).refuses_images
    assert not ModelWorkers((_info("vlm", "ready", vision=True),)).refuses_images


def test_loading_workers_count_for_the_job_version_they_will_read() -> None:
    assert ModelWorkers().readable_version == CONTRACT_VERSION
    older = ModelWorkers((_info("new", "ready"), _info("old", "loading", contract_version=1)))
    assert older.readable_version == 1
    newer = ModelWorkers((_info("future", "ready", contract_version=CONTRACT_VERSION + 1),))
    assert newer.readable_version == CONTRACT_VERSION


def test_an_older_releases_record_reads() -> None:
    """A worker of an earlier release writes neither its contract version nor its capabilities."""
    raw = {
        "worker_id": "old", "model": MODEL, "state": "loading", "host": "h", "pid": 1, "started_at": 1.0,
        "heartbeat_at": 1.0,
    }  # fmt: skip
    info = WorkerInfo.model_validate_json(json.dumps(raw))
    assert (info.state, info.contract_version, info.vision, info.deterministic) == ("loading", 1, False, False)


# -- against Redis ----------------------------------------------------------------------------
@pytest.fixture
async def registry(redis_url: str) -> AsyncIterator[tuple[Redis, RedisKeys]]:
    redis = Redis.from_url(redis_url)
    try:
        yield redis, RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    finally:
        await redis.aclose()


async def _heartbeat(redis: Redis, keys: RedisKeys, info: WorkerInfo, last_seen: float | None = None) -> None:
    """A worker's heartbeat record, and the model's record as its ready workers left it."""
    await redis.set(keys.worker(info.worker_id), info.model_dump_json(), ex=30)
    await redis.sadd(keys.model_workers(MODEL), info.worker_id)
    seen = time.time() if last_seen is None else last_seen
    record = ModelRecord(model=MODEL, first_seen=seen, last_seen=seen)
    await redis.hsetnx(keys.models(), MODEL, record.model_dump_json())


async def test_a_model_whose_workers_all_load_is_served_but_has_no_live_worker(
    registry: tuple[Redis, RedisKeys],
) -> None:
    redis, keys = registry
    directory = WorkerDirectory(redis, keys)
    with pytest.raises(RelayError) as never_served:
        await directory.require_worker(MODEL)
    assert never_served.value.kind is ErrorKind.MODEL_NOT_FOUND

    await _heartbeat(redis, keys, _info("w", "loading"))
    await directory.require_worker(MODEL)  # accepted: the job waits for the worker
    assert not await directory.has_live_worker(MODEL)
    assert not await directory.refuses_images(MODEL)

    await _heartbeat(redis, keys, _info("w", "ready"))
    assert await directory.has_live_worker(MODEL, fresh=True)
    assert await directory.refuses_images(MODEL)

    await _heartbeat(redis, keys, _info("w", "draining"))
    assert not await directory.has_live_worker(MODEL, fresh=True)
    with pytest.raises(RelayError) as draining:
        await directory.require_worker(MODEL)
    assert draining.value.kind is ErrorKind.NO_LIVE_WORKER


async def test_a_queued_job_fails_after_the_grace_while_its_models_only_worker_loads(
    registry: tuple[Redis, RedisKeys],
) -> None:
    redis, keys = registry
    lifecycle = JobLifecycle(redis, keys)
    directory = WorkerDirectory(redis, keys)
    results = ResultStore(redis, keys, lifecycle, retention_s=60)
    housekeeper = Housekeeper(lifecycle, directory, results, interval_s=0.05, no_worker_grace_s=GRACE_S)
    # The model was last served long ago; its worker heartbeats now, loading.
    await _heartbeat(redis, keys, _info("w", "loading"), last_seen=time.time() - 3600)
    job = ChatJob(
        job_id="j", created=1, request=Generate(model=MODEL, messages=[Message(role="user", content="x")]),
        delivery=Delivery(background=True),
    )  # fmt: skip
    await lifecycle.create("j", encode_job(job), MODEL, keys.queue(MODEL))
    assert await housekeeper.fail_unserved() == []  # within the grace of entering its queue
    await asyncio.sleep(GRACE_S)
    await _heartbeat(redis, keys, _info("w", "loading"))  # heartbeats of a loading worker do not count
    assert await housekeeper.fail_unserved() == ["j"]
    record = await lifecycle.record("j")
    assert record is not None and record.state is JobState.FAILED
    [error] = await lifecycle.read_log("j")
    assert isinstance(error, ErrorEvent) and error.kind is ErrorKind.NO_LIVE_WORKER


async def test_a_running_jobs_owner_that_says_it_holds_no_job_has_forgotten_it(
    registry: tuple[Redis, RedisKeys],
) -> None:
    """The write that ended a job can be lost in a Redis failover: the record still runs under a
    live worker that finished it. Once that worker's heartbeat, well after the job's last write,
    says it holds no job, the job is an orphan (and is continued elsewhere from its log)."""
    redis, keys = registry
    lifecycle = JobLifecycle(redis, keys)
    directory = WorkerDirectory(redis, keys)
    job = ChatJob(job_id="j", created=1, request=Generate(model=MODEL, messages=[Message(role="user", content="x")]))
    await lifecycle.create("j", encode_job(job), MODEL, keys.queue(MODEL))
    assert await lifecycle.claim(keys.queue(MODEL), "w", "w") is not None
    record = await lifecycle.record("j")
    assert record is not None and record.state is JobState.RUNNING
    last_write_s = record.updated_ms / 1000

    async def alive_when(heartbeat_at: float, num_jobs: int) -> bool:
        info = _info("w", "ready").model_copy(update={"heartbeat_at": heartbeat_at, "num_jobs": num_jobs})
        await _heartbeat(redis, keys, info)
        return await directory.is_owner_alive(record)

    assert await alive_when(last_write_s + 60, num_jobs=1)  # it holds jobs: this one may be among them
    assert await alive_when(last_write_s + 1, num_jobs=0)  # its count may not yet include a fresh claim
    assert not await alive_when(last_write_s + 6, num_jobs=0)
    # An earlier release's worker does not count its jobs: its word is its heartbeat alone.
    older = json.loads(_info("w", "ready").model_dump_json(exclude={"num_jobs"}))
    await redis.set(keys.worker("w"), json.dumps(older | {"heartbeat_at": last_write_s + 60}), ex=30)
    assert await directory.is_owner_alive(record)
