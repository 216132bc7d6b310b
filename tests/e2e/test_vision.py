"""Images through the whole stack with the official SDKs: the `openai` client (chat and
Responses) and the `anthropic` client (Messages), on tiny random-weight vision-language workers
(a Qwen2-VL and an Idefics3; fakes, named as such) beside a text-only one. Data URLs, several
images, an uploaded file, a remote image from a loopback HTTP server the allowlist lets in, the
refusals, the image caches, and a worker killed in the middle of an image request.
"""

from __future__ import annotations

import base64
import io
import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from tests.conftest import make_stack
from tests.support.image_server import ImageServer, Reply, image_server
from tests.support.stack import Stack
from tests.support.vision import sample_image, tiny_random_idefics3_dir, tiny_random_qwen_vl_dir

pytestmark = pytest.mark.slow

QWEN = "tiny-random-qwen2-vl"
IDEFICS = "tiny-random-idefics3"
TEXT = "tiny-random-text"
MAX_IMAGE_BYTES = 200_000
MAX_IMAGE_PIXELS = 1_000_000


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


RED_BLOCKS = _png(sample_image(64, 48, seed=11))
BLUE_BLOCKS = _png(sample_image(40, 56, seed=12))


@pytest.fixture(scope="module")
def server() -> Iterator[ImageServer]:
    with image_server() as running:
        running.replies["/red.png"] = Reply(body=RED_BLOCKS, headers={"Content-Type": "image/png"})
        running.replies["/to-private"] = Reply(status=302, headers={"Location": "http://10.20.30.40/red.png"})
        running.replies["/huge.png"] = Reply(body=b"\x89PNG" + bytes(MAX_IMAGE_BYTES + 10))
        big = _png(Image.new("RGB", (1200, 1000), (10, 200, 10)))  # few bytes, 1.2 million pixels
        running.replies["/many-pixels.png"] = Reply(body=big, headers={"Content-Type": "image/png"})
        running.replies["/not-an-image.png"] = Reply(body=b"<html>hello</html>", headers={"Content-Type": "image/png"})
        yield running


@pytest.fixture(scope="module")
def stack(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    """An API that may fetch from 127.0.0.1 only; two Qwen2-VL workers (one is killed by a test),
    an Idefics3 worker and a text-only one."""
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(
            allow_remote_images=True, allowed_image_networks="127.0.0.1/32", max_image_bytes=MAX_IMAGE_BYTES,
            max_image_pixels=MAX_IMAGE_PIXELS,
        )  # fmt: skip
        qwen = tiny_random_qwen_vl_dir("qwen2_vl")
        for _ in range(2):
            stack.start_worker(qwen, QWEN, max_model_len=1024, wait=False)
        stack.start_worker(tiny_random_idefics3_dir(), IDEFICS, max_model_len=1024, wait=False)
        stack.start_worker(tiny_model_path, TEXT, max_model_len=1024, wait=False)
        for process, name in zip(stack.workers, (QWEN, QWEN, IDEFICS, TEXT), strict=True):
            stack.wait_ready(process, name)
        yield stack
    finally:
        stack.stop()


def _chat(stack: Stack, content: list[dict[str, Any]], model: str = QWEN, **extra: Any) -> Any:
    return stack.client().chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
        temperature=0, max_tokens=12, **extra,
    )  # fmt: skip


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _worker_counts(stack: Stack, model: str) -> tuple[int, int]:
    """(images encoded, image-cache hits) over the model's workers, from /metrics."""
    text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text

    def total(name: str) -> int:
        pattern = rf'^relaylm:{name}{{model="{re.escape(model)}",worker="[^"]+"}} ([0-9.e+]+)$'
        return int(sum(float(value) for value in re.findall(pattern, text, re.MULTILINE)))

    return total("images_encoded"), total("image_cache_hits")


def test_several_data_url_images_in_chat_and_the_repeat_served_from_the_caches(stack: Stack) -> None:
    content = [
        {"type": "text", "text": "Compare"}, _image_part(_data_url(RED_BLOCKS)),
        {"type": "text", "text": "with"}, _image_part(_data_url(BLUE_BLOCKS)), {"type": "text", "text": "please."},
    ]  # fmt: skip
    text_only = _chat(stack, [{"type": "text", "text": "Compare with please."}])
    first = _chat(stack, content)
    encoded, hits = _worker_counts(stack, QWEN)
    # Two workers serve the model, and a one-message conversation is not placed: each repeat goes
    # to the worker that asks first. The first repeat on the first request's worker is served
    # from its caches; on the other worker, it leaves the prompt in both, and the second repeat
    # is served from the caches wherever it goes. So one of the two is, at least.
    repeats = [_chat(stack, content) for _ in range(2)]
    assert first.choices[0].message.content
    assert all(again.choices[0].message.content == first.choices[0].message.content for again in repeats)
    # Each image became its placeholders: many more prompt tokens than the words alone.
    assert first.usage.prompt_tokens > text_only.usage.prompt_tokens + 10
    assert all(again.usage.prompt_tokens == first.usage.prompt_tokens for again in repeats)
    cached = [(again.usage.prompt_tokens_details.cached_tokens or 0) if again.usage.prompt_tokens_details else 0
              for again in repeats]  # fmt: skip
    assert any(count > 0 for count in cached), cached
    after = _worker_counts(stack, QWEN)
    if after[0] == encoded:  # the first request's worker took both repeats: no image encoded again
        assert after[1] >= hits + 4


