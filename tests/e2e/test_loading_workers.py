"""Requests for a model whose only worker is still loading, on real processes: a loading worker is
listed as loading, not live; every kind of request (text, stream, json_schema, image, embedding,
audio) waits queued for it and is then answered as a ready worker answers it, or gets 503 +
Retry-After once the no-worker grace passes. Workers are held in loading by
``tests/support/loading_hold.py``, whatever the CPU. And a schema that is not a schema is a 400 at
once, from the API alone."""

from __future__ import annotations

import base64
import io
import json
import math
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.conftest import make_stack
from tests.support.audio import espeak, missing_test_data
from tests.support.loading_hold import held_in_loading
from tests.support.stack import Process, Stack
from tests.support.vision import sample_image, tiny_random_idefics3_dir
from worker.embedding.loader import DEFAULT_EMBEDDING_MODEL

pytestmark = pytest.mark.slow

TEXT, VISION, EMBED, WHISPER = "loading-text", "loading-vision", "loading-embed", "whisper-tiny.en"
PING_S = 0.5
TIMEOUT_S = 300.0  # a request waits while four workers load on a loaded host

COLOUR = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}},
    "required": ["colour"],
    "additionalProperties": False,
}


def _data_url() -> str:
    buffer = io.BytesIO()
    sample_image(48, 40, seed=3).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat(model: str, content: str | list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {
        "model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 8,
        **fields,
    }  # fmt: skip


IMAGE_CONTENT = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": _data_url()}}]
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "pick", "schema": COLOUR, "strict": True}}


