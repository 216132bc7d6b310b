"""What a worker does with each kind of job, per task: a generation worker prepares chat and
text-completion jobs for the batching engine; an embedding worker tokenizes inputs for the
micro-batching engine; a Whisper worker turns a window's samples into work for the
transcription engine. Each refuses the others' jobs with a clear 400."""

from __future__ import annotations

from typing import Literal, Protocol, cast

import numpy as np

from shared.contract import AnyJob, ChatJob, CompletionJob, EmbeddingJob, TokenizeJob, Transcribe, TranscriptionJob
from shared.errors import ErrorKind, RelayError
from shared.events import StartEvent
from worker.audio.engine import TranscriptionEngine, TranscriptionWork, WindowResume
from worker.audio.loader import LoadedWhisper
from worker.embedding.engine import EmbeddingEngine, EmbeddingWork
from worker.embedding.loader import LoadedEmbedder
from worker.engine.engine import LLMEngine
from worker.engine.sequence import EngineRequest, ResumeState
from worker.models.loader import LoadedModel
from worker.requests.params import RequestLimits
from worker.requests.prepare import chat_prompt_ids, prepare_chat, prepare_completion
from worker.requests.tooling import ToolingConfig
from worker.structured import ConstraintCompiler

ImageBytes = dict[str, bytes]


class Work(Protocol):
    start_event: StartEvent | None
    priority: int

    @property
    def num_prompt_tokens(self) -> int: ...


class Engine(Protocol):
    max_running: int

    def submit(self, work: EngineRequest | EmbeddingWork | TranscriptionWork) -> None: ...

    def abort(self, request_id: str, *args: object) -> None: ...

    @property
    def num_waiting(self) -> int: ...


class JobHandler(Protocol):
    engine: Engine

    def prepare(self, job: AnyJob, resume: ResumeState | None, images: ImageBytes | None = None) -> Work:
        """The engine's unit of work for ``job`` (continuing ``resume``; ``images``: the bytes of
        the images it names, by hash); RelayError when it cannot run here."""

    def tokenize(self, job: TokenizeJob, images: ImageBytes | None = None) -> tuple[list[int], str | None]:
        """The job's token ids and (detokenizing) their text; RelayError when this worker cannot tell."""


def _wrong_task(job: AnyJob, serves: str) -> RelayError:
    return RelayError(ErrorKind.INVALID_REQUEST, f"Model `{job.model}` serves {serves} only.", "model")


class GenerationHandler:
    def __init__(
        self,
        loaded: LoadedModel,
        tooling: ToolingConfig,
        engine: LLMEngine,
        max_tokens_over_context: Literal["clamp", "error"] = "clamp",
    ) -> None:
        self.loaded = loaded
        self.tooling = tooling
        self.engine = engine
        self.max_tokens_over_context = max_tokens_over_context
        self._compiler: ConstraintCompiler | None = None

    def get_compiler(self) -> ConstraintCompiler:
        """Built on the first constrained request: its token trie takes about a second to make."""
        if self._compiler is None:
            self._compiler = ConstraintCompiler(
                self.loaded.tokenizer, self.engine.runner.vocab_size, self.loaded.eos_token_ids
            )
        return self._compiler

    def prepare(self, job: AnyJob, resume: ResumeState | None, images: ImageBytes | None = None) -> EngineRequest:
        limits = RequestLimits(self.engine.max_running, self.max_tokens_over_context)
        if isinstance(job, ChatJob):
            request = prepare_chat(
                job.job_id, job.request, self.loaded, self.tooling, limits, self.get_compiler, images
            )
        elif isinstance(job, CompletionJob):
            request = prepare_completion(job.job_id, job.request, self.loaded, limits)
        else:
            raise _wrong_task(job, "chat and text completions")
        request.resume = resume
        return request

    def tokenize(self, job: TokenizeJob, images: ImageBytes | None = None) -> tuple[list[int], str | None]:
        request, tokenizer = job.request, self.loaded.tokenizer
        if request.tokens is not None:
            vocab_size = self.loaded.vocab_size
            outside = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
            if outside is not None:
                message = f"Token id {outside} is outside this model's vocabulary [0, {vocab_size})."
                raise RelayError(ErrorKind.INVALID_REQUEST, message, "tokens")
            return request.tokens, cast(str, tokenizer.decode(request.tokens))  # one sequence: one string
        if request.chat is not None:
            return chat_prompt_ids(request.chat, self.loaded, self.tooling, images), None
        return tokenizer.encode(request.prompt or "", add_special_tokens=request.add_special_tokens), None


class EmbeddingHandler:
    def __init__(self, embedder: LoadedEmbedder, engine: EmbeddingEngine) -> None:
        self.embedder = embedder
        self.engine = engine

    def prepare(self, job: AnyJob, resume: ResumeState | None, images: ImageBytes | None = None) -> EmbeddingWork:
        """Embeddings arrive in one event: an interrupted job simply runs again."""
        if not isinstance(job, EmbeddingJob):
            raise _wrong_task(job, "embeddings")
        request, embedder = job.request, self.embedder
        if request.dimensions is not None and request.dimensions != embedder.dimensions:
            message = f"Model `{request.model}` makes {embedder.dimensions}-dimensional embeddings only."
            raise RelayError(ErrorKind.INVALID_REQUEST, message, "dimensions")
        inputs = [embedder.tokenizer.encode(item) if isinstance(item, str) else list(item) for item in request.inputs]
        vocab_size = embedder.tokenizer.vocab_size
        if any(not 0 <= t < vocab_size for ids in inputs for t in ids):
            raise RelayError(ErrorKind.INVALID_REQUEST, f"Token ids must be in [0, {vocab_size}).", "input")
        longest = max(len(ids) for ids in inputs)
        if longest > embedder.max_input_tokens:
            message = (
                f"This model's maximum input length is {embedder.max_input_tokens} tokens; "
                f"an input has {longest} tokens."
            )
            raise RelayError(ErrorKind.CONTEXT_LENGTH_EXCEEDED, message, "input")
        return EmbeddingWork(job.job_id, inputs, start_event=None)

    def tokenize(self, job: TokenizeJob, images: ImageBytes | None = None) -> tuple[list[int], str | None]:
        raise _wrong_task(job, "embeddings")


class TranscriptionHandler:
    """A Whisper worker's jobs: transcription windows, checked against what the model can do."""

    def __init__(self, whisper: LoadedWhisper, engine: TranscriptionEngine) -> None:
        self.whisper = whisper
        self.engine = engine

    def prepare(self, job: AnyJob, resume: ResumeState | None, images: ImageBytes | None = None) -> TranscriptionWork:
        raise _wrong_task(job, "audio transcription")

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

    def tokenize(self, job: TokenizeJob, images: ImageBytes | None = None) -> tuple[list[int], str | None]:
        raise _wrong_task(job, "audio transcription")
