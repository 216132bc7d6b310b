"""Micro-batching for embeddings: requests that arrive while a batch runs (or within a short
wait) are embedded together, sorted by length and cut by a token budget so padding stays small.

Every submitted request ends with an output marked done (see :class:`InboxEngine`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.errors import ErrorKind
from shared.events import AnyEvent, EmbeddingsEvent, EndEvent, ErrorEvent, StartEvent, UsageCounts
from worker.embedding.loader import LoadedEmbedder
from worker.engine.engine import RequestOutput
from worker.engine.inbox import InboxEngine

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

    @property
    def num_completion_tokens(self) -> int:
        return 0


class EmbeddingEngine(InboxEngine[EmbeddingWork]):
    failure_message = "embedding failed inside the worker"

    def __init__(
        self, embedder: LoadedEmbedder, sink: Callable[[list[RequestOutput]], None], batch_wait_s: float = 0.002
    ) -> None:
        super().__init__(sink, _MAX_CONCURRENT_JOBS)
        self.embedder = embedder
        self._batch_wait_s = batch_wait_s

    def _gather(self, first: EmbeddingWork) -> list[EmbeddingWork]:
        time.sleep(self._batch_wait_s)  # let concurrent requests join this batch
        works = [first]
        while not self._inbox.empty():
            works.append(self._inbox.get_nowait())
        return works

    def _end(self, work: EmbeddingWork, kind: ErrorKind | None, message: str) -> None:
        self._sink([_ended(work, kind, message)])

    @torch.inference_mode()
    def _run(self, works: list[EmbeddingWork]) -> None:
        items = sorted(((w, i) for w in works for i in range(len(w.inputs))), key=lambda wi: len(wi[0].inputs[wi[1]]))
        results: dict[tuple[str, int], list[float]] = {}
        for chunk in _chunks_by_tokens(items, _BATCH_TOKENS):
            vectors = self._embed([work.inputs[index] for work, index in chunk])
            for (work, index), vector in zip(chunk, vectors, strict=True):
                results[(work.request_id, index)] = vector
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
