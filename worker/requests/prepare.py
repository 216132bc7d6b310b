"""A contract request → the engine's request: prompt tokens, constraint, parameters, parsers.

Only what needs the model is decided here (the chat template, token ids, the grammar, context
room); the API checked everything else when it built the request.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from shared.contract import Generate
from shared.errors import ErrorKind, RelayError
from worker.engine.prompt_images import PromptImages
from worker.engine.sequence import EngineRequest
from worker.models.loader import LoadedModel
from worker.requests.params import RequestLimits, build_sampling_params
from worker.requests.prompt import render_prompt, render_prompt_text
from worker.requests.tooling import ToolingConfig, plan_tooling
from worker.structured import TOOL_CALL_FORMATS, ConstraintCompiler, ToolCallFormat, constraint_from_request


def chat_prompt_ids(
    request: Generate, loaded: LoadedModel, tooling: ToolingConfig, image_bytes: dict[str, bytes] | None = None
) -> list[int]:
    """The prompt tokens ``prepare_chat`` would give the same request, without checking that it
    fits the context (a client counts tokens to learn whether it does)."""
    if request.is_constrained and tooling.reasoning_parser is not None:
        request = _without_thinking(request)
    plan = plan_tooling(tooling, request)
    prompt_token_ids, _, _ = _render(request, loaded, plan.template_tools, plan.system_prompt, image_bytes or {})
    return prompt_token_ids


def _render(
    request: Generate,
    loaded: LoadedModel,
    tools: list[dict[str, Any]] | None,
    system_prompt: str | None,
    image_bytes: dict[str, bytes],
) -> tuple[list[int], str, PromptImages | None]:
    """Token ids and text of the chat prompt, and its images: a vision model's processor expands
    each image into its placeholder tokens."""
    vision = loaded.vision
    if vision is None:
        ids, text = render_prompt(loaded.tokenizer, request, tools, system_prompt)
        return ids, text, None
    text = render_prompt_text(loaded.tokenizer, request, tools, system_prompt, as_parts=True)
    ids, images = vision.prompt(text, request.images, image_bytes)
    return ids, text, images if images.positions else None


def _without_thinking(request: Generate) -> Generate:
    """A constrained answer skips the thinking block: the grammar applies from the first token."""
    kwargs = {**request.chat_template_kwargs, "enable_thinking": False}
    return request.model_copy(update={"chat_template_kwargs": kwargs})


def prepare_chat(
    job_id: str,
    request: Generate,
    loaded: LoadedModel,
    tooling: ToolingConfig,
    limits: RequestLimits,
    compiler: Callable[[], ConstraintCompiler] | None = None,
    image_bytes: dict[str, bytes] | None = None,
) -> EngineRequest:
    """Constraint, chat template, parameters, parsers: a chat request ready for the engine."""
    constraint = constraint_from_request(request, _tool_call_format(tooling))
    compiled = None
    if constraint is not None:
        if compiler is None:
            raise RelayError(ErrorKind.INVALID_REQUEST, "constrained decoding is not available", "response_format")
        compiled = compiler().compile_constraint(constraint)
        if tooling.reasoning_parser is not None:
            request = _without_thinking(request)
    plan = plan_tooling(tooling, request)
    prompt_token_ids, prompt_text, images = _render(
        request, loaded, plan.template_tools, plan.system_prompt, image_bytes or {}
    )
    params = build_sampling_params(
        request.sampling, len(prompt_token_ids), loaded.max_model_len, limits, vocab_size=loaded.vocab_size
    )
    make_pipeline = None
    if plan.make_pipeline is not None:
        # Parsers need the markup the tokenizer may call special (e.g. <tool_call> in some vocabularies).
        params = replace(params, skip_special_tokens=False, markup_stop_strings=plan.stop_strings)
        make_pipeline = functools.partial(plan.make_pipeline, prompt_text)
    return EngineRequest(
        job_id, [prompt_token_ids], params, num_choices=request.n, make_pipeline=make_pipeline, constraint=compiled,
        images=images,
    )  # fmt: skip


def _tool_call_format(tooling: ToolingConfig) -> ToolCallFormat | None:
    return tooling.tool_parser if tooling.tool_parser in TOOL_CALL_FORMATS else None


def prepare_completion(job_id: str, request: Generate, loaded: LoadedModel, limits: RequestLimits) -> EngineRequest:
    """Text prompts are tokenized as they are (with the tokenizer's special tokens, as vLLM does)."""
    prompts = [loaded.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in request.prompts or []]
    if not prompts or any(not prompt for prompt in prompts):
        raise RelayError(ErrorKind.INVALID_REQUEST, "The prompt is empty once tokenized.", "prompt")
    vocab_size = loaded.vocab_size
    out_of_range = next((t for prompt in prompts for t in prompt if not 0 <= t < vocab_size), None)
    if out_of_range is not None:
        message = f"Token id {out_of_range} is outside this model's vocabulary [0, {vocab_size})."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "prompt")
    longest = max(len(prompt) for prompt in prompts)
    params = build_sampling_params(request.sampling, longest, loaded.max_model_len, limits, vocab_size=vocab_size)
    return EngineRequest(job_id, prompts, params, num_choices=request.n)
