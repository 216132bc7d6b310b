"""Submit a chat job: check the registry, subscribe to the job's channel (confirmed), then store
the request and enqueue it in one Redis round trip, under the model's queue limit."""

from __future__ import annotations

import json
import logging
import time
import uuid

from arq.connections import ArqRedis
from arq.constants import expires_extra_ms as arq_expires_extra_ms
from arq.constants import job_key_prefix
from arq.jobs import serialize_job
from arq.utils import timestamp_ms
from redis.exceptions import RedisError

from api.event_router import EventRouter
from api.job_stream import DisconnectProbe, JobStream
from api.job_takeover import JobTakeover
from api.metrics import Metrics
from api.request_metrics import RequestObserver
from api.settings import ApiSettings
from api.worker_directory import WorkerDirectory
from shared import serialization
from shared.errors import ErrorKind, RelayError
from shared.event_log import read_event_log
from shared.jobs import CHAT_JOB_FUNCTION, AnyJob, ChatJob, CompletionJob, EmbeddingJob, decode_job, encode_job
from shared.log_setup import log_transition
from shared.openai.chat_request import ChatCompletionRequest
from shared.openai.completion_request import CompletionRequest
from shared.openai.embeddings import EmbeddingRequest
from shared.redis_keys import JOB_CANCEL_TTL_S, JOB_REQUEST_TTL_S, RedisKeys

logger = logging.getLogger(__name__)

_SCORE_BACKDATE_MS = 1000

# Store the request and enqueue its arq job in one round trip, unless the model's queue (queued and
# running jobs: arq keeps a job in its sorted set until it ends) is at its limit.
_ENQUEUE_IF_ROOM = """
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
redis.call('PSETEX', KEYS[2], ARGV[4], ARGV[5])
redis.call('ZADD', KEYS[3], ARGV[6], ARGV[7])
redis.call('PUBLISH', ARGV[8], '')
return 1
"""


SubmittableRequest = ChatCompletionRequest | CompletionRequest | EmbeddingRequest


def without_unknown_fields(request: SubmittableRequest, request_id: str) -> SubmittableRequest:
    """Unknown fields are accepted (clients send vendor extras), logged by name, and dropped."""
    if not request.model_extra:
        return request
    logger.info("request %s: ignoring unknown fields %s", request_id, sorted(request.model_extra))
    return type(request).model_validate(request.model_dump(exclude=set(request.model_extra)))


def job_id_for(prefix: str, request_id: str, is_ours: bool) -> str:
    """The response id carries the request id; a client's id gets a suffix, since clients may reuse ids."""
    return f"{prefix}-{request_id}" if is_ours else f"{prefix}-{request_id}-{uuid.uuid4().hex[:8]}"


def make_job(request: SubmittableRequest, request_id: str, is_ours: bool) -> AnyJob:
    created = int(time.time())
    if isinstance(request, ChatCompletionRequest):
        job_id = job_id_for("chatcmpl", request_id, is_ours)
        return ChatJob(kind="chat", job_id=job_id, request_id=request_id, created=created, request=request)
    if isinstance(request, CompletionRequest):
        job_id = job_id_for("cmpl", request_id, is_ours)
        return CompletionJob(kind="completion", job_id=job_id, request_id=request_id, created=created, request=request)
    job_id = job_id_for("embd", request_id, is_ours)
    return EmbeddingJob(kind="embedding", job_id=job_id, request_id=request_id, created=created, request=request)


