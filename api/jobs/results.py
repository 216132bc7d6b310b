"""The results of ended background jobs (background chat completions and background Responses):
one store, in any wire format's terms. What it keeps is the job itself, how it ended and its
events, read back from the job's log; each API renders that as its own response (a
``chat.completion``, a Response) with the code a live request uses.

The housekeeper keeps the result of every tracked job that ended; a poll or a cancel keeps its own
at once rather than wait for the next sweep. Keeping a result and dropping the job from the
background set is one lifecycle call, so a result is kept exactly when the job stops being
collected. A result outlives the job's own log (an hour) by the retention period.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from api.render.events import EventReplay
from shared.contract import AnyJob, decode_job
from shared.events import AnyEvent, event_from_json
from shared.job_lifecycle import JobLifecycle, JobState
from shared.redis_keys import RedisKeys


@dataclass(frozen=True)
class EndedJob:
    """A background job that ended: ``state`` is ``finished``, ``failed``, ``cancelled`` or
    ``expired`` (gone from Redis before its result was kept; ``job`` is then None)."""

    job_id: str
    state: JobState
    tenant: str | None
    job: AnyJob | None
    events: list[AnyEvent] = field(default_factory=list)

    def replay(self) -> EventReplay:
        assert self.job is not None, "an expired job has no events to replay"
        return EventReplay(self.job, self.events)

    def to_json(self) -> str:
        record: dict[str, Any] = {
            "state": self.state.value,
            "tenant": self.tenant,
            "job": self.job.model_dump(mode="json") if self.job is not None else None,
            "delivery": self.job.delivery.model_dump(mode="json") if self.job is not None else None,
            "events": [event.model_dump(mode="json", exclude_none=True) for event in self.events],
        }
        return json.dumps(record, ensure_ascii=False)

    @classmethod
    def from_json(cls, job_id: str, raw: bytes | str) -> EndedJob:
        record = json.loads(raw)
        job = None
        if record["job"] is not None:
            job = decode_job(json.dumps(record["job"]).encode(), json.dumps(record["delivery"]).encode())
        events = [event_from_json(event) for event in record["events"]]
        return cls(job_id, JobState(record["state"]), record["tenant"], job, events)


class ResultStore:
    def __init__(self, redis: Redis, keys: RedisKeys, lifecycle: JobLifecycle, retention_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self._lifecycle = lifecycle
        self._retention_s = retention_s

    async def collect(self) -> list[str]:
        """Keep the result of every tracked background job that ended; returns their ids. The
        tracked jobs' records are read in one round trip: one still queued or running costs the
        sweep nothing more."""
        job_ids = await self._lifecycle.background_job_ids()
        records = await self._lifecycle.records(job_ids) if job_ids else {}
        collected: list[str] = []
        for job_id, record in records.items():
            if record is not None and not record.state.is_final:
                continue
            if await self.keep(job_id) is not None:
                collected.append(job_id)
        return collected

    async def keep(self, job_id: str) -> EndedJob | None:
        """The job's result, kept now if it has ended (and not kept already); None while it is
        queued or running."""
        kept = await self.get(job_id)
        if kept is not None:
            return kept
        lifecycle = self._lifecycle
        record = await lifecycle.record(job_id)
        if record is not None and not record.state.is_final:
            return None
        stored = await lifecycle.stored(job_id) if record is not None else None
        job = decode_job(stored.payload, stored.delivery) if stored is not None else None
        if record is None or job is None:
            ended = EndedJob(job_id, JobState.EXPIRED, None, None)
        else:
            ended = EndedJob(job_id, record.state, job.tenant, job, await lifecycle.read_log(job_id))
        await lifecycle.untrack_background(job_id, ended.to_json(), self._retention_s)
        return ended

    async def get(self, job_id: str) -> EndedJob | None:
        """The kept result, if there is one (the caller checks that the asking key may see it)."""
        raw = await self._redis.get(self._keys.ended_job(job_id))
        return EndedJob.from_json(job_id, raw) if raw is not None else None

    async def cancel(self, job_id: str) -> EndedJob:
        """Stop a queued or running job and keep it as cancelled (one that ended already is kept
        as it ended)."""
        await self._lifecycle.cancel([job_id])
        ended = await self.keep(job_id)
        assert ended is not None, "a cancelled job has ended"
        return ended

    async def delete(self, job_id: str) -> None:
        """The result, and the job's request and log with it: the job is gone for good."""
        await self._redis.delete(self._keys.ended_job(job_id))
        await self._lifecycle.delete(job_id)
