"""arq's Worker with a wake-up: arq polls its queue every ``poll_delay`` (0.5 s by default),
which would add up to half a second to every time-to-first-token. The API publishes a ping
after each enqueue, and a finished job frees a place; this subclass polls as soon as either
happens, and on its timer otherwise. It also claims each job in one Redis round trip where
arq spends four (WATCH, EXISTS, ZSCORE, MULTI/EXEC), all on the time-to-first-token path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from arq.constants import in_progress_key_prefix
from arq.utils import timestamp_ms
from arq.worker import Worker
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

# arq's claim, made atomic by Lua instead of WATCH: the job is not running elsewhere, is still
# queued and due (its score is not in the future of this worker's clock); mark it in progress.
# KEYS: in-progress key, queue; ARGV: job id, now (ms), in-progress TTL (ms). Returns the score.
_CLAIM_JOB = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not score or tonumber(score) > tonumber(ARGV[2]) then return false end
redis.call('PSETEX', KEYS[1], ARGV[3], '1')
return score
"""

_MIN_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 5.0


class WakeableWorker(Worker):
    def __init__(self, *args: object, pick_gate: Callable[[], bool] | None = None, **kwargs: object) -> None:
        """``pick_gate``: asked before each poll; while it says no, this consumer takes no new
        jobs (batch lines wait while interactive requests need the engine)."""
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._wake_event = asyncio.Event()
        self._pick_gate = pick_gate
        self._picking_stopped = False
        self._claim_job: AsyncScript | None = None

    def wake(self) -> None:
        self._wake_event.set()

    def stop_picking(self) -> None:
        """Take no new jobs from now on (draining); running ones go on."""
        self._picking_stopped = True
        self.allow_pick_jobs = False

    def _release_sem_dec_counter_on_complete(self) -> None:
        # A finished job frees a place: look for the next one now, not at the next timed poll.
        super()._release_sem_dec_counter_on_complete()
        self._wake_event.set()

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        """arq's ``start_jobs`` with the claim in one script call; everything else as arq does it."""
        if self._claim_job is None:
            raise RuntimeError("start_jobs runs only from main()")
        for job_id_b in job_ids:
            await self.sem.acquire()
            if self.job_counter >= self.max_jobs:
                self.sem.release()
                return
            self.job_counter += 1
            job_id = job_id_b.decode()
            in_progress_ms = int(self.in_progress_timeout_s * 1000)
            score = await self._claim_job(
                keys=[in_progress_key_prefix + job_id, self.queue_name], args=[job_id, timestamp_ms(), in_progress_ms]
            )
            if score is None:  # started by another worker, finished, or not due yet
                self.job_counter -= 1
                self.sem.release()
                continue
            task = self.loop.create_task(self.run_job(job_id, int(float(score))))
            task.add_done_callback(lambda _: self._release_sem_dec_counter_on_complete())
            self.tasks[job_id] = task

    @property
    def num_jobs_running(self) -> int:
        return self.job_counter

    async def main(self) -> None:
        if self._pool is None:
            raise RuntimeError("WakeableWorker needs redis_pool (the serializers live on the pool)")
        self._claim_job = self.pool.register_script(_CLAIM_JOB)
        logger.info("consuming queue %s (max_jobs=%d)", self.queue_name, self.max_jobs)
        self.ctx["redis"] = self.pool
        if self.on_startup:
            await self.on_startup(self.ctx)
        backoff_s = _MIN_BACKOFF_S
        while True:
            if not self._picking_stopped and self._pick_gate is not None:
                self.allow_pick_jobs = self._pick_gate()
            try:
                await self._poll_iteration()
                backoff_s = _MIN_BACKOFF_S
            except (RedisError, OSError) as exc:
                # arq's own loop dies with the connection (arq #435); a worker must outlive Redis restarts.
                logger.warning("queue poll failed (%s); retrying in %.1f s", exc, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, _MAX_BACKOFF_S)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake_event.wait(), self.poll_delay_s)
            self._wake_event.clear()
