"""Image input through a real API process and Redis, for chat, Responses and Messages: a vision
model's job names each image by reference and finds its bytes stored; a text-only model is a
400 naming the model; a refused image is a 400 naming its part, in each API's error shape."""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.contract import AnyJob, ChatJob, Generate, ImagePart, ImageRef, Message, TextPart, TokenizeJob
from tests.support.fake_chat_worker import ANSWER, PROMPT_TOKENS, FakeChatWorker
from tests.support.image_server import ImageServer, Reply, image_server, png_bytes
from tests.support.stack import Stack

VLM, TEXT_ONLY = "fake-vlm", "fake-text"
KEY_A, KEY_B = "sk-images-a", "sk-images-b"
PNG = png_bytes(24, 16)
PNG_SHA256 = hashlib.sha256(PNG).hexdigest()
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


@pytest.fixture(scope="module")
def server() -> Iterator[ImageServer]:
    with image_server() as running:
        running.replies["/cat.png"] = Reply(body=PNG, headers={"Content-Type": "application/octet-stream"})
        running.replies["/to-loopback"] = Reply(status=302, headers={"Location": "http://127.0.0.2/cat.png"})
        yield running


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(redis_url=redis_url, log_dir=Path(tmp_path_factory.mktemp("image-logs")))
    try:
        running.start_api(
            api_keys=f"{KEY_A},{KEY_B}", allow_remote_images=True, allowed_image_networks="127.0.0.1/32",
            max_images_per_request=3,
        )  # fmt: skip
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def vlm(stack: Stack) -> Iterator[FakeChatWorker]:
    worker = FakeChatWorker(stack, VLM, vision=True)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def text_only(stack: Stack) -> Iterator[FakeChatWorker]:
    worker = FakeChatWorker(stack, TEXT_ONLY, vision=False)
    yield worker
    worker.stop()


def _post(stack: Stack, path: str, body: dict[str, Any], key: str = KEY_A) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", "x-request-id": f"img{len(body)}{id(body)}"}
    return httpx.post(f"{stack.base_url}{path}", json=body, headers=headers, timeout=30)


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def _image_url(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _base64_block(data: bytes) -> dict[str, Any]:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()},
    }


def _chat(model: str, content: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}


def _openai_error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def _anthropic_error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return str(body["error"]["message"])


def _messages(job: AnyJob) -> list[Message]:
    generate = job.request.chat if isinstance(job, TokenizeJob) else job.request
    assert isinstance(generate, Generate) and generate.messages is not None
    return generate.messages


def _images(message: Message) -> list[ImageRef]:
    """The message's parts, each image's reference (a text part: none)."""
    assert isinstance(message.content, list)
    return [part.image for part in message.content if isinstance(part, ImagePart)]


def test_a_chat_image_reaches_the_job_by_reference_with_its_bytes_stored(
    stack: Stack, vlm: FakeChatWorker, server: ImageServer
) -> None:
    content = [_text("What is"), _image_url(DATA_URL), _text("and"), _image_url(server.url("/cat.png"))]
    response = _post(stack, "/v1/chat/completions", _chat(VLM, content))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == ANSWER
    message = _messages(vlm.jobs[-1])[0]
    assert isinstance(message.content, list)
    assert [type(p) for p in message.content] == [TextPart, ImagePart, TextPart, ImagePart]
    image, again = _images(message)
    assert (image.sha256, image.media_type, image.width, image.height) == (PNG_SHA256, "image/png", 24, 16)
    assert again == image  # the same bytes, by URL or inline, are the same image
    assert vlm.images[PNG_SHA256] == PNG


def test_a_text_only_request_is_unchanged(stack: Stack, text_only: FakeChatWorker) -> None:
    response = _post(stack, "/v1/chat/completions", _chat(TEXT_ONLY, [_text("hi")]))
    assert response.status_code == 200, response.text
    assert _messages(text_only.jobs[-1])[0].content == "hi"


def test_a_text_only_model_refuses_images_in_each_api(stack: Stack, text_only: FakeChatWorker) -> None:
    refusal = f"The model `{TEXT_ONLY}` does not take image input."
    error = _openai_error(_post(stack, "/v1/chat/completions", _chat(TEXT_ONLY, [_image_url(DATA_URL)])))
    assert error["param"] == "model" and error["message"] == refusal
    responses = {"model": TEXT_ONLY, "input": [{"role": "user", "content": [{"type": "input_image",
                                                                              "image_url": DATA_URL}]}]}  # fmt: skip
    assert "does not take image input" in _openai_error(_post(stack, "/v1/responses", responses))["message"]
    messages = {"model": TEXT_ONLY, "max_tokens": 4, "messages": [{"role": "user", "content": [_base64_block(PNG)]}]}
    assert _anthropic_error(_post(stack, "/v1/messages", messages)) == refusal


