"""Worker process: register, load the model, start the engine, claim the model's jobs, and on
SIGTERM/SIGINT drain within ``drain_timeout_s`` (then hand unfinished jobs back) before leaving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

from redis.exceptions import RedisError

from shared.adapters import AdapterStore
from shared.job_lifecycle import Claim, JobLifecycle
from shared.log_setup import configure_logging
from shared.redis import RedisRefused, connect_redis, wait_for_redis
from shared.tasks import cancel_and_wait
from worker.kinds import make_kind
from worker.kinds.base import Engine
from worker.service.control import ControlListener
from worker.service.engine_thread import EngineThread
from worker.service.host_pool import HostPool
from worker.service.job_audit import JobAudit
from worker.service.job_runner import JobRunner
from worker.service.publisher import EventPublisher
from worker.service.queue_consumer import QueueConsumer
from worker.service.registry import WorkerRegistration
from worker.service.thread_budget import available_cores, cpu_set
from worker.settings import WorkerSettings

logger = logging.getLogger("relaylm.worker")


def make_consumer(
    settings: WorkerSettings,
    lifecycle: JobLifecycle,
    instance: str,
    runner: JobRunner[Any],
    num_slots: int,
    queue: str,
    priority: int = 0,
    claim_gate: Callable[[], bool] | None = None,
    claim_min_wait_s: Callable[[], float] | None = None,
    on_jobs_changed: Callable[[], None] | None = None,
    only_idle_tenants: bool = False,
) -> QueueConsumer:
    async def run_job(claim: Claim) -> None:
        await runner.run(claim, priority)

    return QueueConsumer(
        lifecycle, queue, settings.worker_id, instance, num_slots, run_job, settings.poll_delay_s, claim_gate,
        claim_min_wait_s, on_jobs_changed, only_idle_tenants,
    )  # fmt: skip


# The engine priority of a job in a slot kept for quiet API keys: admitted first, and the step
# that completes its prompt skips the other rows' decode, as an interactive prompt's does beside
# batch lines.
QUIET = -1
# After leaving a job it cannot read, a worker takes nothing for this long: a worker that reads
# the job takes it meanwhile.
_LEFT_JOB_PAUSE_S = 1.0


class EngineStopped(RuntimeError):
    """The engine loop died under a running worker."""


class WorkerProcess:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.keys = settings.keys
        self.redis = connect_redis(settings.redis_target)
        self.lifecycle = JobLifecycle(self.redis, self.keys)
        self.publisher = EventPublisher(settings.redis_target, self.keys)
        # Before the model loads: this worker's share of the host's cores (refined once registered).
        initial_threads = settings.num_threads or available_cores()
        self.kind = make_kind(settings, self.publisher.sink, initial_threads)
        self.registration = WorkerRegistration(
            self.redis, self.keys, settings.worker_id, settings.model_id, settings.heartbeat_interval_s, self.kind.task,
            cpus=cpu_set(), sizes_own_threads=settings.num_threads is None, lanes=settings.lanes,
        )  # fmt: skip
        self.engine_thread = EngineThread(self.kind.start, initial_threads)
        self.host_pool = HostPool(
            self.redis, self.keys, self.registration.info, available_cores(), settings.num_threads,
            self.engine_thread.set_num_threads,
        )  # fmt: skip
        self._was_busy = False
        self._background: set[asyncio.Task[None]] = set()  # heartbeats and key releases

    async def run(self, stop: asyncio.Event) -> None:
        s = self.settings
        if not await wait_for_redis(self.redis, s.redis_target, stop):
            return
        await self.registration.beat()
        self.registration.start()
        await self.host_pool.refresh()
        self.host_pool.start()
        logger.info("worker %s registered for model %s (%s); loading", s.worker_id, s.model_id, self.kind.task)
        engine = await self.engine_thread.start()
        consumers: list[QueueConsumer] = []

        def pause_consumers() -> None:
            for consumer in consumers:
                consumer.pause(_LEFT_JOB_PAUSE_S)

        def wake_consumers(_data: bytes) -> None:
            for consumer in consumers:
                consumer.wake()

        adapters = AdapterStore(self.redis, self.keys)
        runner = JobRunner(
            self.lifecycle, s.worker_id, s.model_id, self.kind.handler(), self.publisher, s.job_timeout_s,
            on_job_left=pause_consumers, adapters=adapters,
        )  # fmt: skip
        readiness = self.kind.describe(self.registration.info)
        for name, config, weights, rank, targets in readiness.adapters_to_store:
            if await adapters.ensure(name, s.model_id, config, weights, rank, targets):
                logger.info("adapter %s stored in Redis (%d bytes)", name, len(config) + len(weights))
        consumers.extend(self._consumers(runner, engine, readiness.fair_share_slots))
        self.registration.jobs_probe = lambda: sum(consumer.num_jobs_running for consumer in consumers)
        listener = ControlListener(
            self.redis,
            {
                self.keys.queue_wake_channel(s.model_id): wake_consumers,
                self.keys.cancel_channel(): lambda data: runner.cancel(data.decode()),
            },
            sharded=self.keys.sharded_channels,
        )
        await listener.start()
        if readiness.compile_probe is not None:
            self.registration.compile_probe = readiness.compile_probe
        if readiness.vision_probe is not None:
            self.registration.vision_probe = readiness.vision_probe
        if readiness.speculation_probe is not None:
            self.registration.speculation_probe = readiness.speculation_probe
        if readiness.follow_released_keys is not None:
            readiness.follow_released_keys(self._keys_released(asyncio.get_running_loop()))
        max_num_seqs = engine.max_running - readiness.fair_share_slots
        self.registration.set_ready(max_num_seqs, readiness.max_input_len, engine.load)
        await self.registration.beat()
        audit = JobAudit(
            self.lifecycle, sorted({consumer.queue for consumer in consumers}), self.registration.info.instance,
            lambda: runner.active_job_ids,
        )  # fmt: skip
        consume = asyncio.gather(*(consumer.main() for consumer in consumers), audit.main())
        logger.info(
            "worker %s ready: model %s (%s, %s), max length %d, max concurrency %d (and %d for quiet API keys)",
            s.worker_id, s.model_id, self.kind.task, readiness.source, readiness.max_input_len, max_num_seqs,
            readiness.fair_share_slots,
        )  # fmt: skip
        stopped = asyncio.create_task(stop.wait())
        engine_exited = asyncio.create_task(self.engine_thread.exited())
        waiting: set[asyncio.Future[Any]] = {consume, stopped, engine_exited}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if consume.done() and consume.exception() is not None:
            logger.error("queue consumer failed: %r", consume.exception())
        if engine_exited.done():
            # Leave the registry at once: APIs hand this worker's jobs to another worker (or end
            # their streams) within one liveness check instead of waiting on a dead engine.
            await self.registration.stop()
            await _stop_consuming(consume, listener)
            for consumer in consumers:
                await consumer.cancel_running()  # hand the jobs back for another worker
            await self._disconnect()
            raise EngineStopped(f"the engine stopped ({engine_exited.exception()!r}); exiting")
        await self._shutdown(engine, consumers, consume, listener)

    async def _disconnect(self) -> None:
        await self.host_pool.stop()
        self.publisher.close()
        await self.redis.aclose()

    def _consumers(self, runner: JobRunner[Any], engine: Engine[Any], fair_share_slots: int) -> list[QueueConsumer]:
        """The model's interactive queue, and its batch queue (as ``--lanes`` says): beside
        interactive work, batch lines take only the slots it leaves, never the reserved ones, and
        wait while requests queue in the engine; a batch-only worker gives them every slot. With
        ``fair_share_slots``, a second consumer of the interactive queue takes, while the first
        is full, only jobs of API keys with nothing else running (a quiet key's request)."""
        s = self.settings
        instance = self.registration.info.instance
        min_wait, changed = self.host_pool.claim_min_wait_s, self._jobs_changed
        num_slots = engine.max_running - fair_share_slots
        interactive = make_consumer(
            s, self.lifecycle, instance, runner, num_slots, self.keys.queue(s.model_id),
            claim_min_wait_s=min_wait, on_jobs_changed=changed,
        )  # fmt: skip
        quiet = [
            make_consumer(
                s, self.lifecycle, instance, runner, fair_share_slots, self.keys.queue(s.model_id),
                claim_gate=lambda: interactive.num_jobs_running >= interactive.num_slots, claim_min_wait_s=min_wait,
                priority=QUIET, on_jobs_changed=changed, only_idle_tenants=True,
            )
        ] if fair_share_slots and s.lanes != "batch" else []  # fmt: skip
        if s.lanes == "interactive":
            return [interactive, *quiet]
        reserved = s.batch_reserved_slots if s.batch_reserved_slots is not None else num_slots // 2
        batch_slots = num_slots if s.lanes == "batch" else max(1, num_slots - reserved)

        def has_room_for_batch() -> bool:
            busy = batch.num_jobs_running + (interactive.num_jobs_running if s.lanes == "all" else 0)
            return busy < batch_slots and engine.num_waiting == 0

        batch = make_consumer(
            s, self.lifecycle, instance, runner, batch_slots, self.keys.batch_queue(s.model_id), priority=1,
            claim_gate=has_room_for_batch, claim_min_wait_s=min_wait, on_jobs_changed=changed,
        )  # fmt: skip
        return [batch] if s.lanes == "batch" else [interactive, *quiet, batch]

    def _keys_released(self, loop: asyncio.AbstractEventLoop) -> Callable[[list[tuple[str, int]]], None]:
        """Prefix keys the engine holds no more leave this worker's held set (from the engine thread)."""
        info = self.registration.info

        async def release(released: list[tuple[str, int]]) -> None:
            try:
                await self.lifecycle.release_prefix_keys(info.worker_id, info.instance, released)
            except RedisError as exc:  # held a little longer: the set is trimmed and expires anyway
                logger.warning("could not release %d prefix keys: %s", len(released), exc)

        def from_engine(released: list[tuple[str, int]]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: the process is leaving
                loop.call_soon_threadsafe(lambda: self._in_background(release(released), "relaylm-release-keys"))

        return from_engine

    def _in_background(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _jobs_changed(self) -> None:
        """A worker that turns busy or idle says so at once: neighbours on its cores resize
        their threads on their next registry read instead of after a heartbeat."""
        busy = self.registration.jobs_probe() > 0
        if busy != self._was_busy:
            self._was_busy = busy
            self._in_background(self._beat_now(), "relaylm-beat-now")

    async def _beat_now(self) -> None:
        try:
            await self.registration.beat()
        except RedisError as exc:
            logger.warning("heartbeat failed: %s", exc)

    async def _shutdown(
        self,
        engine: Engine[Any],
        consumers: list[QueueConsumer],
        consume: asyncio.Future[list[None]],
        listener: ControlListener,
    ) -> None:
        s = self.settings
        logger.info("worker %s draining (up to %.0f s)", s.worker_id, s.drain_timeout_s)
        await self.registration.set_state("draining")
        await _drain(consumers, s.drain_timeout_s)
        await _stop_consuming(consume, listener)
        await self.registration.stop()
        engine.stop()
        self.engine_thread.join(timeout_s=10)
        await self._disconnect()
        logger.info("worker %s stopped", s.worker_id)


async def _stop_consuming(consume: asyncio.Future[list[None]], listener: ControlListener) -> None:
    await cancel_and_wait(consume)
    await listener.stop()


async def _drain(consumers: list[QueueConsumer], timeout_s: float) -> None:
    """Take no new jobs; let running ones finish until the deadline, then hand the rest back to
    the queue (each job's task requeues its job when cancelled) for another worker to continue."""
    for consumer in consumers:
        consumer.stop_claiming()

    def num_running() -> int:
        return sum(consumer.num_jobs_running for consumer in consumers)

    deadline = time.monotonic() + timeout_s
    while num_running() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for consumer in consumers:
        await consumer.cancel_running()


async def serve(settings: WorkerSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await WorkerProcess(settings).run(stop)
    except (RedisRefused, EngineStopped) as exc:
        raise SystemExit(f"relaylm worker: {exc}") from None


def run_worker(settings: WorkerSettings) -> None:
    configure_logging(settings.log_level, settings.log_format)
    asyncio.run(serve(settings))
