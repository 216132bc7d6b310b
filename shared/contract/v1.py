"""Version 1 of the job contract, both ways: read (upgraded) and written (downgraded).

Version 1 jobs carried the client's OpenAI request as it was validated by the API (chat,
completion or embedding request, or a tokenize request wrapping a chat request), without a
version. During a rolling upgrade both directions are needed: a job queued by an API process of
that release is read by this one (:func:`upgrade_v1`), and while a worker of that release is
still live for a model, API processes write that model's jobs in version 1 (:func:`downgrade_to_v1`)
so that every live worker reads them. Both are frozen: they change only if version 1 was read
or written wrongly.
"""

from __future__ import annotations

from typing import Any

from shared.contract.v2 import AnyJob, Generate, Sampling

_COMMON = ("job_id", "request_id", "created", "tenant")
# OpenAI's text-completions default for max_tokens; chat's is "the rest of the context".
_COMPLETION_MAX_TOKENS = 16


def upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A version-1 job payload as the current version's fields (validated by the caller)."""
    kind = data["kind"]
    request = data["request"]
    job: dict[str, Any] = {key: data[key] for key in _COMMON if key in data}
    job["kind"] = kind
    if kind == "chat":
        job["request"] = _chat(request)
        job["delivery"] = _delivery(request)
    elif kind == "completion":
        job["request"] = _completion(request)
        job["delivery"] = {**_delivery(request), "echo": bool(request.get("echo", False))}
    elif kind == "embedding":
        job["request"] = {"model": request["model"], "inputs": _as_list(request["input"])}
        if request.get("dimensions") is not None:
            job["request"]["dimensions"] = request["dimensions"]
        job["delivery"] = {"encoding_format": request.get("encoding_format", "float")}
    elif kind == "tokenize":
        tokenize = {key: request[key] for key in ("model", "prompt", "add_special_tokens", "tokens") if key in request}
        if request.get("chat") is not None:
            tokenize["chat"] = _chat(request["chat"])
        job["request"] = tokenize
    else:
        raise ValueError(f"unknown job kind {kind!r}")
    return job


def _delivery(request: dict[str, Any]) -> dict[str, Any]:
    options = request.get("stream_options") or {}
    return {
        "stream": bool(request.get("stream", False)),
        "include_usage": bool(options.get("include_usage")),
        "resumable": bool(request.get("resumable", False)),
        "background": bool(request.get("background", False)),
    }


def _as_list(value: Any) -> list[Any]:
    """A prompt or input (text, texts, token ids or lists of them) as a list of prompts."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return list(value)


def _text(content: Any) -> str:
    """Text parts joined with newlines, as the chat template path always did."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


def _message(message: dict[str, Any]) -> dict[str, Any]:
    role = message["role"]
    upgraded: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _text(message.get("content")),
    }
    if message.get("tool_calls"):
        upgraded["tool_calls"] = [
            {"id": call["id"], "name": call["function"]["name"], "arguments": call["function"]["arguments"]}
            for call in message["tool_calls"]
        ]
    if role == "tool":
        upgraded["tool_call_id"] = message["tool_call_id"]
    if role == "assistant" and message.get("reasoning_content") is not None:
        upgraded["reasoning_content"] = message["reasoning_content"]
    return upgraded


def _sampling(
    request: dict[str, Any], max_tokens: int | None, max_tokens_param: str, logprobs: int | None
) -> dict[str, Any]:
    stop = request.get("stop")
    return {
        "n": request.get("n", 1),
        "temperature": request.get("temperature", 1.0),
        "top_p": request.get("top_p", 1.0),
        "top_k": max(request.get("top_k", -1), 0),
        "min_p": request.get("min_p", 0.0),
        "presence_penalty": request.get("presence_penalty", 0.0),
        "frequency_penalty": request.get("frequency_penalty", 0.0),
        "repetition_penalty": request.get("repetition_penalty", 1.0),
        "seed": request.get("seed"),
        "logit_bias": [[int(token), bias] for token, bias in (request.get("logit_bias") or {}).items()],
        "logprobs": logprobs,
        "max_tokens": max_tokens,
        "max_tokens_param": max_tokens_param,
        "min_tokens": request.get("min_tokens", 0),
        "ignore_eos": request.get("ignore_eos", False),
        "stop": [] if stop is None else [stop] if isinstance(stop, str) else list(stop),
        "stop_token_ids": list(request.get("stop_token_ids") or []),
        "skip_special_tokens": request.get("skip_special_tokens", True),
    }


def _chat(request: dict[str, Any]) -> dict[str, Any]:
    if request.get("max_completion_tokens") is not None:
        max_tokens, param = request["max_completion_tokens"], "max_completion_tokens"
    else:
        max_tokens, param = request.get("max_tokens"), "max_tokens"
    logprobs = (request.get("top_logprobs") or 0) if request.get("logprobs") else None
    chat: dict[str, Any] = {
        "model": request["model"],
        "messages": [_message(message) for message in request["messages"]],
        "tools": [_tool(tool["function"]) for tool in request.get("tools") or []],
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "chat_template_kwargs": request.get("chat_template_kwargs") or {},
        "sampling": _sampling(request, max_tokens, param, logprobs),
    }
    choice = request.get("tool_choice")
    if isinstance(choice, dict):
        chat["tool_choice"], chat["tool_name"] = "function", choice["function"]["name"]
    elif choice is not None:
        chat["tool_choice"] = choice
    response_format = request.get("response_format") or {}
    if response_format.get("type") == "json_object":
        chat["output"] = {"type": "json_object"}
    elif response_format.get("type") == "json_schema":
        # Version-1 APIs queued a json_schema format without its block; the worker refused it.
        block = response_format["json_schema"]
        chat["output"] = {
            "type": "json_schema",
            "json_schema": block.get("schema"),
            "strict": bool(block.get("strict")),
        }
    return chat


