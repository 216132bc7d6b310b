"""Log-probabilities of sampled tokens, for the rows that asked: one batched log-softmax over the
model's raw logits (before penalties, temperature and truncation, as vLLM reports by default)."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from shared.events import TokenLogprob, TopLogprob
from worker.engine.sequence import Sequence

TokenText = Callable[[int], str]


def token_logprobs(
    raw_logits: torch.Tensor, token_ids: list[int], seqs: Seq[Sequence], token_text: TokenText
) -> list[TokenLogprob | None]:
    rows = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
    entries: list[TokenLogprob | None] = [None] * len(seqs)
    if not rows:
        return entries
    log_probs = torch.log_softmax(raw_logits[rows].float(), dim=-1)
    chosen_ids = torch.tensor([token_ids[row] for row in rows], device=log_probs.device)
    chosen = log_probs.gather(1, chosen_ids[:, None])[:, 0].tolist()
    top_k = max(seqs[row].params.logprobs or 0 for row in rows)
    top_values, top_ids = log_probs.topk(top_k, dim=-1) if top_k else (None, None)
    for position, row in enumerate(rows):
        k = seqs[row].params.logprobs or 0
        top = []
        if top_values is not None and top_ids is not None and k:
            pairs = zip(top_ids[position, :k].tolist(), top_values[position, :k].tolist(), strict=True)
            top = [TopLogprob(token=token_text(token_id), logprob=value) for token_id, value in pairs]
        entries[row] = TokenLogprob(token=token_text(token_ids[row]), logprob=chosen[position], top=top)
    return entries
