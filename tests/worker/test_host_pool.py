"""The workers that share a worker's cores: its thread count follows the busy ones, and its claim
wait follows its rank among the ready workers of its model (pure rules, then against real Redis)."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid

import pytest
from redis.asyncio import Redis

from shared.redis_keys import RedisKeys
from shared.registry import WorkerInfo, WorkerState
from worker.service.host_pool import SPILL_WAIT_S, HostPool, PoolView, view_of

HOST = "host-a"


def _info(
    worker_id: str,
    *,
    host: str = HOST,
    model: str = "m",
    started_at: float = 100.0,
    num_jobs: int = 0,
    cpus: tuple[int, ...] = (0, 1),
    state: WorkerState = "ready",
    sizes_own_threads: bool = True,
) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, model=model, state=state, host=host, pid=1, started_at=started_at, heartbeat_at=0.0,
        num_jobs=num_jobs, cpus=list(cpus), sizes_own_threads=sizes_own_threads,
    )  # fmt: skip


# -- who counts -------------------------------------------------------------------------------
def test_only_busy_workers_on_the_same_cores_count_as_busy_neighbours() -> None:
    me = _info("me")
    records = [
        me,  # its own record is never a neighbour
        _info("idle", started_at=50),
        _info("busy", num_jobs=3),
        _info("busy-other-model", model="other", num_jobs=1),  # competes for the cores all the same
        _info("busy-other-host", host="host-b", num_jobs=1),
        _info("busy-other-cores", cpus=(2, 3), num_jobs=1),
        _info("busy-cpus-unknown", cpus=(), num_jobs=1),  # unknown: assumed to overlap
    ]
    assert view_of(me, records).num_busy_neighbours == 3


def test_the_oldest_ready_worker_of_a_model_on_the_same_cores_ranks_first() -> None:
    me = _info("me", started_at=100)
    assert view_of(me, [me]) == PoolView(num_busy_neighbours=0, rank=0)
    older = _info("older", started_at=50)
    assert view_of(me, [me, older]).rank == 1
    assert view_of(older, [me, older]).rank == 0
    tied = _info("a-tie", started_at=100)  # same start: the worker id decides, the same way on both
    assert (view_of(me, [me, tied]).rank, view_of(tied, [me, tied]).rank) == (1, 0)
    not_pooled = [
        _info("loading", started_at=1, state="loading"),
        _info("draining", started_at=1, state="draining"),
        _info("other-model", started_at=1, model="other"),
        _info("other-host", started_at=1, host="host-b"),
        _info("other-cores", started_at=1, cpus=(2,)),
        _info("fixed-threads", started_at=1, sizes_own_threads=False),
    ]
    assert view_of(me, [me, *not_pooled]).rank == 0
    assert view_of(me, [me, older, _info("oldest", started_at=10)]).rank == 2


def test_a_worker_with_a_fixed_thread_count_takes_jobs_at_once() -> None:
    me = _info("me", started_at=100, sizes_own_threads=False)
    assert view_of(me, [me, _info("older", started_at=50, num_jobs=1)]) == PoolView(1, rank=0)


# -- HostPool against the registry ------------------------------------------------------------
async def _register(redis: Redis, keys: RedisKeys, info: WorkerInfo) -> None:
    """Write a registry record as WorkerRegistration.beat does."""
    await redis.set(keys.worker(info.worker_id), info.model_dump_json(), ex=30)
    await redis.sadd(keys.model_workers(info.model), info.worker_id)
    await redis.hset(keys.models(), info.model, "{}")


def _keys() -> RedisKeys:
    return RedisKeys(prefix=f"t{uuid.uuid4().hex[:8]}")


async def test_threads_follow_the_busy_neighbours_and_are_applied_on_change_only(redis: Redis) -> None:
    keys, applied = _keys(), []
    me = _info("me", started_at=time.time())
    pool = HostPool(redis, keys, me, num_cores=2, override=None, apply=applied.append)
    await _register(redis, keys, me)
    await _register(redis, keys, _info("elsewhere", host="host-b", num_jobs=4))
    assert (await pool.refresh()).num_busy_neighbours == 0 and pool.num_threads == 2

    neighbour = _info("neighbour", model="model-2", started_at=time.time())
    await _register(redis, keys, neighbour)
    await pool.refresh()
    assert pool.num_threads == 2  # idle: it leaves its cores to this worker

    await _register(redis, keys, neighbour.model_copy(update={"num_jobs": 1}))
    await pool.refresh()
    assert pool.num_threads == 1

    await redis.delete(keys.worker("neighbour"))  # its record expired; the model's set still lists it
    await pool.refresh()
    await pool.refresh()
    assert applied == [2, 1, 2]


async def test_an_override_is_applied_whatever_the_neighbours(redis: Redis) -> None:
    keys, applied = _keys(), []
    me = _info("me", sizes_own_threads=False)
    pool = HostPool(redis, keys, me, num_cores=2, override=3, apply=applied.append)
    await _register(redis, keys, _info("busy", num_jobs=1))
    await pool.refresh()
    assert applied == [3] and pool.claim_min_wait_s() == 0


async def test_the_claim_wait_follows_the_rank(redis: Redis) -> None:
    keys = _keys()
    me = _info("me", started_at=200)
    pool = HostPool(redis, keys, me, num_cores=2, override=None, apply=lambda _n: None)
    assert pool.claim_min_wait_s() == 0
    await _register(redis, keys, _info("older", started_at=100))
    await pool.refresh()
    assert pool.claim_min_wait_s() == SPILL_WAIT_S
    await redis.delete(keys.worker("older"))  # the older one died: this worker takes jobs at once
    await pool.refresh()
    assert pool.claim_min_wait_s() == 0


async def test_the_refresh_loop_picks_up_a_neighbour_turning_busy(redis: Redis) -> None:
    keys, applied = _keys(), []
    me = _info("me")
    pool = HostPool(redis, keys, me, num_cores=2, override=None, apply=applied.append, interval_s=0.02)
    await pool.refresh()
    pool.start()
    try:
        await _register(redis, keys, _info("neighbour", num_jobs=2))
        async with asyncio.timeout(5):
            while applied[-1] != 1:
                await asyncio.sleep(0.01)
    finally:
        await pool.stop()
    assert applied == [2, 1]


async def test_the_refresh_loop_survives_redis_errors(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    unreachable = Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    applied: list[int] = []
    pool = HostPool(unreachable, RedisKeys(), _info("me"), 2, None, applied.append, interval_s=0.01)
    pool.start()
    try:
        async with asyncio.timeout(10):
            while "could not read the workers" not in caplog.text:
                await asyncio.sleep(0.01)
        assert pool._task is not None and not pool._task.done()
    finally:
        await pool.stop()
        await unreachable.aclose()
    assert applied == []
