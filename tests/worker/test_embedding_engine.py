"""Pooling modes and the token-budget cut of the embedding micro-batcher."""

from __future__ import annotations

import torch

from worker.embedding.engine import EmbeddingWork, _chunks_by_tokens, _pool


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
