"""LoRA adapters served by workers of one base model (``relaylm worker --lora name=path``, or
``/v1/load_lora_adapter``): listed with their parent, selected by ``model``, stored in Redis so a
worker started without them serves them too, and placed on the worker that holds them ready; an
adapter's text is the same alone, in a batch with the base model and another adapter, and after
its worker is SIGKILLed mid-stream; an unknown adapter is a 404, one unloaded while a request
runs lets it finish, and adapters that do not fit are refused by the field at fault."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from shared.adapters import AdapterRecord
from tests.conftest import make_stack
from tests.e2e.test_fault_tolerance import _events, _text, stream_killing_its_worker
from tests.support.adapters import write_peft_adapter
from tests.support.batches import submit_batch
from tests.support.models import tiny_random_llama_dir
from tests.support.stack import Stack
from worker.native import exact

pytestmark = [pytest.mark.slow]
BASE = "tiny-base"
PROMPT = [{"role": "user", "content": "Name the colours of a rainbow."}]
# The exact kernels hold the promise where they build; elsewhere the text tests still run, with
# one worker's batches (the library kernels give a row other bits in another batch).
DETERMINISTIC = exact.available()
MAX_LORA_BYTES = 200_000  # a rank-8 adapter of the tiny model is 66 kB, a rank-64 one 525 kB


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "tone": write_peft_adapter(tiny_model_path, root / "tone", seed=1, scale=0.2),
        "plain": write_peft_adapter(
            tiny_model_path, root / "plain", seed=8, rank=2, targets=("o_proj", "down_proj"), scale=0.5
        ),
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
        stack.start_api(max_lora_bytes=MAX_LORA_BYTES, batch_poll_interval_s=0.2)
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
    plain = _chat(lora_stack, "plain")
    assert len({_content(base), _content(tone), _content(terse), _content(plain)}) == 4
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


def test_an_adapters_text_is_the_same_beside_the_base_and_two_other_adapters(lora_stack: Stack) -> None:
    models = ("tone", "terse", "plain", BASE)
    alone = {model: _content(_chat(lora_stack, model)) for model in models}
    with ThreadPoolExecutor(8) as pool:
        futures = [(model, pool.submit(_chat, lora_stack, model)) for model in models * 2]
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


def test_an_adapter_is_ready_and_tokenizes_as_its_base_model(lora_stack: Stack) -> None:
    url = lora_stack.base_url
    assert httpx.get(f"{url}/ready", params={"model": "tone"}, timeout=10).status_code == 200
    body = {"prompt": "Hello there"}
    tone = httpx.post(f"{url}/tokenize", json={**body, "model": "tone"}, timeout=30).json()
    base = httpx.post(f"{url}/tokenize", json={**body, "model": BASE}, timeout=30).json()
    assert tone == base and tone["max_model_len"] == 512


def test_an_unknown_adapter_is_a_404_and_an_adapter_makes_no_embeddings(lora_stack: Stack) -> None:
    body = {"model": "no-such-adapter", "messages": PROMPT}
    response = httpx.post(f"{lora_stack.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    embed = httpx.post(f"{lora_stack.base_url}/v1/embeddings", json={"model": "tone", "input": "hi"}, timeout=30)
    assert embed.status_code == 400 and "LoRA adapter" in embed.json()["error"]["message"]


def test_a_batchs_lines_run_on_its_adapter(lora_stack: Stack) -> None:
    expected = _content(_chat(lora_stack, "tone"))
    body = {"model": "tone", "messages": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    batch_id = submit_batch(lora_stack.base_url, [body, body])
    deadline = time.monotonic() + 60
    while (batch := httpx.get(f"{lora_stack.base_url}/v1/batches/{batch_id}", timeout=10).json())["status"] not in (
        "completed",
        "failed",
        "expired",
        "cancelled",
    ):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch["status"] == "completed", batch
    output = httpx.get(f"{lora_stack.base_url}/v1/files/{batch['output_file_id']}/content", timeout=10).text
    lines = [json.loads(line)["response"]["body"] for line in output.splitlines()]
    assert [line["model"] for line in lines] == ["tone", "tone"]
    assert [line["choices"][0]["message"]["content"] for line in lines] == [expected, expected]


def _load(stack: Stack, name: str, folder: Path, **extra: object) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(folder), **extra}
    return httpx.post(f"{stack.base_url}/v1/load_lora_adapter", json=body, timeout=30)


def test_an_adapter_loaded_through_the_api_is_placed_on_the_worker_that_holds_it(
    lora_stack: Stack, tiny_model_path: Path, tmp_path: Path
) -> None:
    folder = write_peft_adapter(tiny_model_path, tmp_path / "uploaded", seed=3, scale=0.2)
    loaded = _load(lora_stack, "uploaded", folder)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["parent"] == BASE and loaded.json()["rank"] == 8
    models = httpx.get(f"{lora_stack.base_url}/v1/models", timeout=10).json()["data"]
    assert {"id": "uploaded", "parent": BASE}.items() <= next(m for m in models if m["id"] == "uploaded").items()
    # Conversations of one message each: nothing of theirs is cached anywhere, yet every one goes
    # to the worker that made the adapter ready for the first.
    owners = []
    for number in range(5):
        messages = [{"role": "user", "content": f"Question number {number}?"}]
        answer = _chat(lora_stack, "uploaded", messages=messages, max_tokens=4)
        assert answer["model"] == "uploaded"
        owners.append(lora_stack.worker_of(str(answer["id"])))
    assert len(set(map(id, owners))) == 1
    others = [worker for worker in lora_stack.workers if worker is not owners[0]]
    assert all("LoRA adapter uploaded fetched" not in worker.log() for worker in others)


def test_loading_refuses_what_does_not_fit_by_the_field_at_fault(
    lora_stack: Stack, tiny_model_path: Path, tmp_path: Path
) -> None:
    again = _load(lora_stack, "tone", tmp_path)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    folder = write_peft_adapter(tiny_model_path, tmp_path / "dora", seed=4)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    dora = _load(lora_stack, "dora", folder)
    assert dora.status_code == 400 and "use_dora" in dora.json()["error"]["message"]
    other_base = write_peft_adapter(tiny_random_llama_dir(hidden_size=96), tmp_path / "other", seed=5)
    misfit = _load(lora_stack, "other", other_base)
    assert misfit.status_code == 400 and "another base model" in misfit.json()["error"]["message"]
    big = write_peft_adapter(tiny_model_path, tmp_path / "big", seed=6, rank=64)
    assert _load(lora_stack, "big", big).status_code == 413
    missing = _load(lora_stack, "missing", tmp_path / "nowhere")
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    models = {card["id"] for card in httpx.get(f"{lora_stack.base_url}/v1/models", timeout=10).json()["data"]}
    assert not models & {"dora", "other", "big", "missing"}


def test_an_adapter_unloaded_while_a_request_runs_lets_it_finish(
    lora_stack: Stack, tiny_model_path: Path, tmp_path: Path
) -> None:
    folder = write_peft_adapter(tiny_model_path, tmp_path / "brief", seed=7, scale=0.2)
    assert _load(lora_stack, "brief", folder).status_code == 200
    body = {"model": "brief", "messages": PROMPT, "max_tokens": 120, "ignore_eos": True}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    data: list[str] = []
    with httpx.stream("POST", f"{lora_stack.base_url}/v1/chat/completions", json=streamed, timeout=120) as response:
        for _, payload in _events(response):
            data.append(payload)
            if len(data) == 2:
                unload = httpx.post(
                    f"{lora_stack.base_url}/v1/unload_lora_adapter", json={"lora_name": "brief"}, timeout=10
                )
                assert unload.status_code == 200, unload.text
    assert data[-1] == "[DONE]"
    usage = [json.loads(item)["usage"] for item in data[:-1] if json.loads(item).get("usage")]
    assert usage[-1]["completion_tokens"] == 120  # all of it, on the adapter it began with
    after = httpx.post(f"{lora_stack.base_url}/v1/chat/completions", json=body, timeout=30)
    assert after.status_code == 404
    gone = httpx.post(f"{lora_stack.base_url}/v1/unload_lora_adapter", json={"lora_name": "brief"}, timeout=10)
    assert gone.status_code == 404


@pytest.mark.skipif(not DETERMINISTIC, reason="the same text after failover is the exact kernels' promise")
def test_a_killed_workers_adapter_stream_continues_with_the_same_text(lora_stack: Stack) -> None:
    body = {"model": "tone", "messages": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    expected = _content(_chat(lora_stack, "tone", max_tokens=200))
    data = stream_killing_its_worker(lora_stack, body)
    assert data[-1] == "[DONE]"
    assert _text(data) == expected