def test_a_remote_image_answers_as_its_data_url_does(stack: Stack, server: ImageServer) -> None:
    question = {"type": "text", "text": "What is this?"}
    by_url = _chat(stack, [_image_part(server.url("/red.png")), question])
    by_data = _chat(stack, [_image_part(_data_url(RED_BLOCKS)), question])
    assert by_url.choices[0].message.content == by_data.choices[0].message.content
    assert by_url.usage.prompt_tokens == by_data.usage.prompt_tokens
    assert any(seen.path == "/red.png" for seen in server.seen)


def test_responses_take_an_image_url_and_an_uploaded_file(stack: Stack) -> None:
    client = stack.client()
    uploaded = client.files.create(file=("red.png", RED_BLOCKS, "image/png"), purpose="vision")
    answers = []
    for image in ({"image_url": _data_url(RED_BLOCKS)}, {"file_id": uploaded.id}):
        response = client.responses.create(
            model=QWEN, temperature=0, max_output_tokens=12,
            input=[{"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "detail": "auto", **image},
            ]}],  # type: ignore[list-item]
        )  # fmt: skip
        assert response.status == "incomplete"  # at max_output_tokens: the random model never stops
        answers.append((response.output_text, response.usage.input_tokens if response.usage else 0))
    assert answers[0] == answers[1]
    assert answers[0][0]


def test_anthropic_messages_take_base64_and_url_images(stack: Stack, server: ImageServer) -> None:
    client = anthropic.Anthropic(base_url=stack.base_url, api_key="unused", max_retries=0)
    answers = []
    for source in (
        {"type": "base64", "media_type": "image/png", "data": base64.b64encode(RED_BLOCKS).decode()},
        {"type": "url", "url": server.url("/red.png")},
    ):
        message = client.messages.create(
            model=IDEFICS, max_tokens=12, extra_body={"temperature": 0},  # this SDK version has no temperature
            messages=[{"role": "user", "content": [
                {"type": "image", "source": source}, {"type": "text", "text": "What is this?"},  # type: ignore[typeddict-item,misc]
            ]}],
        )  # fmt: skip
        text = "".join(block.text for block in message.content if block.type == "text")
        answers.append((text, message.usage.input_tokens))
    assert answers[0] == answers[1]
    assert answers[0][1] > 20  # the image's tiles and placeholders


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("/to-private", "not public"),
        ("/huge.png", "bytes"),
        ("/many-pixels.png", "pixels"),
        ("/not-an-image.png", "image"),
        ("data:image/png;base64,%%%not-base64", "data"),
    ],
    ids=["redirect-to-private", "too-many-bytes", "too-many-pixels", "not-an-image", "bad-data-url"],
)
def test_refused_images_get_a_400_naming_the_part(stack: Stack, server: ImageServer, url: str, reason: str) -> None:
    target = server.url(url) if url.startswith("/") else url
    content = [{"type": "text", "text": "Look:"}, _image_part(target)]
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(stack, content)
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == "messages[0].content[1].image_url"
    assert reason in error["message"].lower()


def test_loopback_is_refused_where_it_is_not_allowlisted(stack: Stack, server: ImageServer) -> None:
    """A second API on the same Redis and workers, with remote images on but no allowlist."""
    other = Stack(redis_url=stack.redis_url, log_dir=stack.log_dir, key_prefix=stack.key_prefix)
    try:
        other.start_api(allow_remote_images=True)
        with pytest.raises(openai.BadRequestError) as refused:
            _chat(other, [_image_part(server.url("/red.png"))])
        assert refused.value.body["param"] == "messages[0].content[0].image_url"  # type: ignore[index]
        assert "not public" in refused.value.body["message"]  # type: ignore[index]
        assert _chat(other, [_image_part(_data_url(RED_BLOCKS))]).choices[0].message.content
    finally:
        other.stop()


def test_a_text_only_model_refuses_an_image_naming_the_model(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(stack, [_image_part(_data_url(RED_BLOCKS))], model=TEXT)
    assert TEXT in refused.value.body["message"]  # type: ignore[index]
    assert refused.value.body["param"] == "model"  # type: ignore[index]


def test_an_image_request_continues_on_the_other_worker_when_its_worker_is_killed(stack: Stack) -> None:
    """The text after the SIGKILL equals the undisturbed text: the other worker reads the image
    from Redis, encodes it and recomputes the prompt and the tokens already sent."""
    body = {
        "model": QWEN, "temperature": 0, "max_tokens": 300, "ignore_eos": True,
        "messages": [{"role": "user", "content": [_image_part(_data_url(BLUE_BLOCKS)),
                                                  {"type": "text", "text": "Tell me everything."}]}],
    }  # fmt: skip
    url = f"{stack.base_url}/v1/chat/completions"
    expected = httpx.post(url, json=body, timeout=120).json()["choices"][0]["message"]["content"]
    chunks: list[str] = []
    killed = None
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            chunks.append(line[6:])
            if len(chunks) == 5:
                job_id = json.loads(line[6:])["id"]
                killed = stack.worker_of(job_id)
                killed.popen.send_signal(signal.SIGKILL)
                killed.popen.wait()
                # A dead worker ends nothing: the job was cut short, not already done.
                assert stack.job_state(job_id) in ("running", "queued"), "the job ended before the kill"
    assert killed is not None and chunks[-1] == "[DONE]"
    parsed = [json.loads(chunk) for chunk in chunks[:-1]]
    assert not any("error" in chunk for chunk in parsed)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in parsed if c.get("choices"))
    assert text == expected
    survivor = next(w for w in stack.workers[:2] if w is not killed)
    assert "event=picked" in survivor.log()
