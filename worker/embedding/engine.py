"""Micro-batching for embeddings: requests that arrive while a batch runs (or within a short
wait) are embedded together, sorted by length and cut by a token budget so padding stays small.

Every submitted request ends with an output marked done, also when it was aborted or its batch
failed: the job runner waits for that, and so does the client's stream."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.errors import ErrorKind
from shared.events import AnyEvent, EmbeddingsEvent, EndEvent, ErrorEvent, StartEvent, UsageCounts
from worker.embedding.loader import LoadedEmbedder
from worker.engine.engine import RequestOutput

logger = logging.getLogger(__name__)

_MAX_CONCURRENT_JOBS = 64
_BATCH_TOKENS = 8192


@dataclass
class EmbeddingWork:
    request_id: str
    inputs: list[list[int]]
    start_event: StartEvent | None
    priority: int = 0  # kept for the job runner's sake; embedding micro-batches are small and FIFO

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)


class EmbeddingEngine:
    def __init__(
        self, embedder: LoadedEmbedder, sink: Callable[[list[RequestOutput]], None], batch_wait_s: float = 0.002
    ) -> None:
        self.embedder = embedder
        self._sink = sink
        self._batch_wait_s = batch_wait_s
        self._inbox: queue.Queue[EmbeddingWork] = queue.Queue()
        self._aborted: dict[str, tuple[ErrorKind | None, str]] = {}
        self._stopping = threading.Event()
        self.max_running = _MAX_CONCURRENT_JOBS
        self.num_batches = 0
        self.before_step: Callable[[], None] | None = None  # run on the loop's thread before each batch

    def submit(self, work: EmbeddingWork) -> None:
        self._inbox.put(work)

    def abort(self, request_id: str, kind: ErrorKind | None = None, message: str = "") -> None:
        """Drop a request not yet embedded; with ``kind`` its stream ends with that error."""
        self._aborted[request_id] = (kind, message)

    def load(self) -> tuple[int, int, float, float]:
        return 0, self._inbox.qsize(), 0.0, 0.0

    @property
    def num_waiting(self) -> int:
        return self._inbox.qsize()

    def stop(self) -> None:
        self._stopping.set()

    def run_forever(self) -> None:
        while not self._stopping.is_set():
            if self.before_step is not None:
                self.before_step()
            try:
                first = self._inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            time.sleep(self._batch_wait_s)  # let concurrent requests join this batch
            works = [first]
            while not self._inbox.empty():
                works.append(self._inbox.get_nowait())
            aborted = {w.request_id: self._aborted.pop(w.request_id) for w in works if w.request_id in self._aborted}
            if aborted:
                self._sink([_ended(w, *aborted[w.request_id]) for w in works if w.request_id in aborted])
            live = [w for w in works if w.request_id not in aborted]
            try:
                if live:
                    self._run_batch(live)
            except Exception:
                logger.exception("embedding batch failed")
                self._sink([_ended(w, ErrorKind.INTERNAL, "embedding failed inside the worker") for w in live])

    @torch.inference_mode()
    def _run_batch(self, works: list[EmbeddingWork]) -> None:
        items = sorted(((w, i) for w in works for i in range(len(w.inputs))), key=lambda wi: len(wi[0].inputs[wi[1]]))
        results: dict[tuple[str, int], list[float]] = {}
        for chunk in _chunks_by_tokens(items, _BATCH_TOKENS):
            vectors = self._embed([work.inputs[index] for work, index in chunk])
            for (work, index), vector in zip(chunk, vectors, strict=True):
                results[(work.request_id, index)] = vector
        self.num_batches += 1
        logger.info("embedding batch: %d requests, %d inputs", len(works), len(items))
        self._sink([self._output(work, results) for work in works])

    def _embed(self, inputs: list[list[int]]) -> list[list[float]]:
        device = next(self.embedder.model.parameters()).device
        length = max(len(ids) for ids in inputs)
        input_ids = torch.zeros(len(inputs), length, dtype=torch.long, device=device)
        mask = torch.zeros(len(inputs), length, dtype=torch.long, device=device)
        for row, ids in enumerate(inputs):
            input_ids[row, : len(ids)] = torch.tensor(ids, device=device)
            mask[row, : len(ids)] = 1
        hidden = self.embedder.model(input_ids=input_ids, attention_mask=mask).last_hidden_state.float()
        pooled = _pool(hidden, mask, self.embedder.pooling)
        if self.embedder.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled.cpu().tolist()

    @staticmethod
    def _output(work: EmbeddingWork, results: dict[tuple[str, int], list[float]]) -> RequestOutput:
        vectors = [results[(work.request_id, index)] for index in range(len(work.inputs))]
        events: list[AnyEvent] = [] if work.start_event is None else [work.start_event]
        events += [
            EmbeddingsEvent(seq=1, vectors=vectors),
            EndEvent(seq=2, usage=UsageCounts(prompt_tokens=work.num_prompt_tokens, completion_tokens=0)),
        ]
        return RequestOutput(work.request_id, events, True)


def _ended(work: EmbeddingWork, kind: ErrorKind | None, message: str) -> RequestOutput:
    """The last output of a request that will not be embedded: its error, or nothing (cancelled)."""
    events: list[AnyEvent] = []
    if kind is not None:
        events = [] if work.start_event is None else [work.start_event]
        events.append(ErrorEvent(seq=1, kind=kind, message=message))
    return RequestOutput(work.request_id, events, True)


def _pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def _chunks_by_tokens(items: list[tuple[EmbeddingWork, int]], budget: int) -> list[list[tuple[EmbeddingWork, int]]]:
    """Length-sorted items cut so that rows x longest row stays within the token budget."""
    chunks: list[list[tuple[EmbeddingWork, int]]] = []
    current: list[tuple[EmbeddingWork, int]] = []
    for work, index in items:
        length = len(work.inputs[index])
        if current and (len(current) + 1) * length > budget:
            chunks.append(current)
            current = []
        current.append((work, index))
    if current:
        chunks.append(current)
    return chunks