def _tool(function: dict[str, Any]) -> dict[str, Any]:
    return {key: function[key] for key in ("name", "description", "parameters", "strict") if key in function}


def _completion(request: dict[str, Any]) -> dict[str, Any]:
    max_tokens = request.get("max_tokens", _COMPLETION_MAX_TOKENS)
    return {
        "model": request["model"],
        "prompts": _as_list(request["prompt"]),
        "sampling": _sampling(request, max_tokens, "max_tokens", request.get("logprobs")),
    }


# -- writing version 1 ----------------------------------------------------------------------------


def downgrade_to_v1(job: AnyJob) -> dict[str, Any]:
    """The version-1 payload of ``job``: what an API process of that release would have queued
    for the same request. Only what version 1 cannot say is lost, and nothing a worker of that
    release reads: the job's priority (its queue says it) and a JSON schema's name."""
    data = job.model_dump(mode="json", include={"job_id", "request_id", "created", "tenant", "kind"})
    request = job.request
    delivery = job.delivery
    stream: dict[str, Any] = {"stream": delivery.stream, "resumable": delivery.resumable}
    if delivery.stream and delivery.include_usage:
        stream["stream_options"] = {"include_usage": True}
    if job.kind == "chat":
        data["request"] = {**_chat_v1(request), **stream, "background": delivery.background}  # type: ignore[arg-type]
    elif job.kind == "completion":
        data["request"] = {**_completion_v1(request), **stream, "echo": delivery.echo}  # type: ignore[arg-type]
    elif job.kind == "embedding":
        embed = job.request
        data["request"] = {
            "model": embed.model, "input": _one_or_all(embed.inputs),
            "dimensions": embed.dimensions, "encoding_format": delivery.encoding_format,
        }  # fmt: skip
    elif job.kind == "tokenize":
        tokenize = job.request.model_dump(mode="json", exclude={"task", "chat"})
        chat = job.request.chat
        data["request"] = {**tokenize, "chat": _chat_v1(chat) if chat is not None else None}
    else:
        raise ValueError(f"version 1 has no {job.kind} jobs")
    return data


def _one_or_all(items: list[Any]) -> Any:
    return items[0] if len(items) == 1 else items


def _sampling_v1(sampling: Sampling) -> dict[str, Any]:
    return {
        "n": sampling.n, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "min_p": sampling.min_p, "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty, "repetition_penalty": sampling.repetition_penalty,
        "seed": sampling.seed, "logit_bias": {str(token): bias for token, bias in sampling.logit_bias} or None,
        "min_tokens": sampling.min_tokens, "ignore_eos": sampling.ignore_eos, "stop": sampling.stop or None,
        "stop_token_ids": sampling.stop_token_ids or None, "skip_special_tokens": sampling.skip_special_tokens,
    }  # fmt: skip


def _message_v1(message: Any) -> dict[str, Any]:
    written: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        written["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        written["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        written["reasoning_content"] = message.reasoning_content
    return written


def _chat_v1(chat: Generate) -> dict[str, Any]:
    sampling = chat.sampling
    written: dict[str, Any] = {
        "model": chat.model,
        "messages": [_message_v1(message) for message in chat.messages or []],
        **_sampling_v1(sampling),
        sampling.max_tokens_param: sampling.max_tokens,
        "logprobs": sampling.logprobs is not None,
        "top_logprobs": sampling.logprobs or None,
        "parallel_tool_calls": chat.parallel_tool_calls,
        "chat_template_kwargs": chat.chat_template_kwargs or None,
    }
    if chat.tools:
        written["tools"] = [
            {"type": "function", "function": tool.model_dump(mode="json", exclude_none=True)} for tool in chat.tools
        ]
    if chat.tool_choice == "function":
        written["tool_choice"] = {"type": "function", "function": {"name": chat.tool_name}}
    elif chat.tool_choice != "auto":
        written["tool_choice"] = chat.tool_choice
    if chat.output is not None and chat.output.type == "json_object":
        written["response_format"] = {"type": "json_object"}
    elif chat.output is not None:
        block = {"name": "output", "schema": chat.output.json_schema, "strict": chat.output.strict}
        written["response_format"] = {"type": "json_schema", "json_schema": block}
    return written


def _completion_v1(completion: Generate) -> dict[str, Any]:
    sampling = completion.sampling
    return {
        "model": completion.model,
        "prompt": _one_or_all(completion.prompts or []),
        **_sampling_v1(sampling),
        "max_tokens": sampling.max_tokens,
        "logprobs": sampling.logprobs,
    }
