"""The Whisper worker: faster-whisper behind the window engine, for transcription windows."""

from __future__ import annotations

import numpy as np

from shared.contract import AnyJob, Transcribe, TranscriptionJob
from shared.errors import ErrorKind, RelayError
from shared.events import AnyEvent, SegmentEvent, TranscriptEvent
from shared.registry import WorkerInfo, WorkerTask
from worker.audio.engine import TranscriptionEngine, TranscriptionWork, WindowResume
from worker.audio.loader import LoadedWhisper, load_whisper
from worker.engine.engine import OutputSink
from worker.kinds.base import Answer, JobInputs, Readiness, wrong_task
from worker.settings import WorkerSettings


class TranscriptionHandler:
    """A Whisper worker's jobs: transcription windows, checked against what the model can do."""

    def __init__(self, whisper: LoadedWhisper, engine: TranscriptionEngine) -> None:
        self.whisper = whisper
        self.engine = engine

    async def prepare(self, job: AnyJob, inputs: JobInputs) -> TranscriptionWork | Answer:
        """The window with its samples and, when an earlier attempt sent part of it, where to continue."""
        if not isinstance(job, TranscriptionJob):
            raise wrong_task(job, "audio transcription")
        self.check(job.request)  # before any audio is read
        pcm = await inputs.audio()
        return self.prepare_window(job, pcm, _window_resume(inputs.claim.next_seq, await inputs.sent()))

    def prepare_window(self, job: TranscriptionJob, pcm: bytes, resume: WindowResume | None) -> TranscriptionWork:
        """``pcm``: the window's 16 kHz mono int16 samples; ``resume``: where an earlier attempt stopped."""
        self.check(job.request)
        samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        work = TranscriptionWork(job.job_id, job.request, samples, start_event=None)
        if resume is not None:
            work.continue_from(resume)
        return work

    def check(self, request: Transcribe) -> None:
        """What the model cannot do, refused before any audio is decoded."""
        whisper = self.whisper
        if request.translate and not whisper.is_multilingual:
            message = f"Model `{request.model}` is English-only; it cannot translate."
            raise RelayError(ErrorKind.INVALID_REQUEST, message, "model")
        if request.language is None or request.language in whisper.languages:
            return
        if whisper.is_multilingual:
            message = (
                f"Model `{request.model}` does not know the language `{request.language}`; "
                "use an ISO-639-1 code such as `en`, `de` or `es`."
            )
        else:
            message = f"Model `{request.model}` is English-only; the language must be `en`, not `{request.language}`."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "language")


def _window_resume(next_seq: int, sent: list[AnyEvent] | None) -> WindowResume | None:
    """What the window's earlier attempts sent, from its event log."""
    if sent is None:
        return None
    segments = [event for event in sent if isinstance(event, SegmentEvent)]
    has_transcript = any(isinstance(event, TranscriptEvent) for event in sent)
    num_tokens = sum(len(segment.tokens) for segment in segments)
    return WindowResume(next_seq, len(segments), num_tokens, has_transcript)


class TranscribeKind:
    task: WorkerTask = "transcribe"

    def __init__(self, settings: WorkerSettings, sink: OutputSink, num_threads: int) -> None:
        """``num_threads``: CTranslate2 keeps the thread count it is loaded with."""
        self.settings = settings
        self._sink = sink
        self._num_threads = num_threads
        self._whisper: LoadedWhisper | None = None
        self._engine: TranscriptionEngine | None = None

    def start(self) -> TranscriptionEngine:
        s = self.settings
        self._whisper = load_whisper(s.model, s.cache_dir, s.device, self._num_threads)
        self._engine = TranscriptionEngine(self._whisper, self._sink)
        return self._engine

    def handler(self) -> TranscriptionHandler:
        assert self._whisper is not None and self._engine is not None, "the kind has not started"
        return TranscriptionHandler(self._whisper, self._engine)

    def describe(self, info: WorkerInfo) -> Readiness:
        assert self._whisper is not None, "the kind has not started"
        info.english_only = not self._whisper.is_multilingual  # the API refuses what it cannot do
        # Windows, not tokens: the API cuts recordings into windows of at most 30 s.
        return Readiness(0, self._whisper.source)
