"""Pooling modes and the token-budget cut of the embedding micro-batcher; every request it is
given ends with a done output, also when aborted or when its batch fails."""

from __future__ import annotations

import queue
import threading

import torch

from shared.errors import ErrorKind
from shared.events import ErrorEvent, StartEvent
from worker.embedding.engine import EmbeddingEngine, EmbeddingWork, _chunks_by_tokens, _pool
from worker.embedding.loader import LoadedEmbedder
from worker.engine.engine import RequestOutput


class _FailingModel(torch.nn.Module):
    """Stands in for a model whose forward fails (out of memory, a bad input): the engine's
    failure path is what is under test, not embeddings."""

    def forward(self, **_inputs: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("forward failed")


def _run_engine(submit: list[EmbeddingWork], aborts: dict[str, ErrorKind | None]) -> list[RequestOutput]:
    outputs: queue.Queue[RequestOutput] = queue.Queue()
    embedder = LoadedEmbedder(_FailingModel(), None, "mean", True, 16, 4, "failing")  # type: ignore[arg-type]
    engine = EmbeddingEngine(embedder, lambda batch: [outputs.put(output) for output in batch])
    for work in submit:
        engine.submit(work)
    for request_id, kind in aborts.items():  # before the loop starts: each finds its unit waiting
        engine.abort(request_id, kind, "stopping")
    thread = threading.Thread(target=engine.run_forever, daemon=True)
    thread.start()
    ended = [outputs.get(timeout=10) for _ in submit]
    engine.stop()
    thread.join(timeout=5)
    return sorted(ended, key=lambda output: output.request_id)


def _work(request_id: str) -> EmbeddingWork:
    return EmbeddingWork(request_id, [[1, 2, 3]], StartEvent(seq=0, worker_id="w", prompt_tokens=3))


def test_aborted_requests_end_with_their_error_or_silently_when_cancelled() -> None:
    ended = _run_engine([_work("a"), _work("b")], {"a": None, "b": ErrorKind.WORKER_SHUTTING_DOWN})
    assert [(output.request_id, output.is_done) for output in ended] == [("a", True), ("b", True)]
    assert ended[0].events == []
    assert isinstance(ended[1].events[-1], ErrorEvent)
    assert ended[1].events[-1].kind is ErrorKind.WORKER_SHUTTING_DOWN


def test_an_abort_leaves_alone_units_that_ended_and_units_submitted_after_it() -> None:
    outputs: queue.Queue[RequestOutput] = queue.Queue()
    embedder = LoadedEmbedder(_FailingModel(), None, "mean", True, 16, 4, "failing")  # type: ignore[arg-type]
    engine = EmbeddingEngine(embedder, lambda batch: [outputs.put(output) for output in batch])
    thread = threading.Thread(target=engine.run_forever, daemon=True)
    thread.start()
    try:
        engine.submit(_work("a"))
        first = outputs.get(timeout=10)
        engine.abort("a", None, "too late")  # "a" ended: nothing to stop
        engine.submit(_work("a"))  # the same job claimed again
        again = outputs.get(timeout=10)
    finally:
        engine.stop()
        thread.join(timeout=5)
    for output in (first, again):  # each ran (and met the failing model), neither was stopped silently
        assert output.is_done and isinstance(output.events[-1], ErrorEvent)
        assert output.events[-1].kind is ErrorKind.INTERNAL


def test_a_failed_batch_ends_each_of_its_requests_with_an_internal_error() -> None:
    ended = _run_engine([_work("a"), _work("b")], {})
    assert [output.request_id for output in ended] == ["a", "b"]
    for output in ended:
        assert output.is_done and isinstance(output.events[0], StartEvent)
        assert isinstance(output.events[-1], ErrorEvent) and output.events[-1].kind is ErrorKind.INTERNAL


def test_pooling_modes_ignore_padding() -> None:
    hidden = torch.tensor([[[1.0, 0.0], [3.0, 2.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert _pool(hidden, mask, "mean").tolist() == [[2.0, 1.0]]
    assert _pool(hidden, mask, "cls").tolist() == [[1.0, 0.0]]
    assert _pool(hidden, mask, "max").tolist() == [[3.0, 2.0]]


def test_batches_respect_the_token_budget_on_length_sorted_inputs() -> None:
    work = EmbeddingWork("r", [[1] * n for n in (1, 2, 3, 10, 10)], start_event=None)
    items = [(work, index) for index in range(5)]
    chunks = _chunks_by_tokens(items, budget=20)
    assert [[index for _, index in chunk] for chunk in chunks] == [[0, 1, 2], [3, 4]]
    assert all(len(chunk) * max(len(work.inputs[i]) for _, i in chunk) <= 20 for chunk in chunks)
    assert work.num_prompt_tokens == 26
