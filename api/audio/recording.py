"""One recording's window jobs: queued together, followed in order, cleaned up together.

Each window's samples wait in Redis under their own short TTL (not in the job's record, which
stays a day) and are deleted as soon as the window's text is here, or when the request ends
early. A worker that dies mid-window leaves its job to another, which sends only the segments
still missing: the stream simply goes on."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import anyio
import numpy as np
from fastapi import Request
from redis.exceptions import RedisError
from sse_starlette.sse import AppStatus

from api.audio.decode import SAMPLE_RATE
from api.audio.form import AudioRequest
from api.audio.windows import cut_windows
from api.jobs.build import job_id_for
from api.jobs.client import JobClient
from api.jobs.stream import ClientDisconnected, JobStream
from api.render.accumulator import JobFailed
from api.render.chat_stream import DONE, error_chunk
from api.render.transcript import Transcript
from api.tenancy import tenant_of
from api.wire.openai.audio import TranscriptionTextDeltaEvent
from shared.contract import Transcribe, TranscriptionJob
from shared.errors import ErrorKind, RelayError
from shared.events import EndEvent, ErrorEvent, SegmentEvent, TranscriptEvent
from shared.log_setup import log_transition

logger = logging.getLogger(__name__)


class Recording:
    """One recording's windows: queued together, followed in order, cleaned up together."""

    def __init__(self, jobs: JobClient, body: AudioRequest, samples: np.ndarray, arrived_at: float) -> None:
        """``samples``: the whole recording, 16 kHz mono int16."""
        self.jobs = jobs
        self.body = body
        self.samples = samples
        self.duration_s = len(samples) / SAMPLE_RATE
        self.arrived_at = arrived_at
        self.recording_id = ""  # set by submit
        self.streams: list[JobStream] = []
        self.offsets_s: list[float] = []
        self._audio_left: list[str] = []
        self.transcript = Transcript("translate" if body.translate else "transcribe", self.duration_s)

    async def submit(self, request: Request) -> None:
        """Store every window's samples, then queue every window (only the first counts towards
        the key's limit of open requests: a recording is one request)."""
        state, lifecycle = request.state, self.jobs.lifecycle
        samples_per_window = cut_windows(self.samples, self.jobs.settings.audio_window_s)
        recording_id = self.recording_id = job_id_for("trsc", state.request_id, state.request_id_is_ours)
        tenant, created = tenant_of(request).owner, int(time.time())
        jobs = []
        for index, (start, end) in enumerate(samples_per_window):
            offset_s, duration_s = start / SAMPLE_RATE, (end - start) / SAMPLE_RATE
            job = TranscriptionJob(
                job_id=f"{recording_id}-w{index:04d}", request_id=state.request_id, created=created, tenant=tenant,
                request=Transcribe(
                    model=self.body.model, window=index, num_windows=len(samples_per_window), offset_s=offset_s,
                    duration_s=duration_s, translate=self.body.translate, language=self.body.language,
                    prompt=self.body.prompt, temperature=self.body.temperature, seed=0, word_timestamps=self.body.words,
                ),
            )  # fmt: skip
            jobs.append((job, self.samples[start:end].astype("<i2").tobytes()))
        try:
            await lifecycle.store_audio({job.job_id: pcm for job, pcm in jobs})
        except RedisError as exc:
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc
        self._audio_left = [job.job_id for job, _ in jobs]
        log_transition(
            logger, "audio_queued", recording_id, state.request_id, model=self.body.model,
            seconds=round(self.duration_s, 2), windows=len(jobs),
        )  # fmt: skip
        try:
            for index, (job, _) in enumerate(jobs):
                stream = await self.jobs.stream(
                    job, request.is_disconnected, self.arrived_at, counts_for_key=index == 0
                )
                self.streams.append(stream)
                self.offsets_s.append(job.request.offset_s)
        except BaseException:
            await self.close()
            raise

    async def wait_for_start(self, timeout_s: float | None) -> bool:
        """Wait for window 0's first event, so that a worker's refusal is raised here (an HTTP
        error); False: the client left. A stream whose first window is still queued after
        ``timeout_s`` starts anyway (keep-alive comments flow meanwhile)."""
        try:
            first = await self.streams[0].first_event(timeout_s)
        except ClientDisconnected:
            return False
        if isinstance(first, ErrorEvent):
            raise first.to_exception()
        return True

    async def windows(self) -> AsyncIterator[str]:
        """Every window's segments in order, folded into the transcript as they come, each
        yielding what it added to the transcript's text; a window's error is raised."""
        for index, stream in enumerate(self.streams):
            async for event in stream.events():
                if isinstance(event, SegmentEvent):
                    yield self.transcript.add_segment(self.offsets_s[index], event)
                elif isinstance(event, TranscriptEvent):
                    self.transcript.add_summary(event)
                elif isinstance(event, EndEvent):
                    self.transcript.add_usage(stream.prompt_tokens or 0, event.usage.completion_tokens)
                elif isinstance(event, ErrorEvent):
                    raise JobFailed(event)
            await self._drop_audio([stream.job_id])
        self._observe()

    async def collect(self) -> Transcript:
        async for _ in self.windows():
            pass
        return self.transcript

    async def sse(self) -> AsyncIterator[dict[str, str]]:
        try:
            async for added_text in self.windows():
                if added_text:
                    yield {"data": TranscriptionTextDeltaEvent(delta=added_text).model_dump_json()}
            yield {"data": self.transcript.as_done_event().model_dump_json()}
        except RelayError as exc:
            yield error_chunk(exc)
        finally:
            with anyio.CancelScope(shield=True):
                await self.close(keep_jobs=AppStatus.should_exit)
        yield {"data": DONE}

    async def close(self, keep_jobs: bool = False) -> None:
        """Cancel the windows that did not finish and delete the samples still stored."""
        for stream in self.streams:
            await stream.close(keep_job=keep_jobs)
        if not keep_jobs:
            await self._drop_audio(self._audio_left)

    async def _drop_audio(self, job_ids: list[str]) -> None:
        dropping = [job_id for job_id in job_ids if job_id in self._audio_left]
        if not dropping:
            return
        self._audio_left = [job_id for job_id in self._audio_left if job_id not in dropping]
        try:
            await self.jobs.lifecycle.drop_audio(dropping)
        except RedisError:
            logger.warning("could not delete the audio of %s: it expires by itself", dropping)

    def _observe(self) -> None:
        metrics, model = self.jobs.metrics, self.body.model
        task = "translate" if self.body.translate else "transcribe"
        elapsed_s = time.monotonic() - self.arrived_at
        metrics.audio_seconds.labels(model, task).inc(self.duration_s)
        if self.duration_s > 0:
            metrics.audio_real_time_factor.labels(model).observe(elapsed_s / self.duration_s)
        log_transition(
            logger, "audio_finished", self.recording_id, self.streams[0].job.request_id,
            seconds=round(self.duration_s, 2), elapsed_s=round(elapsed_s, 2), segments=len(self.transcript.segments),
        )  # fmt: skip
