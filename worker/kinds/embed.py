"""The embedding worker: an encoder behind the micro-batching engine, for embedding jobs."""

from __future__ import annotations

from shared.contract import AnyJob, EmbeddingJob
from shared.errors import ErrorKind, RelayError
from shared.registry import WorkerInfo, WorkerTask
from worker.embedding.engine import EmbeddingEngine, EmbeddingWork
from worker.embedding.loader import LoadedEmbedder, load_embedder
from worker.engine.engine import OutputSink
from worker.kinds.base import Answer, JobInputs, Readiness, wrong_task
from worker.settings import WorkerSettings


class EmbeddingHandler:
    def __init__(self, embedder: LoadedEmbedder, engine: EmbeddingEngine) -> None:
        self.embedder = embedder
        self.engine = engine

    async def prepare(self, job: AnyJob, inputs: JobInputs) -> EmbeddingWork | Answer:
        """Embeddings arrive in one event: an interrupted job simply runs again."""
        if not isinstance(job, EmbeddingJob):
            raise wrong_task(job, "embeddings")
        request, embedder = job.request, self.embedder
        if request.dimensions is not None and request.dimensions != embedder.dimensions:
            message = f"Model `{request.model}` makes {embedder.dimensions}-dimensional embeddings only."
            raise RelayError(ErrorKind.INVALID_REQUEST, message, "dimensions")
        ids = [embedder.tokenizer.encode(item) if isinstance(item, str) else list(item) for item in request.inputs]
        vocab_size = embedder.tokenizer.vocab_size
        if any(not 0 <= t < vocab_size for row in ids for t in row):
            raise RelayError(ErrorKind.INVALID_REQUEST, f"Token ids must be in [0, {vocab_size}).", "input")
        longest = max(len(row) for row in ids)
        if longest > embedder.max_input_tokens:
            message = (
                f"This model's maximum input length is {embedder.max_input_tokens} tokens; "
                f"an input has {longest} tokens."
            )
            raise RelayError(ErrorKind.CONTEXT_LENGTH_EXCEEDED, message, "input")
        return EmbeddingWork(job.job_id, ids, start_event=None)


class EmbedKind:
    task: WorkerTask = "embed"

    def __init__(self, settings: WorkerSettings, sink: OutputSink) -> None:
        self.settings = settings
        self._sink = sink
        self._embedder: LoadedEmbedder | None = None
        self._engine: EmbeddingEngine | None = None

    def start(self) -> EmbeddingEngine:
        s = self.settings
        self._embedder = load_embedder(s.model, s.device, s.dtype)
        self._engine = EmbeddingEngine(self._embedder, self._sink)
        return self._engine

    def handler(self) -> EmbeddingHandler:
        assert self._embedder is not None and self._engine is not None, "the kind has not started"
        return EmbeddingHandler(self._embedder, self._engine)

    def describe(self, info: WorkerInfo) -> Readiness:
        assert self._embedder is not None, "the kind has not started"
        return Readiness(self._embedder.max_input_tokens, self._embedder.source)