def test_a_refused_image_names_its_part_in_each_api(stack: Stack, vlm: FakeChatWorker, server: ImageServer) -> None:
    chat = _chat(VLM, [_text("x"), _image_url("data:image/png;base64,%%")])
    error = _openai_error(_post(stack, "/v1/chat/completions", chat))
    assert error["param"] == "messages[0].content[1].image_url" and "malformed" in error["message"]

    image = {"type": "input_image", "image_url": server.url("/to-loopback")}
    responses = {"model": VLM, "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}, image]}]}
    error = _openai_error(_post(stack, "/v1/responses", responses))
    assert error["param"] == "input[0].content[1]" and "not public" in error["message"]

    content = [_text("x"), _base64_block(b"just words")]
    messages = {"model": VLM, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    assert _anthropic_error(_post(stack, "/v1/messages", messages)).startswith("messages[0].content[1].source: ")


def test_more_images_than_the_limit_are_refused(stack: Stack, vlm: FakeChatWorker) -> None:
    chat = _chat(VLM, [_image_url(DATA_URL)] * 4)
    assert _openai_error(_post(stack, "/v1/chat/completions", chat))["param"] == "messages[0].content[3].image_url"


def test_messages_and_count_tokens_take_images(stack: Stack, vlm: FakeChatWorker, server: ImageServer) -> None:
    content = [{"type": "image", "source": {"type": "url", "url": server.url("/cat.png")}}, _text("Describe it.")]
    body = {"model": VLM, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    response = _post(stack, "/v1/messages", body)
    assert response.status_code == 200, response.text
    assert response.json()["content"] == [{"type": "text", "text": ANSWER}]
    assert [image.sha256 for image in _images(_messages(vlm.jobs[-1])[0])] == [PNG_SHA256]
    count = _post(stack, "/v1/messages/count_tokens", {"model": VLM, "messages": body["messages"]})
    assert count.json() == {"input_tokens": PROMPT_TOKENS}
    tokenize = vlm.jobs[-1]
    assert isinstance(tokenize, TokenizeJob) and tokenize.request.chat is not None
    assert [image.sha256 for image in tokenize.request.chat.images] == [PNG_SHA256]


def _upload(stack: Stack, key: str, data: bytes) -> str:
    response = httpx.post(
        f"{stack.base_url}/v1/files", data={"purpose": "vision"}, files={"file": ("cat.png", data, "image/png")},
        headers={"authorization": f"Bearer {key}"}, timeout=30,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    assert response.json()["purpose"] == "vision"
    return str(response.json()["id"])


def test_responses_take_an_uploaded_image_of_the_asking_key_only(stack: Stack, vlm: FakeChatWorker) -> None:
    file_id = _upload(stack, KEY_A, PNG)
    body = {"model": VLM, "store": False, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "file_id": file_id}]}]}  # fmt: skip
    response = _post(stack, "/v1/responses", body)
    assert response.status_code == 200, response.text
    message = _messages(vlm.jobs[-1])[0]
    assert isinstance(message.content, list) and isinstance(message.content[1], ImagePart)
    assert message.content[1].image.sha256 == PNG_SHA256
    error = _openai_error(_post(stack, "/v1/responses", body, key=KEY_B))  # another key's file: as if none
    assert error["param"] == "input[0].content[1]" and f"No file with id `{file_id}`" in error["message"]


def test_a_background_chat_job_names_its_images(stack: Stack, vlm: FakeChatWorker) -> None:
    response = _post(stack, "/v1/chat/completions", _chat(VLM, [_image_url(DATA_URL)], background=True))
    assert response.status_code == 200, response.text
    job_id = response.json()["id"]
    deadline = time.monotonic() + 10
    while not any(job.job_id == job_id for job in vlm.jobs) and time.monotonic() < deadline:
        time.sleep(0.02)
    job = vlm.job(job_id)
    assert isinstance(job, ChatJob)
    assert _messages(job)[0].content == [ImagePart(image=job.request.images[0])]


def test_image_metrics_are_exported(stack: Stack, vlm: FakeChatWorker) -> None:
    text = httpx.get(f"{stack.base_url}/metrics", headers={"authorization": f"Bearer {KEY_A}"}).text
    assert 'relaylm:images_total{source="data"}' in text
    assert 'relaylm:image_refusals_total{reason="not_vision"}' in text
    assert "relaylm:image_fetch_seconds_count" in text


def test_an_earlier_turns_images_are_loaded_again_for_previous_response_id(stack: Stack, vlm: FakeChatWorker) -> None:
    image = {"type": "input_image", "image_url": DATA_URL}
    first = _post(stack, "/v1/responses", {"model": VLM, "input": [{"role": "user", "content": [image]}]})
    assert first.status_code == 200, first.text
    second = _post(
        stack, "/v1/responses", {"model": VLM, "input": "And now?", "previous_response_id": first.json()["id"]}
    )
    assert second.status_code == 200, second.text
    messages = _messages(vlm.jobs[-1])
    assert [m.role for m in messages] == ["user", "assistant", "user"]
    assert [image.sha256 for image in _images(messages[0])] == [PNG_SHA256]
    assert messages[2].content == "And now?"


def test_images_wait_for_workers_that_read_them(stack: Stack) -> None:
    """A vision model whose live workers are of the release before images: 503, not a broken job."""
    older = FakeChatWorker(stack, "fake-vlm-older", vision=True, contract_version=2)
    try:
        response = _post(stack, "/v1/chat/completions", _chat("fake-vlm-older", [_image_url(DATA_URL)]))
        text_only = _post(stack, "/v1/chat/completions", _chat("fake-vlm-older", [_text("hi")]))
    finally:
        older.stop()
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "no_live_worker" and response.json()["error"]["param"] == "model"
    assert text_only.status_code == 200, text_only.text
