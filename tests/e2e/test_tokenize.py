"""``/tokenize`` and ``/detokenize`` (vLLM's shapes) on a real stack: the worker's own tokenizer and
chat template, so a chat prompt's count equals the prompt tokens the same chat request reports."""

from __future__ import annotations

from pathlib import Path

import httpx
from transformers import AutoTokenizer

from tests.conftest import TINY_MODEL
from tests.support.stack import Stack

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def test_a_prompt_round_trips_through_the_models_tokenizer(tiny_stack: Stack, tiny_model_path: Path) -> None:
    text = "Hello, world: tokens and back."
    reply = httpx.post(f"{tiny_stack.base_url}/tokenize", json={"model": TINY_MODEL, "prompt": text}, timeout=30)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    expected = AutoTokenizer.from_pretrained(tiny_model_path).encode(text)
    assert body["tokens"] == expected and body["count"] == len(expected) and body["max_model_len"] == 1024
    back = httpx.post(
        f"{tiny_stack.base_url}/detokenize", json={"model": TINY_MODEL, "tokens": body["tokens"]}, timeout=30
    )
    assert back.status_code == 200 and text in back.json()["prompt"]


def test_chat_messages_count_what_the_chat_request_reports(tiny_stack: Stack) -> None:
    counted = httpx.post(f"{tiny_stack.base_url}/tokenize", json={"model": TINY_MODEL, "messages": MESSAGES}).json()
    chat = tiny_stack.client().chat.completions.create(model=TINY_MODEL, messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and counted["count"] == chat.usage.prompt_tokens == len(counted["tokens"])


def test_bad_tokenize_requests_are_openai_errors(tiny_stack: Stack) -> None:
    url = tiny_stack.base_url
    both = httpx.post(f"{url}/tokenize", json={"model": TINY_MODEL, "prompt": "x", "messages": MESSAGES})
    assert both.status_code == 400 and set(both.json()["error"]) == {"message", "type", "param", "code"}
    outside = httpx.post(f"{url}/detokenize", json={"model": TINY_MODEL, "tokens": [0, 10**9]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    unknown = httpx.post(f"{url}/tokenize", json={"model": "no-such-model", "prompt": "x"})
    assert unknown.status_code == 404
