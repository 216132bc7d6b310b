"""Claims jobs from one of the model's queues while the engine has room for them.

The engine batches; the consumer only admits. It holds at most ``num_slots`` jobs, so queued
work stays in Redis where another worker can take it. It claims as soon as the API pings the
model's wake channel or a job of its own ends, and every ``poll_delay_s`` otherwise (a ping can
be missed while the control channel reconnects).

A worker that shares its cores with an older one (``worker.service.host_pool``) takes only jobs that
have waited ``claim_min_wait_s()``: the older worker batches them while it has room, and this
one takes what it leaves; it looks again as soon as the first job has waited long enough.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from redis.exceptions import RedisError

from shared.job_lifecycle import Claim, JobLifecycle, NotYet

logger = logging.getLogger(__name__)

_MIN_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 5.0

RunJob = Callable[[Claim], Coroutine[Any, Any, None]]


class QueueConsumer:
    def __init__(
        self,
        lifecycle: JobLifecycle,
        queue: str,
        worker_id: str,
        instance: str,
        num_slots: int,
        run_job: RunJob,
        poll_delay_s: float,
        claim_gate: Callable[[], bool] | None = None,
        claim_min_wait_s: Callable[[], float] | None = None,
        on_jobs_changed: Callable[[], None] | None = None,
        only_idle_tenants: bool = False,
    ) -> None:
        """``claim_gate``: asked before each claim; while it says no, no new job is taken
        (batch lines wait while interactive requests need the engine). ``claim_min_wait_s``: how
        long a job must have been queued before this worker takes it. ``on_jobs_changed``:
        called when a job is taken or ends. ``only_idle_tenants``: take only jobs of API keys with
        no job running in the queue (the slots kept for quiet keys, ``shared.fair_share``)."""
        self._lifecycle = lifecycle
        self.queue = queue
        self._worker_id = worker_id
        self._instance = instance
        self.num_slots = num_slots
        self._run_job = run_job
        self._poll_delay_s = poll_delay_s
        self._claim_gate = claim_gate
        self._claim_min_wait_s = claim_min_wait_s or (lambda: 0.0)
        self._on_jobs_changed = on_jobs_changed or (lambda: None)
        self._only_idle_tenants = only_idle_tenants
        self._recheck_in_s: float | None = None  # the queue's first job will be old enough then
        self._wake = asyncio.Event()
        self._is_claiming = True
        self._paused_until = 0.0  # monotonic
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def num_jobs_running(self) -> int:
        return len(self._tasks)

    def wake(self) -> None:
        self._wake.set()

    def pause(self, seconds: float) -> None:
        """Take no new job for ``seconds`` (this worker just left one it cannot read)."""
        self._paused_until = max(self._paused_until, time.monotonic() + seconds)

    def stop_claiming(self) -> None:
        """Take no new jobs from now on (draining); running ones go on."""
        self._is_claiming = False

    async def main(self) -> None:
        logger.info("consuming queue %s (%d slots)", self.queue, self.num_slots)
        backoff_s = _MIN_BACKOFF_S
        while True:
            try:
                await self._claim_while_room()
                backoff_s = _MIN_BACKOFF_S
            except (RedisError, OSError) as exc:
                logger.warning("claiming from %s failed (%s); retrying in %.1f s", self.queue, exc, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, _MAX_BACKOFF_S)
                continue
            wait_s = self._poll_delay_s if self._recheck_in_s is None else min(self._poll_delay_s, self._recheck_in_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait_s)
            self._wake.clear()

    async def cancel_running(self) -> None:
        """Cancel the running job tasks (each hands its job back) and wait for them."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _claim_while_room(self) -> None:
        self._recheck_in_s = None
        while self._is_claiming and len(self._tasks) < self.num_slots:
            paused_s = self._paused_until - time.monotonic()
            if paused_s > 0:
                self._recheck_in_s = paused_s
                return
            if self._claim_gate is not None and not self._claim_gate():
                return
            min_wait_s = self._claim_min_wait_s()
            claim = await self._lifecycle.claim(
                self.queue, self._worker_id, self._instance, min_wait_s, self._only_idle_tenants
            )
            if isinstance(claim, NotYet):
                self._recheck_in_s = claim.ready_in_s + 0.005
                return
            if claim is None:
                return
            task = asyncio.create_task(self._run_job(claim), name=f"job-{claim.job_id}")
            self._tasks.add(task)
            task.add_done_callback(self._job_ended)
            self._on_jobs_changed()

    def _job_ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("job task %s failed: %r", task.get_name(), task.exception())
        self._wake.set()  # a freed slot: look for the next job now
        self._on_jobs_changed()
