"""The API process's housekeeper against a real Redis, with no batch runner anywhere: it requeues a
dead worker's job, fails what no worker can serve, and keeps the results of background jobs."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis as sync_redis
from redis.asyncio import Redis

from api.jobs.housekeeping import Housekeeper
from api.jobs.results import EndedJob, ResultStore
from api.jobs.worker_directory import WorkerDirectory
from relaylm.redis_launcher import find_redis_server, start_redis
from shared.contract import ChatJob, Delivery, Generate, Message, encode_job
from shared.errors import ErrorKind
from shared.events import AnyEvent, DeltaEvent, EndEvent, ErrorEvent, StartEvent, UsageCounts, encode_event
from shared.job_lifecycle import AppendRequest, Claim, EventAppender, JobLifecycle, JobState
from shared.redis import RedisTarget, connect_redis
from shared.redis_keys import WORKER_HEARTBEAT_TTL_S, RedisKeys
from shared.registry import ModelRecord, WorkerInfo

MODEL = "m"
GRACE_S = 0.2


@dataclass
class Env:
    redis: Redis
    keys: RedisKeys
    lifecycle: JobLifecycle
    appender: EventAppender
    housekeeper: Housekeeper


@pytest.fixture
async def env(redis_url: str) -> AsyncIterator[Env]:
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    redis = Redis.from_url(redis_url)
    sync_client = sync_redis.Redis.from_url(redis_url)
    lifecycle = JobLifecycle(redis, keys)
    directory = WorkerDirectory(redis, keys)
    results = ResultStore(redis, keys, lifecycle, retention_s=60)
    housekeeper = Housekeeper(lifecycle, directory, results, interval_s=0.05, no_worker_grace_s=GRACE_S)
    try:
        yield Env(redis, keys, lifecycle, EventAppender(sync_client, keys), housekeeper)
    finally:
        await housekeeper.stop()
        await redis.aclose()
        sync_client.close()


async def _register_worker(env: Env, worker_id: str, last_seen: float | None = None) -> None:
    """A heartbeat as a worker writes it; with ``last_seen``, only the model's record (no live worker)."""
    now = time.time()
    seen = now if last_seen is None else last_seen
    record = ModelRecord(model=MODEL, first_seen=seen, last_seen=seen)
    await env.redis.hset(env.keys.models(), MODEL, record.model_dump_json())
    if last_seen is None:
        info = WorkerInfo(
            worker_id=worker_id, instance="live", model=MODEL, state="ready", host="h", pid=1, started_at=now,
            heartbeat_at=now,
        )  # fmt: skip
        await env.redis.set(env.keys.worker(worker_id), info.model_dump_json(), ex=30)
        await env.redis.sadd(env.keys.model_workers(MODEL), worker_id)


async def _queued(env: Env, job_id: str, queue: str | None = None) -> None:
    request = Generate(model=MODEL, messages=[Message(role="user", content="x")])
    job = ChatJob(job_id=job_id, created=1, request=request, delivery=Delivery(background=True))
    await env.lifecycle.create(job_id, encode_job(job), MODEL, queue or env.keys.queue(MODEL))


async def _running_on_dead_worker(env: Env, job_id: str) -> int:
    """A job claimed by a worker that never heartbeats again; returns its epoch."""
    await _queued(env, job_id)
    claim = await env.lifecycle.claim(env.keys.queue(MODEL), "dead-worker", "gone")
    assert isinstance(claim, Claim) and claim.job_id == job_id
    return claim.epoch


async def _state(env: Env, job_id: str) -> JobState:
    record = await env.lifecycle.record(job_id)
    assert record is not None
    return record.state


async def test_a_dead_workers_job_is_requeued_by_the_running_housekeeper(env: Env) -> None:
    await _register_worker(env, "survivor")
    await _running_on_dead_worker(env, "j1")
    env.housekeeper.start()
    async with asyncio.timeout(5):
        while await _state(env, "j1") is not JobState.QUEUED:
            await asyncio.sleep(0.02)
    record = await env.lifecycle.record("j1")
    assert record is not None and record.owner is None and record.attempts == 1
    assert await env.lifecycle.queued_job_ids(env.keys.queue(MODEL)) == ["j1"]


