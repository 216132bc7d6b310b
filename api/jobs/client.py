"""Start a job and follow it: check the registry, subscribe to the job's channel (confirmed) when
a client streams it, then create the queued job through the lifecycle in one Redis round trip,
under the model's queue limit and its key's."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from redis.exceptions import RedisError

from api.jobs.build import SubmittableRequest, prompt_token_estimate
from api.jobs.event_router import EventRouter
from api.jobs.stream import DisconnectProbe, JobStream, StreamServices
from api.jobs.worker_directory import WorkerDirectory
from api.metrics import Metrics
from api.request_metrics import RequestObserver
from api.settings import ApiSettings
from api.tenancy import SINGLE_USER, Tenant
from shared.contract import (
    AnyJob,
    ChatJob,
    CompletionJob,
    EmbeddingJob,
    Generate,
    Tokenize,
    TokenizeJob,
    TranscriptionJob,
    decode_job,
    encode_delivery,
    encode_job,
)
from shared.errors import ErrorKind, RelayError
from shared.job_lifecycle import JobLifecycle, JobQueueFull, ShareOf, TenantJobsFull
from shared.log_setup import log_transition
from shared.placement import prefix_keys
from shared.redis_keys import RedisKeys

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobClient:
    """Starts every job the API runs, and follows it: ``stream`` (a client reads the events as
    they come), ``detach`` (a background job: nobody streams it, its result is kept once it
    ends), ``batch_line`` (a batch's line, in its batch queue) and ``attach`` (a client comes
    back to a job). A started job's model is checked once, here, for a live worker (a batch line
    is not: it waits for one within its batch's window)."""

    lifecycle: JobLifecycle
    keys: RedisKeys
    router: EventRouter
    directory: WorkerDirectory
    settings: ApiSettings
    metrics: Metrics

    @property
    def _services(self) -> StreamServices:
        return StreamServices(self.lifecycle, self.router, self.directory, self.settings)

    async def stream(
        self,
        job: AnyJob,
        is_disconnected: DisconnectProbe | None = None,
        arrived_at: float | None = None,
        counts_for_key: bool = True,
        images: Mapping[str, bytes] | None = None,
    ) -> JobStream:
        """Queue ``job`` and stream its events. ``counts_for_key``: the job counts towards its
        key's limit of open requests (one job of a request made of several counts, the others
        not); ``images``: the bytes of the images the job names, by SHA-256."""
        arrived_at = time.monotonic() if arrived_at is None else arrived_at
        job = await self._on_base(job)
        request_id, job_id, model = job.request_id, job.job_id, job.model
        await self.directory.require_worker(model)
        observer = RequestObserver(self.metrics, model, arrived_at)
        channel = self.keys.job_events_channel(job_id)
        queue = await self.router.subscribe(channel)
        try:
            await self._enqueue(job, counts_for_key=counts_for_key, images=images)
        except BaseException:
            await self.router.unsubscribe(channel)
            raise
        observer.enqueued()
        log_transition(logger, "queued", job_id, request_id, model=model, stream=job.delivery.stream)
        if self.settings.log_prompts:
            logger.info("job %s prompt: %s", job_id, _prompt_for_log(job))
        return JobStream(self._services, job, queue, is_disconnected, observer)

    async def detach(self, job: AnyJob, images: Mapping[str, bytes] | None = None) -> None:
        """Queue a background job: API processes keep its result once it ends
        (:class:`~api.jobs.results.ResultStore`), and it counts towards its key's limit of open
        requests, as a streamed request does."""
        job = await self._on_base(job)
        await self.directory.require_worker(job.model)
        await self._enqueue(job, images=images)
        try:
            await self.lifecycle.track_background(job.job_id)
        except RedisError as exc:
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc
        log_transition(logger, "queued", job.job_id, job.request_id, model=job.model, detached=True)

    async def batch_line(self, job: AnyJob) -> None:
        """Queue a batch line in its model's batch queue, under no queue limit and outside its
        key's (a batch's lines are limited when the batch is created); the batch runner collects it."""
        job = await self._on_base(job)
        await self._enqueue(job, self.keys.batch_queue(job.model), limit=0, counts_for_key=False)
        log_transition(logger, "queued", job.job_id, job.request_id, model=job.model, detached=True)

    async def _on_base(self, job: AnyJob) -> AnyJob:
        """A job that names a LoRA adapter as its model, as its base model's job: generation jobs
        carry the adapter for the worker to apply; tokenizing is the base model's own."""
        adapter = await self.directory.adapter_of(job.model)
        if adapter is None:
            return job
        request = job.request
        if isinstance(request, Generate):
            request = request.model_copy(update={"model": adapter.base, "adapter": adapter.name})
        elif isinstance(request, Tokenize):
            chat = request.chat.model_copy(update={"model": adapter.base}) if request.chat is not None else None
            request = request.model_copy(update={"model": adapter.base, "chat": chat})
        else:
            message = f"`{adapter.name}` is a LoRA adapter of a generation model; it serves chat and completions."
            raise RelayError(ErrorKind.INVALID_REQUEST, message, "model")
        return job.model_copy(update={"request": request})

    async def _enqueue(
        self,
        job: AnyJob,
        queue: str | None = None,
        limit: int | None = None,
        counts_for_key: bool = True,
        images: Mapping[str, bytes] | None = None,
    ) -> None:
        """Store the request and queue the job in one round trip, under the queue's limit and its
        key's (batch lines have their own per-key limit, checked when the batch is created). The
        images it names are stored first: a worker may claim the job the moment it exists."""
        model = job.model
        queue = queue or self.keys.queue(model)
        limit = self.settings.max_pending_per_model if limit is None else limit
        key_limit = self.settings.max_requests_per_key if counts_for_key else 0
        try:
            payload = self._payload(job, await self.directory.readable_version(model))
            if images:
                await self.lifecycle.store_images(dict(images))
            delivery = encode_delivery(job)
            # Interactive jobs only: a batch line runs on spare capacity wherever there is some.
            keys = prefix_keys(job) if queue == self.keys.queue(model) else []
            # A conversation's first message alone places nothing: the create script looks for a
            # holder only from the second message on.
            window_s = self.settings.placement_window_s if len(keys) > 1 else 0.0
            preferred = await self.lifecycle.create(
                job.job_id, payload, model, queue, limit, job.tenant, key_limit, delivery, keys, window_s,
                prompt_token_estimate(job), self._share(job),
            )  # fmt: skip
            if keys and self.settings.placement_window_s > 0:
                self.metrics.placements.labels(model, "matched" if preferred else "none").inc()
        except RedisError as exc:
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc
        except TenantJobsFull:
            self.metrics.request_failure.labels(model, "key_limit").inc()
            raise RelayError(
                ErrorKind.KEY_LIMIT_REACHED,
                f"This API key has {key_limit} requests queued or running, its limit; retry shortly.",
                retry_after_s=self.settings.retry_after_s,
            ) from None
        except JobQueueFull:
            self.metrics.request_failure.labels(model, "queue_full").inc()
            raise RelayError(
                ErrorKind.QUEUE_FULL,
                f"Model `{model}` has {limit} requests queued or running; retry shortly.",
                retry_after_s=self.settings.retry_after_s,
            ) from None

    def _share(self, job: AnyJob) -> ShareOf:
        """The job's place in its queue: its key's share (one shared tenant with the fair share
        off), its client's priority."""
        if not self.settings.fair_share:
            return ShareOf(priority=job.queue_priority, band=job.queue_priority)
        return ShareOf(job.tenant or "", job.queue_priority, job.share_band, job.share_weight)

    @staticmethod
    def _payload(job: AnyJob, version: int) -> bytes:
        """The job as ``version`` (what every live worker of its model reads) writes it; 503 for a
        job that version cannot carry (images, while older workers are still live)."""
        try:
            return encode_job(job, version)
        except ValueError as exc:
            raise RelayError(
                ErrorKind.NO_LIVE_WORKER,
                f"Model `{job.model}` has live workers of an older release that cannot run this request "
                f"({exc}); retry once they are upgraded.",
                "model",
            ) from None

    async def attach(self, job_id: str, last_event_id: int | None, tenant: Tenant = SINGLE_USER) -> JobStream:
        """A client reconnecting to a job (``Last-Event-ID``, possibly to another API process):
        subscribe first, then read the log, so no event falls between the two. An id the job
        never sent is a 400; a client that already has an ended job's last event gets the end.
        Another key's job is a 404, the same as one that never existed."""
        if last_event_id is not None and last_event_id < 0:
            raise RelayError(
                ErrorKind.INVALID_REQUEST, "Last-Event-ID must be an event id (0 or more).", "last_event_id"
            )
        try:
            record = await self.lifecycle.record(job_id)
            stored = await self.lifecycle.stored(job_id)
        except RedisError as exc:
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc
        job = decode_job(stored.payload, stored.delivery) if stored is not None else None
        if record is None or job is None or not tenant.can_see(job.tenant):
            raise RelayError(ErrorKind.NOT_FOUND, f"No job `{job_id}` (it never existed or has expired).")
        next_seq = 0 if last_event_id is None else last_event_id + 1
        has_everything = record.state.is_final and next_seq == record.next_seq
        if next_seq > record.next_seq:
            raise RelayError(
                ErrorKind.INVALID_REQUEST,
                f"Last-Event-ID {last_event_id} is past the last event of job `{job_id}` ({record.next_seq - 1}).",
                "last_event_id",
            )
        channel = self.keys.job_events_channel(job_id)
        queue = await self.router.subscribe(channel)
        try:
            backlog = [] if has_everything else await self.lifecycle.read_log(job_id, next_seq)
        except RedisError as exc:
            await self.router.unsubscribe(channel)
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc
        log_transition(logger, "reattached", job_id, job.request_id, last_event_id=last_event_id)
        observer = RequestObserver(self.metrics, job.model, time.monotonic())
        return JobStream(
            self._services, job, queue, None, observer, backlog=backlog, next_seq=next_seq, is_finished=has_everything
        )


