"""LoRA adapters served by workers of one base model (``relaylm worker --lora name=path``): listed
with their parent, selected by ``model``, stored in Redis so a worker started without them serves
them too; an adapter's text is the same alone, in a batch with the base model and another
adapter, and after its worker is SIGKILLed mid-stream; an unknown adapter is a 404."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from shared.adapters import AdapterRecord
from tests.conftest import make_stack
from tests.e2e.test_fault_tolerance import _events, _text
from tests.support.adapters import write_peft_adapter
from tests.support.stack import Stack
from worker.native import exact

pytestmark = [pytest.mark.slow]
BASE = "tiny-base"
PROMPT = [{"role": "user", "content": "Name the colours of a rainbow."}]
# The exact kernels hold the promise where they build; elsewhere the text tests still run, with
# one worker's batches (the library kernels give a row other bits in another batch).
DETERMINISTIC = exact.available()


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "tone": write_peft_adapter(tiny_model_path, root / "tone", seed=1, scale=0.2),
        "terse": write_peft_adapter(
            tiny_model_path, root / "terse", seed=2, rank=4, targets=("q_proj", "v_proj"), scale=0.3
        ),
    }


@pytest.fixture(scope="module")
def lora_stack(redis_url: str, log_dir: Path, tiny_model_path: Path, adapter_dirs: dict[str, Path]) -> Iterator[Stack]:
    """Two workers of the base model: the first started with both adapters, the second with none."""
    stack = make_stack(redis_url, log_dir)
    settings: dict[str, object] = {
        "max_model_len": 512,
        "deterministic": "on" if DETERMINISTIC else "off",
        "dtype": "bfloat16",
    }
    try:
        stack.start_api()
        lora = ",".join(f"{name}={folder}" for name, folder in adapter_dirs.items())
        stack.start_worker(tiny_model_path, BASE, lora=lora, **settings)
        stack.start_worker(tiny_model_path, BASE, **settings)
        yield stack
    finally:
        stack.stop()


def _chat(stack: Stack, model: str, **extra: object) -> dict[str, object]:
    body = {"model": model, "messages": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, **extra}
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer: dict[str, object] = response.json()
    return answer


def _content(answer: dict[str, object]) -> str:
    return str(answer["choices"][0]["message"]["content"])  # type: ignore[index]


def test_adapters_are_listed_under_their_base_and_stored_in_redis(lora_stack: Stack) -> None:
    models = {card["id"]: card for card in httpx.get(f"{lora_stack.base_url}/v1/models", timeout=10).json()["data"]}
    assert models["tone"]["parent"] == BASE and models["terse"]["parent"] == BASE
    assert models[BASE]["parent"] is None
    client = redis.Redis.from_url(lora_stack.redis_url)
    try:
        record = AdapterRecord.model_validate_json(client.hget(lora_stack.keys.adapters(), "tone") or b"")
    finally:
        client.close()
    assert record.base == BASE and record.rank == 8 and len(record.targets) == 7


def test_an_adapter_answers_under_its_own_name_with_its_own_text(lora_stack: Stack) -> None:
    base, tone, terse = (_chat(lora_stack, model) for model in (BASE, "tone", "terse"))
    assert (base["model"], tone["model"], terse["model"]) == (BASE, "tone", "terse")
    assert len({_content(base), _content(tone), _content(terse)}) == 3
    # Twice: the same text (the second from the prefix cache, which keys an adapter's prompts apart).
    assert _content(_chat(lora_stack, "tone")) == _content(tone)
    # Completions, Responses and Anthropic Messages select it the same way.
    url = lora_stack.base_url
    completion = httpx.post(
        f"{url}/v1/completions", json={"model": "tone", "prompt": "Hi", "max_tokens": 5}, timeout=60
    )
    assert completion.status_code == 200 and completion.json()["model"] == "tone", completion.text
    response = httpx.post(
        f"{url}/v1/responses", json={"model": "tone", "input": "Hi", "max_output_tokens": 5}, timeout=60
    )
    assert response.status_code == 200 and response.json()["model"] == "tone", response.text
    message = {"model": "terse", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    anthropic = httpx.post(f"{url}/v1/messages", json=message, timeout=60)
    assert anthropic.status_code == 200 and anthropic.json()["model"] == "terse", anthropic.text


def test_an_adapters_text_is_the_same_beside_the_base_and_another_adapter(lora_stack: Stack) -> None:
    alone = {model: _content(_chat(lora_stack, model)) for model in ("tone", "terse", BASE)}
    with ThreadPoolExecutor(9) as pool:
        futures = [(model, pool.submit(_chat, lora_stack, model)) for model in ("tone", "terse", BASE) * 3]
        together = [(model, _content(future.result())) for model, future in futures]
    for model, text in together:
        assert text == alone[model], model


def test_a_worker_started_without_an_adapter_fetches_it_from_redis(lora_stack: Stack) -> None:
    expected = _content(_chat(lora_stack, "terse"))
    first = lora_stack.workers[0]
    first.popen.send_signal(signal.SIGSTOP)  # only the second worker claims meanwhile
    try:
        answer = _chat(lora_stack, "terse")
    finally:
        first.popen.send_signal(signal.SIGCONT)
    assert lora_stack.worker_of(str(answer["id"])) is lora_stack.workers[1]
    assert "LoRA adapter terse fetched from Redis and ready" in lora_stack.workers[1].log()
    assert _content(answer) == expected


def test_an_unknown_adapter_is_a_404_and_an_adapter_makes_no_embeddings(lora_stack: Stack) -> None:
    body = {"model": "no-such-adapter", "messages": PROMPT}
    response = httpx.post(f"{lora_stack.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    embed = httpx.post(f"{lora_stack.base_url}/v1/embeddings", json={"model": "tone", "input": "hi"}, timeout=30)
    assert embed.status_code == 400 and "LoRA adapter" in embed.json()["error"]["message"]


@pytest.mark.skipif(not DETERMINISTIC, reason="the same text after failover is the exact kernels' promise")
def test_a_killed_workers_adapter_stream_continues_with_the_same_text(lora_stack: Stack) -> None:
    body = {"model": "tone", "messages": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    expected = _content(_chat(lora_stack, "tone", max_tokens=200))
    data: list[str] = []
    with httpx.stream(
        "POST", f"{lora_stack.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        for _, payload in _events(response):
            data.append(payload)
            if len(data) == 5:
                lora_stack.worker_of(json.loads(payload)["id"]).popen.send_signal(signal.SIGKILL)
    assert data[-1] == "[DONE]"
    assert _text(data) == expected