async def test_a_finished_background_jobs_result_is_kept_and_it_is_no_longer_collected(env: Env) -> None:
    await _register_worker(env, "w")
    await _queued(env, "bg")
    await env.lifecycle.track_background("bg")
    claim = await env.lifecycle.claim(env.keys.queue(MODEL), "w", "live")
    assert isinstance(claim, Claim)
    events: list[AnyEvent] = [
        StartEvent(seq=0, worker_id="w", prompt_tokens=1),
        DeltaEvent(seq=1, content="hello", finish_reason="stop"),
        EndEvent(seq=2, usage=UsageCounts(prompt_tokens=1, completion_tokens=1)),
    ]
    encoded = [(event.seq, encode_event(event)) for event in events]
    env.appender.append([AppendRequest("bg", claim.epoch, encoded, JobState.FINISHED)])

    await env.housekeeper.tick()

    raw = await env.redis.get(env.keys.ended_job("bg"))
    assert raw is not None
    ended = EndedJob.from_json("bg", raw)
    assert ended.state is JobState.FINISHED and ended.events == events
    assert isinstance(ended.job, ChatJob) and ended.job.request.messages[0].content == "x"
    assert 0 < await env.redis.ttl(env.keys.ended_job("bg")) <= 60
    assert await env.lifecycle.background_job_ids() == []


async def test_a_dead_owner_with_no_worker_left_fails_at_once_as_worker_lost(env: Env) -> None:
    await _register_worker(env, "none", last_seen=time.time())
    await _running_on_dead_worker(env, "j1")
    assert await env.housekeeper.reap_running() == ["j1"]
    assert await _state(env, "j1") is JobState.FAILED
    [error] = await env.lifecycle.read_log("j1")
    assert isinstance(error, ErrorEvent) and error.kind is ErrorKind.WORKER_LOST


async def test_queued_jobs_fail_once_their_model_has_had_no_worker_for_the_grace(env: Env) -> None:
    await _register_worker(env, "none", last_seen=time.time())
    await _queued(env, "fresh")
    await _queued(env, "line", queue=env.keys.batch_queue(MODEL))
    assert await env.housekeeper.fail_unserved() == []  # the model's last heartbeat is within the grace

    await _register_worker(env, "none", last_seen=time.time() - 10 * GRACE_S)
    assert await env.housekeeper.fail_unserved() == []  # "fresh" entered its queue within the grace
    await asyncio.sleep(GRACE_S)
    assert await env.housekeeper.fail_unserved() == ["fresh"]
    assert await _state(env, "fresh") is JobState.FAILED
    [error] = await env.lifecycle.read_log("fresh")
    assert isinstance(error, ErrorEvent) and error.kind is ErrorKind.NO_LIVE_WORKER and error.param == "model"
    # A batch line waits for a worker: its batch's window, not the grace, bounds it.
    assert await _state(env, "line") is JobState.QUEUED


async def test_a_live_worker_keeps_queued_jobs_waiting(env: Env) -> None:
    await _register_worker(env, "w")
    await _queued(env, "j1")
    await env.housekeeper.tick()
    assert await _state(env, "j1") is JobState.QUEUED


async def test_after_redis_did_not_answer_no_job_is_judged_for_a_lease() -> None:
    # Redis frozen for a sweep: no worker could heartbeat meanwhile, so a lapsed heartbeat says
    # nothing yet. The dead worker's job is requeued only once a lease passed after Redis answered.
    binary = find_redis_server()
    assert binary is not None
    own = start_redis(binary)
    assert own.process is not None
    redis = connect_redis(RedisTarget(own.url))  # every command bounded by its timeout
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    lifecycle = JobLifecycle(redis, keys)
    directory = WorkerDirectory(redis, keys)
    results = ResultStore(redis, keys, lifecycle, retention_s=60)
    housekeeper = Housekeeper(lifecycle, directory, results, interval_s=0.05, no_worker_grace_s=GRACE_S)
    sync_client = sync_redis.Redis.from_url(own.url)
    env = Env(redis, keys, lifecycle, EventAppender(sync_client, keys), housekeeper)
    try:
        await _register_worker(env, "survivor")
        await _running_on_dead_worker(env, "j1")
        own.process.send_signal(signal.SIGSTOP)
        try:
            await housekeeper.tick()  # times out: Redis does not answer
        finally:
            own.process.send_signal(signal.SIGCONT)
        answered_at = time.monotonic()
        await housekeeper.tick()
        assert await _state(env, "j1") is JobState.RUNNING
        async with asyncio.timeout(WORKER_HEARTBEAT_TTL_S + 5):
            while await _state(env, "j1") is JobState.RUNNING:
                await housekeeper.tick()
                await asyncio.sleep(0.1)
        assert time.monotonic() - answered_at >= WORKER_HEARTBEAT_TTL_S
        assert await _state(env, "j1") is JobState.QUEUED
    finally:
        await redis.aclose()
        sync_client.close()
        own.stop()