def _post_json(base_url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = httpx.post(f"{base_url}{path}", json=body, timeout=TIMEOUT_S)
    return response.status_code, response.json()


def _stream(base_url: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    """The status and every line of a streamed chat request."""
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=TIMEOUT_S) as response:
        return response.status_code, [line for line in response.iter_lines() if line]


def _transcribe(base_url: str, audio: Path) -> tuple[int, dict[str, Any]]:
    files = {"file": (audio.name, audio.read_bytes(), "audio/wav")}
    response = httpx.post(
        f"{base_url}/v1/audio/transcriptions", files=files, data={"model": WHISPER}, timeout=TIMEOUT_S
    )
    return response.status_code, response.json()


def _requests(base_url: str, speech: Path) -> dict[str, Callable[[], Any]]:
    """One request of each kind, by name; each call sends it and returns what came back."""
    chat = "/v1/chat/completions"
    return {
        "text": lambda: _post_json(base_url, chat, _chat(TEXT, "Tell me about the sea.")),
        "stream": lambda: _stream(base_url, _chat(TEXT, "Tell me about the sea.", stream=True)),
        "json_schema": lambda: _post_json(
            base_url, chat, _chat(TEXT, "Pick.", max_tokens=20, response_format=JSON_SCHEMA)
        ),
        "image": lambda: _post_json(base_url, chat, _chat(VISION, IMAGE_CONTENT)),
        "image_to_text_model": lambda: _post_json(base_url, chat, _chat(TEXT, IMAGE_CONTENT)),
        "embedding": lambda: _post_json(base_url, "/v1/embeddings", {"model": EMBED, "input": "the open sea"}),
        "audio": lambda: _transcribe(base_url, speech),
    }


def _queued(stack: Stack, model: str) -> int:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        return int(client.zcard(stack.keys.queue(model)))
    finally:
        client.close()


def _cards(stack: Stack) -> dict[str, dict[str, Any]]:
    response = httpx.get(f"{stack.base_url}/v1/models", timeout=30)
    assert response.status_code == 200
    return {card["id"]: card for card in response.json()["data"]}


def _stream_text(lines: list[str]) -> str:
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def _answers(waiting: dict[str, Future[Any]], workers: list[Process]) -> dict[str, Any]:
    """What each request got, once all are answered; a worker that exits meanwhile fails the test
    with its log (its requests would otherwise wait out the grace)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not all(future.done() for future in waiting.values()):
        for worker in workers:
            assert worker.is_running(), f"a worker exited while loading:\n{worker.log()}"
        assert time.monotonic() < deadline, [name for name, future in waiting.items() if not future.done()]
        time.sleep(0.1)
    return {name: future.result() for name, future in waiting.items()}


@pytest.fixture
def stack(redis_url: str, log_dir: Path) -> Iterator[Stack]:
    running = make_stack(redis_url, log_dir)
    try:
        yield running
    finally:
        running.stop()


@pytest.mark.timeout(1200)
@pytest.mark.skipif(missing_test_data() is not None, reason=str(missing_test_data()))
def test_every_kind_of_request_waits_for_a_loading_worker_and_gets_a_ready_workers_answer(
    stack: Stack, tiny_model_path: Path, tmp_path: Path
) -> None:
    stack.start_api(no_worker_grace_s=TIMEOUT_S, sse_ping_interval_s=PING_S)
    workers = [
        stack.start_worker(tiny_model_path, TEXT, wait=False, dtype="float32", max_model_len=512),
        stack.start_worker(tiny_random_idefics3_dir(), VISION, wait=False, max_model_len=1024),
        stack.start_worker(DEFAULT_EMBEDDING_MODEL, EMBED, wait=False),
        stack.start_worker(WHISPER, WHISPER, wait=False, num_threads=1),
    ]
    requests = _requests(stack.base_url, espeak(tmp_path / "speech.wav", "The sea is calm today.", "en"))
    models = (TEXT, VISION, EMBED, WHISPER)
    with ThreadPoolExecutor(len(requests)) as pool:
        with held_in_loading(stack, workers):
            cards = _cards(stack)
            for model in models:
                assert (cards[model]["num_live_workers"], cards[model]["num_loading_workers"]) == (0, 1), model
            waiting: dict[str, Future[Any]] = {name: pool.submit(send) for name, send in requests.items()}
            expected_queued = {TEXT: 4, VISION: 1, EMBED: 1, WHISPER: 1}
            deadline = time.monotonic() + 120
            while any(_queued(stack, model) < count for model, count in expected_queued.items()):
                assert time.monotonic() < deadline, {model: _queued(stack, model) for model in models}
                assert not any(future.done() for future in waiting.values()), {
                    name: future.result() for name, future in waiting.items() if future.done()
                }
                time.sleep(0.05)
            time.sleep(2 * PING_S)  # the stream hears keep-alives while it waits
            assert not any(future.done() for future in waiting.values())
        while_loading = _answers(waiting, workers)
    for process, model in zip(workers, models, strict=True):
        stack.wait_ready(process, model)
    cards = _cards(stack)
    for model in models:
        assert (cards[model]["num_live_workers"], cards[model]["num_loading_workers"]) == (1, 0), model
    when_ready = {name: send() for name, send in requests.items()}

    for name in ("text", "json_schema", "image", "audio"):
        assert while_loading[name][0] == when_ready[name][0] == 200, (name, while_loading[name], when_ready[name])
    for name in ("text", "json_schema", "image"):
        loading_reply, ready_reply = while_loading[name][1], when_ready[name][1]
        assert loading_reply["choices"][0]["message"] == ready_reply["choices"][0]["message"], name
    assert while_loading["audio"][1]["text"] == when_ready["audio"][1]["text"]
    assert json.loads(while_loading["json_schema"][1]["choices"][0]["message"]["content"])["colour"] in (
        "red",
        "green",
        "blue",
    )

    status, lines = while_loading["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    first_delta = lines.index("id: 1")  # id 0 is the role chunk, sent when the stream starts
    assert any(line.startswith(": keep-alive") for line in lines[:first_delta])
    assert _stream_text(lines) == when_ready["text"][1]["choices"][0]["message"]["content"]

    (loading_vector,), (ready_vector,) = (
        [item["embedding"] for item in reply[1]["data"]]
        for reply in (while_loading["embedding"], when_ready["embedding"])
    )
    assert math.dist(loading_vector, ready_vector) < 1e-4

    # A text-only model refuses images once a worker can say so: the loading one said nothing.
    for status, body in (while_loading["image_to_text_model"], when_ready["image_to_text_model"]):
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
        assert "does not take image input" in body["error"]["message"]


@pytest.mark.timeout(600)
def test_past_the_grace_a_request_for_a_model_still_loading_gets_503_with_retry_after(
    stack: Stack, tiny_model_path: Path
) -> None:
    grace_s = 1.0
    stack.start_api(no_worker_grace_s=grace_s, liveness_check_interval_s=0.2)
    worker = stack.start_worker(tiny_model_path, TEXT, wait=False, dtype="float32", max_model_len=512)
    chat = f"{stack.base_url}/v1/chat/completions"
    bodies = {
        "text": _chat(TEXT, "Tell me about the sea."),
        "stream": _chat(TEXT, "Tell me about the sea.", stream=True),
        "json_schema": _chat(TEXT, "Pick.", response_format=JSON_SCHEMA),
        "image": _chat(TEXT, IMAGE_CONTENT),
    }
    with held_in_loading(stack, [worker]):
        for name, body in bodies.items():
            started = time.monotonic()
            response = httpx.post(chat, json=body, timeout=60)
            waited_s = time.monotonic() - started
            assert response.status_code == 503, (name, response.text)
            assert response.json()["error"]["code"] == "no_live_worker", name
            assert int(response.headers["retry-after"]) >= 1, name
            assert grace_s <= waited_s < grace_s + 10, (name, waited_s)
        worker.stop(signal.SIGKILL)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            _chat(
                "never-served",
                "x",
                response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nonsense"}}},
            ),
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            _chat(
                "never-served",
                "x",
                tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}
                ],
                tool_choice="required",
            ),
            "tools.0.function.parameters",
        ),
        (
            "/v1/responses",
            {
                "model": "never-served",
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "n", "schema": {"properties": []}}},
            },
            "text.format.schema",
        ),
        (
            "/v1/messages",
            {
                "model": "never-served",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"name": "f", "input_schema": {"type": 5}}],
            },
            "tools.0.input_schema",
        ),
    ],
)
def test_a_schema_that_is_not_a_schema_is_a_400_at_once_with_no_worker_at_all(
    fresh_stack: Stack, path: str, body: dict[str, Any], param: str
) -> None:
    with httpx.Client(base_url=fresh_stack.base_url, timeout=30) as client:
        assert client.get("/health").status_code == 200  # the connection is open
        started = time.monotonic()
        response = client.post(path, json=body)
        elapsed_s = time.monotonic() - started
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if path == "/v1/messages":
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith(f"{param}: not a valid JSON Schema")
    else:
        assert error["param"] == param
        assert "not a valid JSON Schema" in error["message"]
    assert elapsed_s < 0.1
