"""``/v1/embeddings`` on the real packaged all-MiniLM-L6-v2, through the queue and a worker."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import redis

from tests.conftest import TINY_MODEL, make_stack
from tests.support.stack import Stack, wait_until
from worker.embedding.loader import DEFAULT_EMBEDDING_MODEL

EMBED = "minilm"


@pytest.fixture(scope="module")
def embed_stack(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        stack.start_worker(DEFAULT_EMBEDDING_MODEL, EMBED)
        stack.start_worker(tiny_model_path, TINY_MODEL, dtype="float32", max_model_len=256)
        yield stack
    finally:
        stack.stop()


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_related_sentences_are_closer_than_unrelated_ones(embed_stack: Stack) -> None:
    texts = ["A cat sits on the mat.", "A kitten is resting on a rug.", "Quarterly tax filings are due in April."]
    response = embed_stack.client().embeddings.create(model=EMBED, input=texts)
    vectors = [item.embedding for item in response.data]
    assert [item.index for item in response.data] == [0, 1, 2]
    assert all(len(vector) == 384 for vector in vectors)
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1.0) < 1e-4 for v in vectors)  # normalised
    assert _cosine(vectors[0], vectors[1]) > _cosine(vectors[0], vectors[2]) + 0.3
    assert response.usage.prompt_tokens == response.usage.total_tokens > 0


def test_base64_is_little_endian_float32_of_the_same_vector(embed_stack: Stack) -> None:
    client = embed_stack.client()
    floats = client.embeddings.create(model=EMBED, input="hello world").data[0].embedding
    raw = client.embeddings.with_raw_response.create(model=EMBED, input="hello world", encoding_format="base64")
    encoded = raw.http_response.json()["data"][0]["embedding"]
    decoded = struct.unpack(f"<{len(floats)}f", base64.b64decode(encoded))
    assert max(abs(a - b) for a, b in zip(decoded, floats, strict=True)) < 1e-6


def test_token_id_inputs_and_dimensions(embed_stack: Stack) -> None:
    client = embed_stack.client()
    assert len(client.embeddings.create(model=EMBED, input=[[101, 7592, 102]]).data) == 1
    assert len(client.embeddings.create(model=EMBED, input="x", dimensions=384).data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model=EMBED, input="x", dimensions=128)
    assert raised.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.embeddings.create(model=EMBED, input="word " * 400)
    assert too_long.value.code == "context_length_exceeded"


def _num_queued(stack: Stack, model: str) -> int:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        return int(client.zcard(stack.keys.queue(model)))
    finally:
        client.close()


def test_concurrent_requests_are_micro_batched(embed_stack: Stack) -> None:
    async def burst() -> None:
        client = openai.AsyncOpenAI(base_url=f"{embed_stack.base_url}/v1", api_key="x", max_retries=0)
        await asyncio.gather(*(client.embeddings.create(model=EMBED, input=f"sentence {i}") for i in range(24)))
        await client.close()

    # All 24 are queued before the worker takes any, so they meet in its batches however fast it
    # embeds (one by one, each could be done before the next came). Each batch is logged before
    # its answers are sent.
    embedder = embed_stack.workers[0]
    with ThreadPoolExecutor(1) as pool:
        with embedder.paused():
            sent = pool.submit(asyncio.run, burst())
            wait_until(lambda: _num_queued(embed_stack, EMBED) == 24, "the 24 requests were never all queued")
        sent.result()
    batches = [line for line in embed_stack.workers[0].log().splitlines() if "embedding batch:" in line]
    sizes = [int(line.split("embedding batch: ")[1].split(" requests")[0]) for line in batches]
    assert max(sizes) > 1, sizes


def test_models_show_their_task_and_tasks_do_not_mix(embed_stack: Stack) -> None:
    client = embed_stack.client()
    tasks = {model.id: model.model_extra["task"] for model in client.models.list().data}
    assert tasks[EMBED] == "embed" and tasks[TINY_MODEL] == "generate"
    with pytest.raises(openai.BadRequestError) as chat_on_embedder:
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
    assert "embeddings only" in chat_on_embedder.value.message
    with pytest.raises(openai.BadRequestError) as embed_on_generator:
        client.embeddings.create(model=TINY_MODEL, input="hi")
    assert "chat and text completions only" in embed_on_generator.value.message
