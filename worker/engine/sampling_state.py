"""What sampling keeps between steps (``sampler.py`` reads it): per slot, every row's settings
and penalty statistics as tensors, so a step samples the whole batch with tensor ops; per
sequence, its seed and the grammar matcher its output must follow.
"""

from __future__ import annotations

import torch

from worker.engine.sampling_params import SamplingParams
from worker.structured import CompiledConstraint


class SequenceSampling:
    """One choice's own draws: the key of its random draws (``sampler.seeded_uniform``), each
    choice of a seeded request its own, and where its grammar stands."""

    __slots__ = ("matcher", "seed")

    def __init__(self, params: SamplingParams, index: int, constraint: CompiledConstraint | None) -> None:
        self.matcher = constraint.new_matcher() if constraint is not None else None
        self.seed: int | None = None if params.seed is None else (params.seed + index) % 2**64


class SlotSamplingState:
    """Per-slot sampling settings and penalty statistics (slot ``i`` = batch row ``i``)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        size = num_slots + 1
        self.temperature = torch.ones(size, device=device)
        self.top_p = torch.ones(size, device=device)
        self.top_k = torch.zeros(size, dtype=torch.long, device=device)
        self.min_p = torch.zeros(size, device=device)
        self.presence_penalty = torch.zeros(size, device=device)
        self.frequency_penalty = torch.zeros(size, device=device)
        self.repetition_penalty = torch.ones(size, device=device)
        # Allocated on first use: [slots, vocab] tensors are large for 150k-token vocabularies.
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self.logit_bias: torch.Tensor | None = None
        self._size = size

    @property
    def num_rows(self) -> int:
        return self._size

    def assign(
        self, slot: int, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int]
    ) -> None:
        self.temperature[slot] = params.temperature
        self.top_p[slot] = params.top_p
        self.top_k[slot] = params.top_k
        self.min_p[slot] = params.min_p
        self.presence_penalty[slot] = params.presence_penalty
        self.frequency_penalty[slot] = params.frequency_penalty
        self.repetition_penalty[slot] = params.repetition_penalty
        if params.uses_penalties:
            counts, prompt_mask = self._penalty_tensors()
            counts[slot].zero_()
            prompt_mask[slot].zero_()
            prompt_ids = torch.tensor(prompt_token_ids, dtype=torch.long, device=self.device)
            prompt_mask[slot, prompt_ids.clamp(max=self.vocab_size - 1)] = True
            for token_id in output_token_ids:  # a resumed sequence's earlier output counts too
                counts[slot, token_id] += 1
        elif self.output_counts is not None:
            self.output_counts[slot].zero_()
        if params.logit_bias or self.logit_bias is not None:
            bias = self._bias_tensor()
            bias[slot].zero_()
            for token_id, value in params.logit_bias:
                if 0 <= token_id < self.vocab_size:
                    bias[slot, token_id] = value

    def move(self, src: int, dst: int) -> None:
        tensors = [self.temperature, self.top_p, self.top_k, self.min_p, self.presence_penalty]
        tensors += [self.frequency_penalty, self.repetition_penalty]
        tensors += [t for t in (self.output_counts, self.prompt_mask, self.logit_bias) if t is not None]
        for tensor in tensors:
            tensor[dst] = tensor[src]

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        if self.output_counts is not None:
            self.output_counts[slots, token_ids] += 1

    def _penalty_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.output_counts is None or self.prompt_mask is None:
            self.output_counts = torch.zeros(self._size, self.vocab_size, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(self._size, self.vocab_size, dtype=torch.bool, device=self.device)
        return self.output_counts, self.prompt_mask

    def _bias_tensor(self) -> torch.Tensor:
        if self.logit_bias is None:
            self.logit_bias = torch.zeros(self._size, self.vocab_size, device=self.device)
        return self.logit_bias
