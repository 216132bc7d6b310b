"""Moves batches through their statuses. Every API process runs one; all state is in Redis and a
per-batch lock picks who advances a batch, so an API restart (or a second API process) carries
on where the last one stopped.

One advance of an in-progress batch: collect the lines whose jobs ended (a dead worker's line is
requeued by the housekeeper, up to ``JOB_MAX_ATTEMPTS``), then enqueue pending lines up to
``batch_concurrency`` on the model's batch queue, which workers serve only with capacity to
spare. Each line's result is written once (``HSETNX`` by line number), so a line appears exactly
once in the output or the error file whatever restarts happen. A line that cannot become a job
gets an error record; a batch whose advance fails does not hold up the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.batches.file_store import FileStore
from api.batches.store import BatchStore, StoredBatch
from api.batches.validation import REQUEST_MODELS, validate_batch_file
from api.jobs.build import BATCH, make_job
from api.jobs.client import JobClient
from api.jobs.detached import DetachedJobs, JobOutcome
from api.jobs.worker_directory import WorkerDirectory
from api.settings import ApiSettings
from api.wire.openai.batch import (
    BatchError,
    BatchErrors,
    BatchInputLine,
    BatchOutputLine,
    BatchRequestCounts,
    BatchResponseData,
)
from shared.errors import RelayError
from shared.job_lifecycle import JobLifecycle, JobState
from shared.redis_keys import RedisKeys
from shared.redis_replies import as_bytes, as_text
from shared.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


def output_line(line: BatchInputLine, job_id: str, outcome: JobOutcome) -> BatchOutputLine:
    response = BatchResponseData(status_code=outcome.status_code, request_id=job_id, body=outcome.body)
    return BatchOutputLine(id=f"batch_req_{uuid.uuid4().hex}", custom_id=line.custom_id, response=response)


def error_line(line: BatchInputLine, code: str, message: str) -> BatchOutputLine:
    """A line that never got a response (the batch expired or was cancelled first)."""
    return BatchOutputLine(
        id=f"batch_req_{uuid.uuid4().hex}", custom_id=line.custom_id, error={"code": code, "message": message}
    )


class BatchRunner:
    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        settings: ApiSettings,
        batches: BatchStore,
        files: FileStore,
        jobs: DetachedJobs,
        client: JobClient,
        directory: WorkerDirectory,
        lifecycle: JobLifecycle,
    ) -> None:
        self._redis = redis
        self._lifecycle = lifecycle
        self._keys = keys
        self._settings = settings
        self._batches = batches
        self._files = files
        self._jobs = jobs
        self._client = client
        self._directory = directory
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run_forever(), name="relaylm-batches")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    async def _run_forever(self) -> None:
        while True:
            try:
                await self.tick()
            except RedisError as exc:
                logger.warning("batch runner: Redis unavailable (%s); retrying", exc)
            except Exception:
                logger.exception("batch runner step failed; retrying")
            await asyncio.sleep(self._settings.batch_poll_interval_s)

    async def tick(self) -> None:
        for batch_id in await self._batches.active_ids():
            try:
                async with self._batches.locked(batch_id) as held:
                    if held:
                        await self.advance(batch_id)
            except RedisError:
                raise
            except Exception:
                logger.exception("batch %s: advancing it failed; failing it, the other batches go on", batch_id)
                try:
                    await self._fail_broken(batch_id)
                except Exception:
                    logger.exception("batch %s: could not mark it failed", batch_id)

    # -- batches --------------------------------------------------------------------------------
    async def advance(self, batch_id: str) -> StoredBatch:
        """One step of the batch's life; call with its lock held."""
        batch = await self._batches.get(batch_id)
        if batch.status == "validating":
            await self._validate(batch)
        if batch.status == "in_progress":
            if time.time() >= batch.expires_at:
                await self._collect(batch)  # lines that did finish keep their results
                await self._stop_lines(batch, "batch_expired", "The batch expired before this request ran.")
                await self._finish(batch, "expired")
            else:
                await self._collect(batch)
                await self._fill(batch)
                if await self._is_drained(batch):
                    batch.status, batch.finalizing_at = "finalizing", int(time.time())
                    await self._batches.save(batch)
        if batch.status == "finalizing":
            await self._finish(batch, "completed")
        if batch.status == "cancelling":
            await self._collect(batch)
            await self._stop_lines(batch, None, "")
            await self._finish(batch, "cancelled")
        return batch

    async def _validate(self, batch: StoredBatch) -> None:
        try:
            content = await self._files.content(batch.input_file_id)
        except RelayError:
            await self._fail(batch, [("missing_file", f"The input file `{batch.input_file_id}` no longer exists.")])
            return
        known = {record.model for record in await self._directory.model_records()}
        known |= {adapter.name for adapter in await self._directory.adapters.records()}
        checked = validate_batch_file(content, batch.endpoint, self._settings.batch_max_requests, known.__contains__)
        if checked.errors:
            batch.errors = BatchErrors(data=checked.errors[:100])
            batch.status, batch.failed_at = "failed", int(time.time())
            batch.request_counts = BatchRequestCounts(total=len(checked.lines) + len(checked.errors))
            await self._batches.save(batch)
            logger.info("batch %s failed validation: %d problems", batch.id, len(checked.errors))
            return
        keys = self._keys
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.batch_requests(batch.id), keys.batch_pending(batch.id))
            pipe.hset(
                keys.batch_requests(batch.id), mapping={n: line.model_dump_json() for n, line in checked.lines.items()}
            )
            pipe.rpush(keys.batch_pending(batch.id), *checked.lines)
            await pipe.execute()
        batch.model = checked.model
        batch.request_counts = BatchRequestCounts(total=len(checked.lines))
        batch.status, batch.in_progress_at = "in_progress", int(time.time())
        await self._batches.save(batch)
        logger.info("batch %s: %d requests for %s", batch.id, len(checked.lines), batch.model)

    async def _fail_broken(self, batch_id: str) -> None:
        """A batch whose advance raised (a bug, or data no check foresaw) ends failed instead of
        failing again on every tick."""
        batch = await self._batches.get(batch_id)
        if batch.status in ("validating", "in_progress", "finalizing", "cancelling"):
            await self._stop_lines(batch, "internal_error", "The batch failed inside the server.")
            await self._fail(batch, [("internal_error", "The batch could not be processed; see the server log.")])

    async def _fail(self, batch: StoredBatch, problems: list[tuple[str, str]]) -> None:
        batch.errors = BatchErrors(data=[BatchError(code=code, message=message) for code, message in problems])
        batch.status, batch.failed_at = "failed", int(time.time())
        await self._batches.save(batch)

    async def _fill(self, batch: StoredBatch) -> None:
        """Enqueue pending lines while fewer than ``batch_concurrency`` are queued or running."""
        keys = self._keys
        room = self._settings.batch_concurrency - int(await self._redis.hlen(keys.batch_running(batch.id)))
        if room <= 0:
            return
        numbers = [int(raw) for raw in await self._redis.lrange(keys.batch_pending(batch.id), 0, room - 1)]
        if not numbers:
            return
        assert batch.model is not None
        for number, line in (await self._lines(batch, numbers)).items():
            request_id = f"{batch.id}-{number}"
            try:
                request = REQUEST_MODELS[batch.endpoint].model_validate(line.body)
                job = make_job(request, request_id, is_ours=True, tenant=batch.tenant, priority=BATCH)  # type: ignore[arg-type]
                # An advance cut short after the enqueue but before the trim must not run a line twice.
                if await self._lifecycle.record(job.job_id) is None:
                    await self._client.batch_line(job)
            except RedisError:
                raise
            except Exception as exc:
                # One bad line must not stop its batch (or the batches behind it) on every tick.
                logger.warning("batch %s line %d cannot run: %s", batch.id, number, exc)
                written = error_line(line, "invalid_request", f"This request could not be run: {exc}")
                await self._redis.hsetnx(keys.batch_errors(batch.id), str(number), written.model_dump_json())
                continue
            await self._redis.hset(keys.batch_running(batch.id), str(number), job.job_id)
        await self._redis.ltrim(keys.batch_pending(batch.id), len(numbers), -1)

    async def _collect(self, batch: StoredBatch) -> None:
        """Write the result of every line whose job ended; requeue lines whose worker died."""
        keys = self._keys
        running = await self._running(batch)
        if not running:
            return
        states = await self._jobs.states(sorted(running.values()))
        lines = await self._lines(batch, list(running))
        for number, job_id in running.items():
            outcome = states[job_id].outcome
            if outcome is None:
                continue
            target = keys.batch_outputs(batch.id) if outcome.succeeded else keys.batch_errors(batch.id)
            written = output_line(lines[number], job_id, outcome)
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hsetnx(target, str(number), written.model_dump_json())
                pipe.hdel(keys.batch_running(batch.id), str(number))
                await pipe.execute()
        await self._count(batch)

    async def _stop_lines(self, batch: StoredBatch, code: str | None, message: str) -> None:
        """Cancel every line still queued or running; with ``code``, each gets an error line
        (an expired batch reports them); without, they are dropped (a cancelled batch)."""
        keys = self._keys
        running = await self._running(batch)
        if code is None:
            await self._lifecycle.cancel(list(running.values()), "the batch was cancelled")
        else:
            await self._lifecycle.cancel(list(running.values()), message, JobState.EXPIRED)
        pending = [int(raw) for raw in await self._redis.lrange(keys.batch_pending(batch.id), 0, -1)]
        if code is not None:
            lines = await self._lines(batch, [*running, *pending])
            for number in [*running, *pending]:
                written = error_line(lines[number], code, message)
                await self._redis.hsetnx(keys.batch_errors(batch.id), str(number), written.model_dump_json())
        await self._redis.delete(keys.batch_running(batch.id), keys.batch_pending(batch.id))
        await self._count(batch)

    async def _running(self, batch: StoredBatch) -> dict[int, str]:
        """Line number → job id of the lines enqueued and not yet collected."""
        raw = await self._redis.hgetall(self._keys.batch_running(batch.id))
        return {int(number): as_text(job_id) for number, job_id in raw.items()}

    async def _lines(self, batch: StoredBatch, numbers: list[int]) -> dict[int, BatchInputLine]:
        if not numbers:
            return {}
        raw_lines = await self._redis.hmget(self._keys.batch_requests(batch.id), numbers)
        return {n: BatchInputLine.model_validate_json(as_bytes(raw)) for n, raw in zip(numbers, raw_lines, strict=True)}

    async def _count(self, batch: StoredBatch) -> None:
        keys = self._keys
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hlen(keys.batch_outputs(batch.id))
            pipe.hlen(keys.batch_errors(batch.id))
            completed, failed = await pipe.execute()
        counts = batch.request_counts
        if (counts.completed, counts.failed) != (completed, failed):
            counts.completed, counts.failed = int(completed), int(failed)
            await self._batches.save(batch)

    async def _is_drained(self, batch: StoredBatch) -> bool:
        keys = self._keys
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.llen(keys.batch_pending(batch.id))
            pipe.hlen(keys.batch_running(batch.id))
            pending, running = await pipe.execute()
        return pending == 0 and running == 0

    async def _finish(self, batch: StoredBatch, status: str) -> None:
        """Write the output and error files (lines in input order), then the final status."""
        keys = self._keys
        for source, kind in ((keys.batch_outputs(batch.id), "output"), (keys.batch_errors(batch.id), "error")):
            lines = await self._redis.hgetall(source)
            if not lines:
                continue
            ordered = [as_text(value) for _, value in sorted(lines.items(), key=lambda item: int(item[0]))]
            content = ("\n".join(ordered) + "\n").encode()
            name = f"{batch.id}_{kind}.jsonl"
            created = await self._files.create(content, name, "batch_output", owner=batch.owner)
            if kind == "output":
                batch.output_file_id = created.id
            else:
                batch.error_file_id = created.id
        await self._count(batch)
        now = int(time.time())
        batch.status = status  # type: ignore[assignment]
        if status == "completed":
            batch.completed_at = now
        elif status == "expired":
            batch.expired_at = now
        else:
            batch.cancelled_at = now
        await self._batches.save(batch)
        logger.info("batch %s %s: %s", batch.id, status, batch.request_counts.model_dump())
