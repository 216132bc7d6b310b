"""The worker's job audit against a real Redis: a job recorded as running under this worker
process that it does not run goes back to its queue, once quiet for the grace; the jobs it runs,
other processes' jobs and jobs written to within the grace stay as they are."""

from __future__ import annotations

import uuid

from redis.asyncio import Redis

from shared.job_lifecycle import Claim, JobLifecycle, JobState
from shared.redis_keys import RedisKeys
from worker.service.job_audit import JobAudit


async def _claimed(lifecycle: JobLifecycle, queue: str, job_id: str, instance: str) -> Claim:
    await lifecycle.create(job_id, b'{"x": 1}', "m", queue)
    claim = await lifecycle.claim(queue, f"worker-{instance}", instance)
    assert isinstance(claim, Claim) and claim.job_id == job_id
    return claim


async def _age(redis: Redis, keys: RedisKeys, job_id: str, seconds: float) -> None:
    updated_ms = int(await redis.hget(keys.job(job_id), "updated_ms"))
    await redis.hset(keys.job(job_id), "updated_ms", updated_ms - int(seconds * 1000))


async def test_a_quiet_job_this_worker_does_not_run_goes_back_to_its_queue(redis: Redis) -> None:
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    lifecycle = JobLifecycle(redis, keys)
    queue = keys.queue("m")
    for job_id, instance in (("runs", "i1"), ("forgotten", "i1"), ("recent", "i1"), ("other", "i2")):
        await _claimed(lifecycle, queue, job_id, instance)
    for job_id in ("runs", "forgotten", "other"):
        await _age(redis, keys, job_id, 60)
    audit = JobAudit(lifecycle, [queue], "i1", lambda: {"runs"}, grace_s=10)
    assert await audit.check() == ["forgotten"]
    states = {
        job_id: record.state
        for job_id, record in (await lifecycle.records(["runs", "forgotten", "recent", "other"])).items()
        if record
    }
    assert states == {
        "runs": JobState.RUNNING, "forgotten": JobState.QUEUED, "recent": JobState.RUNNING, "other": JobState.RUNNING
    }  # fmt: skip
    again = await lifecycle.claim(queue, "worker-i3", "i3")  # the next claim continues it, first in line
    assert isinstance(again, Claim) and again.job_id == "forgotten" and again.attempt == 2
    assert await audit.check() == []
