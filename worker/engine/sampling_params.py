"""Per-choice generation settings, resolved from an OpenAI request once the prompt is known."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    stop_strings: tuple[str, ...] = ()  # the request's own: a match is reported as the stop reason
    include_stop_str_in_output: bool = False  # a matched request stop string stays in the text
    markup_stop_strings: tuple[str, ...] = ()  # added by the tool-call plan; end the text, never reported
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and the k most likely

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def uses_truncation(self) -> bool:
        """Whether top-k, top-p or min-p cut the distribution (needs a sort)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