class JobSubmitter:
    def __init__(
        self,
        redis: ArqRedis,
        keys: RedisKeys,
        router: EventRouter,
        directory: WorkerDirectory,
        settings: ApiSettings,
        metrics: Metrics,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.router = router
        self.directory = directory
        self.settings = settings
        self.metrics = metrics
        self.takeover = JobTakeover(redis, keys)
        self._enqueue_if_room = redis.register_script(_ENQUEUE_IF_ROOM)

    async def submit(
        self,
        request: SubmittableRequest,
        request_id: str | None = None,
        is_disconnected: DisconnectProbe | None = None,
        request_id_is_ours: bool = True,
    ) -> JobStream:
        arrived_at = time.monotonic()
        request_id = request_id or uuid.uuid4().hex
        await self.directory.require_live_worker(request.model)
        request = without_unknown_fields(request, request_id)
        job = make_job(request, request_id, request_id_is_ours)
        job_id = job.job_id
        observer = RequestObserver(self.metrics, request.model, arrived_at)
        channel = self.keys.job_events_channel(job_id)
        queue = await self.router.subscribe(channel)
        try:
            await self._enqueue(job)
        except BaseException:
            await self.router.unsubscribe(channel)
            raise
        observer.enqueued()
        log_transition(logger, "queued", job_id, request_id, model=request.model, stream=request.stream)
        if self.settings.log_prompts:
            logger.info("job %s prompt: %s", job_id, _prompt_for_log(request))
        return JobStream(self, job, queue, is_disconnected, observer)

    async def submit_detached(
        self, job: AnyJob, queue: str | None = None, limit: int | None = None, track: bool = False
    ) -> None:
        """Enqueue a job no client streams (a background job, a batch line): its result is
        collected from its event log. ``queue``: the model's interactive queue unless given;
        ``track``: add it to the background set that API processes collect results for."""
        await self._enqueue(job, queue, limit)
        if track:
            try:
                await self.redis.sadd(self.keys.background_jobs(), job.job_id)
            except RedisError as exc:
                raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc
        log_transition(logger, "queued", job.job_id, job.request_id, model=job.request.model, detached=True)

    async def _enqueue(self, job: AnyJob, queue: str | None = None, limit: int | None = None) -> None:
        """Write exactly what ``ArqRedis.enqueue_job`` writes (arq's job record under its key prefix,
        the id in the queue's sorted set), plus the request payload, in one script call.

        arq's own version first WATCHes the id to refuse duplicates, which costs two more round
        trips on the time-to-first-token path and buys nothing here: every job id is unique.
        """
        keys, model, job_id = self.keys, job.request.model, job.job_id
        queue = queue or keys.queue(model)
        limit = self.settings.max_pending_per_model if limit is None else limit
        enqueued_ms = timestamp_ms()
        arq_job = serialize_job(CHAT_JOB_FUNCTION, (job_id,), {}, None, enqueued_ms, serializer=serialization.serialize)
        # arq only starts jobs whose score is <= its own clock: a score stamped a millisecond
        # "in the future" (rounding, or another host's clock) would wait for the next 0.5 s poll.
        # Backdating every score by the same margin keeps FIFO order and removes that wait.
        score = enqueued_ms - _SCORE_BACKDATE_MS
        try:
            accepted = await self._enqueue_if_room(
                keys=[keys.job_request(job_id), job_key_prefix + job_id, queue],
                args=[
                    limit, encode_job(job), JOB_REQUEST_TTL_S,
                    arq_expires_extra_ms, arq_job, score, job_id, keys.queue_wake_channel(model),
                ],
            )  # fmt: skip
        except RedisError as exc:
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc
        if not accepted:
            self.metrics.request_failure.labels(model, "queue_full").inc()
            raise RelayError(
                ErrorKind.QUEUE_FULL,
                f"Model `{model}` has {limit} requests queued or running; retry shortly.",
                retry_after_s=self.settings.retry_after_s,
            )

    async def attach(self, job_id: str, last_event_id: int | None) -> JobStream:
        """A client reconnecting to a job (``Last-Event-ID``, possibly to another API process):
        subscribe first, then read the log, so no event falls between the two."""
        try:
            payload = await self.redis.get(self.keys.job_request(job_id))
        except RedisError as exc:
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc
        if payload is None:
            raise RelayError(ErrorKind.NOT_FOUND, f"No job `{job_id}` (it never existed or has expired).")
        job = decode_job(payload)
        channel = self.keys.job_events_channel(job_id)
        queue = await self.router.subscribe(channel)
        try:
            backlog = await read_event_log(self.redis, self.keys, job_id)
        except BaseException:
            await self.router.unsubscribe(channel)
            raise
        log_transition(logger, "reattached", job_id, job.request_id, last_event_id=last_event_id)
        observer = RequestObserver(self.metrics, job.request.model, time.monotonic())
        next_seq = 0 if last_event_id is None else last_event_id + 1
        return JobStream(self, job, queue, None, observer, backlog=backlog, next_seq=next_seq)

    async def release(self, stream: JobStream, cancel: bool) -> None:
        await self.router.unsubscribe(self.keys.job_events_channel(stream.job_id))
        if not cancel:
            return
        try:
            await self.redis.set(self.keys.job_cancelled(stream.job_id), b"1", ex=JOB_CANCEL_TTL_S)
            await self.redis.publish(self.keys.cancel_channel(), stream.job_id.encode())
        except RedisError:
            logger.warning("could not cancel job %s: Redis unavailable", stream.job_id)


def _prompt_for_log(request: SubmittableRequest) -> str:
    if isinstance(request, ChatCompletionRequest):
        return json.dumps([m.model_dump(exclude_none=True) for m in request.messages], ensure_ascii=False)
    if isinstance(request, CompletionRequest):
        return json.dumps(request.prompt, ensure_ascii=False)
    return json.dumps(request.input, ensure_ascii=False)
