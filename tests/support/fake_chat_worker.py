"""A stand-in chat worker for API tests: it registers a model (a vision one, or not), claims its
jobs, keeps each job and the image bytes it names as read from Redis, and answers ``"ok"``."""

from __future__ import annotations

import asyncio
import threading
import time

import redis as sync_redis
from redis.asyncio import Redis

from shared.contract import AnyJob, ChatJob, TokenizeJob, decode_job, images_of
from shared.events import AnyEvent, DeltaEvent, EndEvent, StartEvent, UsageCounts, encode_event
from shared.job_lifecycle import AppendRequest, Claim, EventAppender, JobLifecycle, JobState
from shared.registry import ModelRecord, WorkerInfo
from tests.support.stack import Stack

ANSWER = "ok"
PROMPT_TOKENS = 7


class FakeChatWorker:
    def __init__(self, stack: Stack, model: str, vision: bool, contract_version: int = 3) -> None:
        self.stack, self.model = stack, model
        self.worker_id = f"{stack.key_prefix}-{model}"
        self.jobs: list[AnyJob] = []
        self.images: dict[str, bytes | None] = {}  # sha256 → the bytes stored for it
        self._stop = threading.Event()
        self._redis = sync_redis.Redis.from_url(stack.redis_url)
        now = time.time()
        info = WorkerInfo(
            worker_id=self.worker_id, model=model, state="ready", host="test", pid=1, started_at=now,
            heartbeat_at=now, contract_version=contract_version, vision=vision,
        )  # fmt: skip
        record = ModelRecord(model=model, first_seen=now, last_seen=now, vision=vision)
        keys = stack.keys
        self._redis.set(keys.worker(self.worker_id), info.model_dump_json(), ex=600)
        self._redis.sadd(keys.model_workers(model), self.worker_id)
        self._redis.hset(keys.models(), model, record.model_dump_json())
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._redis.delete(self.stack.keys.worker(self.worker_id))
        self._redis.srem(self.stack.keys.model_workers(self.model), self.worker_id)

    def job(self, job_id_part: str) -> AnyJob:
        return next(job for job in self.jobs if job_id_part in job.job_id)

    async def _serve(self) -> None:
        keys = self.stack.keys
        lifecycle = JobLifecycle(Redis.from_url(self.stack.redis_url), keys)
        appender = EventAppender(self._redis, keys)
        while not self._stop.is_set():
            claim = await lifecycle.claim(keys.queue(self.model), self.worker_id, "i")
            if not isinstance(claim, Claim):
                await asyncio.sleep(0.01)
                continue
            job = decode_job(claim.payload)
            for image in images_of(job):
                self.images[image.sha256] = await lifecycle.read_image(image.sha256)
            self.jobs.append(job)
            events = [(e.seq, encode_event(e)) for e in self._answer(job)]
            appender.append([AppendRequest(job.job_id, claim.epoch, events, JobState.FINISHED)])

    def _answer(self, job: AnyJob) -> list[AnyEvent]:
        assert isinstance(job, ChatJob | TokenizeJob)
        return [
            StartEvent(seq=0, worker_id=self.worker_id, prompt_tokens=PROMPT_TOKENS),
            DeltaEvent(seq=1, content=ANSWER, token_ids=list(range(PROMPT_TOKENS)), finish_reason="stop"),
            EndEvent(seq=2, usage=UsageCounts(prompt_tokens=PROMPT_TOKENS, completion_tokens=1)),
        ]
