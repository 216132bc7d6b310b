"""A contract request plus its prompt length → engine sampling parameters, or a 400.

The checks here are the ones the API cannot make: they need the model (its context length and
vocabulary, known with its tokenizer) or this worker's configuration (its batch size). Everything
else was checked when the API built the request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from shared.contract import Sampling
from shared.errors import ErrorKind, RelayError
from worker.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestLimits:
    """What this worker allows a request: choices per request, and what a ``max_tokens`` past the
    context's room means (``clamp``: the room left, so the choice may end with ``length``)."""

    max_choices: int
    max_tokens_over_context: Literal["clamp", "error"] = "clamp"


def build_sampling_params(
    request: Sampling,
    num_prompt_tokens: int,
    max_model_len: int,
    limits: RequestLimits,
    vocab_size: int | None = None,
) -> SamplingParams:
    """``vocab_size``: token ids the request names (logit_bias, stop_token_ids) must be below it."""
    if vocab_size is not None:
        _check_token_ids(request, vocab_size)
    if num_prompt_tokens >= max_model_len:
        raise RelayError(
            ErrorKind.CONTEXT_LENGTH_EXCEEDED,
            f"This model's maximum context length is {max_model_len} tokens, but the messages are "
            f"{num_prompt_tokens} tokens (the prompt, with tools, as the chat template renders it); reduce "
            f"the length of the messages, or use a model with a longer context (GET /v1/models lists each "
            f"model's max_model_len).",
            "messages",
        )
    room = max_model_len - num_prompt_tokens
    requested = request.max_tokens
    if requested is not None and requested > room and limits.max_tokens_over_context == "clamp":
        logger.info("%s=%d clamped to the %d tokens the context has room for", request.max_tokens_param,
                    requested, room)  # fmt: skip
        requested = room
    if requested is not None and requested > room:
        param = request.max_tokens_param
        raise RelayError(
            ErrorKind.CONTEXT_LENGTH_EXCEEDED,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the messages, {requested} "
            f"in the completion). Please reduce the length of the messages or completion.",
            param,
        )
    if request.n > limits.max_choices:
        message = f"n={request.n} exceeds this worker's batch of {limits.max_choices}"
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "n")
    return SamplingParams(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        seed=request.seed,
        max_new_tokens=requested if requested is not None else room,
        min_new_tokens=request.min_tokens,
        stop_strings=tuple(request.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
        stop_token_ids=frozenset(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        logit_bias=tuple(request.logit_bias),
        logprobs=request.logprobs,
    )


def _check_token_ids(request: Sampling, vocab_size: int) -> None:
    """A token id outside the vocabulary is a 400 naming its field: a bias on a token the model
    cannot emit would be silently ignored (or index past the logits)."""
    for field, token_ids in (
        ("logit_bias", [token for token, _ in request.logit_bias]),
        ("stop_token_ids", request.stop_token_ids),
    ):
        outside = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if outside is not None:
            message = f"{field}: token id {outside} is outside this model's vocabulary [0, {vocab_size})."
            raise RelayError(ErrorKind.INVALID_REQUEST, message, field)
