"""Log-probabilities of sampled tokens, for the rows that asked: one batched log-softmax over the
model's raw logits (before penalties, temperature and truncation, as vLLM reports by default).

With the exact numerics a row's log-probabilities depend on the row alone
(``exact_log_softmax``): torch's log-softmax splits a lone row's sum across threads but not a
batch's rows, so the same logits could report other last bits alone than batched."""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from shared.events import TokenLogprob, TopLogprob
from worker.engine.sequence import Sequence
from worker.native import exact

TokenText = Callable[[int], str]
LogSoftmax = Callable[[torch.Tensor], torch.Tensor]


def torch_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1)


def exact_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax of fp32 ``[rows, vocab]`` in float64: the sum of each row in the exact kernels'
    fixed order, the rest elementwise (IEEE-rounded, the same bits however the rows are batched)."""
    logits = logits.contiguous()
    totals = exact.block_sums(exact.exp_shifted(logits), logits.shape[1])[:, 0].tolist()
    log_totals = torch.tensor([math.log(total) for total in totals], dtype=torch.float64, device=logits.device)
    return (logits - logits.amax(dim=-1, keepdim=True)).double() - log_totals[:, None]


def token_logprobs(
    raw_logits: torch.Tensor,
    token_ids: list[int],
    seqs: Seq[Sequence],
    token_text: TokenText,
    log_softmax: LogSoftmax = torch_log_softmax,
) -> list[TokenLogprob | None]:
    rows = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
    entries: list[TokenLogprob | None] = [None] * len(seqs)
    if not rows:
        return entries
    log_probs = log_softmax(raw_logits[rows].float())
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
