"""End to end with the official ``openai`` client against real API, Redis and worker processes."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import TINY_MODEL, make_stack
from tests.support.stack import Stack

MESSAGES = [{"role": "user", "content": "Say something."}]


def test_non_stream_returns_a_chat_completion(tiny_stack: Stack) -> None:
    client = tiny_stack.client()
    response = client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    assert response.model == TINY_MODEL
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens > 0
    assert 1 <= response.usage.completion_tokens <= 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_stream_matches_non_stream_and_follows_the_chunk_rules(tiny_stack: Stack) -> None:
    client = tiny_stack.client()
    kwargs = {"model": TINY_MODEL, "messages": MESSAGES, "max_tokens": 20, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert len({chunk.id for chunk in chunks}) == 1
    assert len({chunk.created for chunk in chunks}) == 1
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    first, usage_chunk = chunks[0], chunks[-1]
    assert first.choices[0].delta.role == "assistant"
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert all(chunk.usage is None for chunk in chunks[:-1])
    finishing = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0] is chunks[-2]
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == whole.choices[0].message.content
    assert finishing[0].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stream_without_include_usage_sends_no_usage_chunk(tiny_stack: Stack) -> None:
    chunks = list(
        tiny_stack.client().chat.completions.create(
            model=TINY_MODEL, messages=MESSAGES, max_tokens=5, temperature=0, stream=True
        )
    )
    assert all(chunk.choices for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_tokens_gives_length_and_max_completion_tokens_wins(tiny_stack: Stack) -> None:
    client = tiny_stack.client()
    response = client.chat.completions.create(
        model=TINY_MODEL,
        messages=MESSAGES,
        max_tokens=50,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"


def test_same_seed_gives_same_text_and_other_seeds_differ(tiny_stack: Stack) -> None:
    client = tiny_stack.client()

    def sample(seed: int) -> str:
        response = client.chat.completions.create(
            model=TINY_MODEL,
            messages=MESSAGES,
            max_tokens=24,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return response.choices[0].message.content or ""

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) > 1


def test_stop_string_ends_the_choice_without_the_stop_text(tiny_stack: Stack) -> None:
    client = tiny_stack.client()
    # Seeded sampling from the random model gives varied, reproducible text to cut.
    kwargs = {
        "model": TINY_MODEL,
        "messages": MESSAGES,
        "max_tokens": 40,
        "seed": 11,
        "extra_body": {"ignore_eos": True},
    }
    text = client.chat.completions.create(**kwargs).choices[0].message.content or ""
    assert len(text) > 20
    stop = text[12:16]
    expected = text[: text.index(stop)]
    stopped = client.chat.completions.create(**kwargs, stop=[stop, "never-generated-stop"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == expected
    assert stopped.choices[0].model_extra == {"stop_reason": stop}  # vLLM's extension: which stop matched
    chunks = list(client.chat.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra == {"stop_reason": stop}


def test_n_choices_each_arrive_with_their_index(tiny_stack: Stack) -> None:
    client = tiny_stack.client()
    response = client.chat.completions.create(
        model=TINY_MODEL, messages=MESSAGES, max_tokens=6, n=3, temperature=1.0, seed=7, extra_body={"ignore_eos": True}
    )
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert response.usage.completion_tokens == 18
    chunks = list(
        client.chat.completions.create(
            model=TINY_MODEL, messages=MESSAGES, max_tokens=6, n=2, stream=True, extra_body={"ignore_eos": True}
        )
    )
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_content_parts_and_history_roles_are_accepted(tiny_stack: Stack) -> None:
    response = tiny_stack.client().chat.completions.create(
        model=TINY_MODEL,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again"},
        ],
        max_tokens=4,
    )
    assert response.choices[0].finish_reason in ("stop", "length")


def test_models_lists_the_live_model(tiny_stack: Stack) -> None:
    """With whether its text depends on the request alone: the default worker's self-test passed."""
    models = tiny_stack.client().models.list()
    [card] = [model for model in models.data if model.id == TINY_MODEL]
    assert card.model_extra is not None and card.model_extra["deterministic"] is True


