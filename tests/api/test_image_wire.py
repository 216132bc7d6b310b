"""Image parts of the three APIs → the job contract's messages: parts kept in order, text-only
messages still one string, each image part named as its own API names fields."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from api.batches.validation import validate_batch_file
from api.jobs.build import chat_generate
from api.wire import anthropic, responses
from api.wire.openai.chat_request import ChatCompletionRequest, image_sources
from api.wire.openai.images import ImageLocator, ImageSource
from shared.contract import ImagePart, ImageRef, Message, TextPart
from shared.errors import RelayError

URL_A, URL_B = "data:image/png;base64,QQ==", "https://images.example/b.jpg"
FILE_C = {"type": "file", "file": {"file_id": "file-c"}}


def _ref(letter: str) -> ImageRef:
    return ImageRef(sha256=letter * 64, media_type="image/png", width=4, height=3)


REFS = {
    ImageLocator(url=URL_A): _ref("a"),
    ImageLocator(url=URL_B): _ref("b"),
    ImageLocator(file_id="file-c"): _ref("c"),
    ImageLocator(url="data:image/jpeg;base64,RA=="): _ref("d"),
}


def _image_url(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def _chat(messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "vlm", "messages": messages})


def _messages(request: ChatCompletionRequest) -> list[Message]:
    return chat_generate(request, images=REFS).messages or []


# -- chat completions ---------------------------------------------------------------------------


def test_chat_parts_keep_their_order_and_text_only_messages_stay_strings() -> None:
    request = _chat([
        {"role": "system", "content": [_text("Be brief."), _text("Be kind.")]},
        {"role": "user", "content": [_text("Compare"), _image_url(URL_A, detail="low"), _text("with"),
                                     _image_url(URL_B, detail="high"), FILE_C]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [_text("And"), _text("now?")]},
        {"role": "user", "content": [_image_url(URL_A)]},
    ])  # fmt: skip
    messages = _messages(request)
    assert messages[0].content == "Be brief.\nBe kind."
    assert messages[1].content == [TextPart(text="Compare"), ImagePart(image=_ref("a")), TextPart(text="with"),
                                   ImagePart(image=_ref("b")), ImagePart(image=_ref("c"))]  # fmt: skip
    assert messages[2].content == "They differ."
    assert messages[3].content == "And\nnow?"
    assert messages[4].content == [ImagePart(image=_ref("a"))]
    assert [(s.param, s.locator) for s in image_sources(request)] == [
        ("messages[1].content[1].image_url", ImageLocator(url=URL_A)),
        ("messages[1].content[3].image_url", ImageLocator(url=URL_B)),
        ("messages[1].content[4].file", ImageLocator(file_id="file-c")),
        ("messages[4].content[0].image_url", ImageLocator(url=URL_A)),
    ]


def test_a_text_only_request_is_the_job_it_always_was() -> None:
    request = _chat([{"role": "user", "content": "hi"}, {"role": "user", "content": [_text("a"), _text("b")]}])
    assert [m.content for m in _messages(request)] == ["hi", "a\nb"]
    assert image_sources(request) == [] and chat_generate(request).images == []


@pytest.mark.parametrize(
    "message",
    [
        {"role": "system", "content": [_image_url(URL_A)]},
        {"role": "assistant", "content": [_image_url(URL_A)]},
        {"role": "tool", "tool_call_id": "c", "content": [_image_url(URL_A)]},
        {"role": "user", "content": [{"type": "image_url"}]},
        {"role": "user", "content": [_image_url(URL_A, detail="ultra")]},
        {"role": "user", "content": [{"type": "file", "file": {"file_data": "QQ=="}}]},
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]},
    ],
)
def test_images_outside_a_user_turn_and_malformed_parts_are_refused(message: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        _chat([message])


def test_an_image_never_loaded_is_a_400_not_a_job() -> None:
    """What a route that loads no images (a batch line) would build: refused, never half-built."""
    with pytest.raises(RelayError) as refused:
        chat_generate(_chat([{"role": "user", "content": [_image_url(URL_A)]}]))
    assert refused.value.status == 400


def test_a_batch_line_with_an_image_is_refused_naming_the_part() -> None:
    body = {"model": "vlm", "messages": [{"role": "user", "content": [_text("x"), _image_url(URL_A)]}]}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    checked = validate_batch_file(json.dumps(line).encode(), "/v1/chat/completions", 10, {"vlm"}.__contains__)
    assert not checked.lines
    assert [(e.line, e.param) for e in checked.errors] == [(1, "body.messages[0].content[1].image_url")]


# -- Responses ----------------------------------------------------------------------------------


def _responses(input_items: Any, **fields: Any) -> responses.ResponsesRequest:
    return responses.ResponsesRequest.model_validate({"model": "vlm", "input": input_items, **fields})


def test_responses_input_images_become_image_parts_in_order() -> None:
    body = _responses([
        {"role": "user", "content": [{"type": "input_text", "text": "What is"},
                                     {"type": "input_image", "image_url": URL_A, "detail": "auto"},
                                     {"type": "input_text", "text": "and"},
                                     {"type": "input_image", "file_id": "file-c"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "A cat."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Sure?"}]},
    ], instructions="Answer.")  # fmt: skip
    history: list[Any] = [responses.MessageItem(role="user", content=[
        responses.InputImage(type="input_image", image_url=URL_B), responses.InputText(type="input_text", text="x"),
    ])]  # fmt: skip
    messages = _messages(responses.to_chat_request(body, history))
    assert [m.content for m in messages] == [
        "Answer.",
        [ImagePart(image=_ref("b")), TextPart(text="x")],
        [TextPart(text="What is"), ImagePart(image=_ref("a")), TextPart(text="and"), ImagePart(image=_ref("c"))],
        "A cat.",
        "Sure?",
    ]
    assert responses.image_sources(body, history) == [
        ImageSource("previous_response_id", ImageLocator(url=URL_B)),
        ImageSource("input[0].content[1]", ImageLocator(url=URL_A)),
        ImageSource("input[0].content[3]", ImageLocator(file_id="file-c")),
    ]


def test_responses_text_input_is_unchanged() -> None:
    body = _responses([{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                    {"type": "input_text", "text": "b"}]}])  # fmt: skip
    assert [m.content for m in _messages(responses.to_chat_request(body, []))] == ["ab"]
    assert responses.image_sources(_responses("hello"), []) == []


@pytest.mark.parametrize("part", [{"type": "input_image"}, {"type": "input_image", "image_url": URL_A,
                                                            "file_id": "file-c"}])  # fmt: skip
def test_an_input_image_names_one_image(part: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        _responses([{"role": "user", "content": [part]}])


def test_responses_images_outside_a_user_message_are_refused() -> None:
    body = _responses([{"role": "system", "content": [{"type": "input_image", "image_url": URL_A}]}])
    with pytest.raises(ValueError, match="user messages"):
        responses.to_chat_request(body, [])


# -- Anthropic Messages -------------------------------------------------------------------------


def _anthropic(messages: list[dict[str, Any]]) -> anthropic.MessagesRequest:
    return anthropic.MessagesRequest.model_validate({"model": "vlm", "max_tokens": 5, "messages": messages})


def test_anthropic_image_blocks_become_image_parts_in_order() -> None:
    body = _anthropic([
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "RA=="}},
            {"type": "text", "text": "and"},
            {"type": "image", "source": {"type": "url", "url": URL_B}},
            {"type": "image", "source": {"type": "file", "file_id": "file-c"}},
        ]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "seen"},
                                     {"type": "text", "text": "Now"}, {"type": "text", "text": " this:"},
                                     {"type": "image", "source": {"type": "url", "url": URL_A}}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ])  # fmt: skip
    messages = _messages(anthropic.to_chat_request(body))
    assert [(m.role, m.content) for m in messages] == [
        ("user", [ImagePart(image=_ref("d")), TextPart(text="and"), ImagePart(image=_ref("b")),
                  ImagePart(image=_ref("c"))]),
        ("assistant", ""),
        ("tool", "seen"),
        ("user", [TextPart(text="Now"), TextPart(text=" this:"), ImagePart(image=_ref("a"))]),
        ("user", "ab"),
    ]  # fmt: skip
    assert [s.param for s in anthropic.image_sources(body)] == [
        "messages[0].content[0].source", "messages[0].content[2].source", "messages[0].content[3].source",
        "messages[2].content[3].source",
    ]  # fmt: skip


def test_anthropic_images_in_an_assistant_turn_are_refused() -> None:
    body = _anthropic([{"role": "assistant", "content": [{"type": "image", "source": {"type": "url", "url": URL_B}}]}])
    with pytest.raises(ValueError, match="user turn"):
        anthropic.to_chat_request(body)


@pytest.mark.parametrize("source", [{"type": "base64", "data": "QQ=="}, {"type": "url"}, {"type": "path", "url": "x"}])
def test_anthropic_malformed_sources_are_refused(source: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        _anthropic([{"role": "user", "content": [{"type": "image", "source": source}]}])