def log_unknown_fields(request: SubmittableRequest, request_id: str) -> None:
    """Unknown fields are accepted (clients send vendor extras), logged by name, and never read."""
    if request.model_extra:
        logger.info("request %s: ignoring unknown fields %s", request_id, sorted(request.model_extra))


def _prompt_for_log(job: AnyJob) -> str:
    request = job.request
    if isinstance(job, TokenizeJob):
        tokenize = job.request
        if tokenize.chat is not None:
            return _messages_for_log(tokenize.chat)
        return json.dumps(tokenize.prompt if tokenize.prompt is not None else tokenize.tokens, ensure_ascii=False)
    if isinstance(job, ChatJob):
        return _messages_for_log(job.request)
    if isinstance(job, CompletionJob):
        return json.dumps(job.request.prompts, ensure_ascii=False)
    if isinstance(job, TranscriptionJob):
        return json.dumps(job.request.prompt, ensure_ascii=False)  # the text prompt; never the audio
    assert isinstance(job, EmbeddingJob)
    return json.dumps(request.inputs, ensure_ascii=False)  # type: ignore[union-attr]


def _messages_for_log(generate: Generate) -> str:
    messages = [message.model_dump(exclude_defaults=True) for message in generate.messages or []]
    return json.dumps(messages, ensure_ascii=False)