@pytest.mark.parametrize(
    ("kwargs", "exception", "param"),
    [
        ({"model": "no-such-model"}, openai.NotFoundError, "model"),
        ({"temperature": 3.0}, openai.BadRequestError, "temperature"),
        ({"messages": []}, openai.BadRequestError, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, openai.BadRequestError, "messages.0"),
        ({"stop": ["a", "b", "c", "d", "e"]}, openai.BadRequestError, "stop"),
    ],
)
def test_bad_requests_map_to_the_sdk_exceptions(
    tiny_stack: Stack, kwargs: dict[str, object], exception: type[openai.APIStatusError], param: str
) -> None:
    request = {"model": TINY_MODEL, "messages": MESSAGES, **kwargs}
    with pytest.raises(exception) as raised:
        tiny_stack.client().chat.completions.create(**request)  # type: ignore[call-overload]
    error = raised.value.body
    assert isinstance(error, dict)
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["param"] is not None and error["param"].startswith(param)


def test_max_tokens_past_the_context_is_clamped_to_the_room_left(tiny_stack: Stack) -> None:
    # Agent CLIs send a fixed max_tokens (qwen-code 32768, Claude Code 32000) whatever the model.
    messages: Any = [{"role": "user", "content": "word " * 900}]
    client = tiny_stack.client()
    reply = client.chat.completions.create(
        model=TINY_MODEL, messages=messages, max_tokens=32_768, extra_body={"ignore_eos": True}
    )  # fmt: skip
    assert reply.usage is not None and reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 1024  # the stack's max_model_len


def test_context_length_exceeded_has_its_code(tiny_stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        tiny_stack.client().chat.completions.create(
            model=TINY_MODEL, messages=[{"role": "user", "content": "word " * 1200}], stream=True
        )
    assert raised.value.code == "context_length_exceeded"


class _OnKeepAlive(httpx.BaseTransport):
    """Passes responses on as they are; calls ``on_ping`` (when set) as a keep-alive comment goes by."""

    def __init__(self) -> None:
        self._inner = httpx.HTTPTransport()
        self.on_ping: Callable[[], None] | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        stream = _Watched(response.stream, self)  # type: ignore[arg-type]
        return httpx.Response(
            response.status_code, headers=response.headers, stream=stream, extensions=response.extensions
        )


class _Watched(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, transport: _OnKeepAlive) -> None:
        self._inner = inner
        self._transport = transport

    def __iter__(self) -> Iterator[bytes]:
        tail = b""
        for chunk in self._inner:
            if b": keep-alive" in tail + chunk and self._transport.on_ping is not None:
                self._transport.on_ping()
            tail = chunk[-16:]
            yield chunk

    def close(self) -> None:
        self._inner.close()


def test_keep_alive_pings_do_not_break_the_openai_client(redis_url: str, log_dir: Path, tiny_model_path: Path) -> None:
    # The SDK keeps the last SSE id; a standalone ping event after ids would reach it as empty JSON.
    # So pings must come between a stream's events: its worker is held after the first token
    # until one has, however fast the engine.
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(sse_ping_interval_s=0.01)
        worker = stack.start_worker(tiny_model_path, TINY_MODEL, dtype="float32", max_model_len=1024)
        body = {"model": TINY_MODEL, "messages": MESSAGES, "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert any(line == "id: 1" for line in lines)  # read up to the first token
            with worker.paused():
                held = next(line for line in lines if line in (": keep-alive", "data: [DONE]"))
            rest = list(lines)
        assert held == ": keep-alive" and "data: [DONE]" in rest
        watch = _OnKeepAlive()
        client = stack.client(http_client=httpx.Client(transport=watch, timeout=60))
        sdk_body = {k: v for k, v in body.items() if k != "ignore_eos"}
        chunks = client.chat.completions.create(**sdk_body, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
        received = [next(chunks), next(chunks)]  # the role chunk, then the first token
        resumed: list[bool] = []

        def resume() -> None:
            if not resumed:
                worker.popen.send_signal(signal.SIGCONT)
                resumed.append(True)

        with worker.paused():
            watch.on_ping = resume
            received += list(chunks)
        assert resumed, "no keep-alive came between the events"
        assert received[-1].choices[0].finish_reason == "length"
    finally:
        stack.stop()


def test_logprobs_cover_every_token_with_the_requested_alternatives(tiny_stack: Stack) -> None:
    client = tiny_stack.client()
    kwargs = {
        "model": TINY_MODEL,
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    whole = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens == 6
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy takes the top token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    streamed = [
        entry
        for chunk in client.chat.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]
    plain = client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, max_tokens=3)
    assert plain.choices[0].logprobs is None
