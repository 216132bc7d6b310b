"""The OpenAI Responses API, driven by the official ``openai`` SDK against a real stack: create and
stream (the documented event sequence with contiguous sequence numbers), a forced function call
and the turn after it (stateless, and through ``previous_response_id``), structured output, and
stored responses (retrieve, input items, delete) owned by the key that made them. The model is a
tiny random Qwen3 (a fake, named as such); forced tool choice and formats hold through the
constrained decoder."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import redis

from tests.conftest import make_stack
from tests.support.qwen import tiny_random_qwen3_dir
from tests.support.stack import Stack, wait_until

pytestmark = pytest.mark.slow

MODEL = "qwen-random-responses"
KEY_A, KEY_B = "sk-responses-a", "sk-responses-b"
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
NO_THINKING: Any = {"effort": "none"}


@pytest.fixture(scope="module")
def responses_stack(redis_url: str, log_dir: Path) -> Iterator[Stack]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(api_keys=f"{KEY_A},{KEY_B}")
        stack.start_worker(tiny_random_qwen3_dir("qwen3"), MODEL, dtype="float32", max_model_len=1024)
        yield stack
    finally:
        stack.stop()


def _client(stack: Stack, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)


def test_a_response_is_created_stored_and_retrieved(responses_stack: Stack) -> None:
    client = _client(responses_stack)
    response = client.responses.create(
        model=MODEL, input="hello", instructions="Be brief.", max_output_tokens=8, temperature=0, reasoning=NO_THINKING
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.model == MODEL
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text and response.usage is not None and response.usage.input_tokens > 5
    assert 1 <= response.usage.output_tokens <= 8
    assert client.responses.retrieve(response.id).output_text == response.output_text
    items = client.responses.input_items.list(response.id)
    assert [item.type for item in items.data] == ["message"]
    with pytest.raises(openai.NotFoundError):  # another key: as if it never existed
        _client(responses_stack, KEY_B).responses.retrieve(response.id)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_a_streamed_response_is_the_documented_event_sequence(responses_stack: Stack) -> None:
    client = _client(responses_stack)
    events = list(
        client.responses.create(
            model=MODEL, input="hello", max_output_tokens=12, temperature=0, reasoning=NO_THINKING, stream=True
        )
    )
    types = [event.type for event in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text
    same = client.responses.create(
        model=MODEL, input="hello", max_output_tokens=12, temperature=0, reasoning=NO_THINKING
    )
    assert same.output_text == text
    assert client.responses.retrieve(final.id).output_text == text  # stored at the end of the stream


def test_a_forced_function_call_and_the_turn_after_it(responses_stack: Stack) -> None:
    client = _client(responses_stack)
    first = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", reasoning=NO_THINKING
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Oslo"})
    result: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    chained = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER], max_output_tokens=6,
        reasoning=NO_THINKING, temperature=0,
    )  # fmt: skip
    assert chained.status in ("completed", "incomplete") and chained.previous_response_id == first.id
    # The same turn, stateless: the earlier call sent back as an item.
    stateless = client.responses.create(
        model=MODEL, tools=[WEATHER], max_output_tokens=6, reasoning=NO_THINKING, temperature=0,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            result,
        ],
    )  # fmt: skip
    assert chained.usage is not None and stateless.usage is not None
    assert chained.usage.input_tokens == stateless.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
    assert chained.output_text == stateless.output_text
    with pytest.raises(openai.NotFoundError):  # another key cannot continue it
        _client(responses_stack, KEY_B).responses.create(model=MODEL, previous_response_id=first.id, input="x")


def test_a_streamed_function_call_arrives_as_argument_deltas(responses_stack: Stack) -> None:
    stream = _client(responses_stack).responses.create(
        model=MODEL, input="Weather?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        reasoning=NO_THINKING, stream=True,
    )  # fmt: skip
    events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == deltas and json.loads(deltas)["city"] in ("Paris", "Oslo")
    assert events[-1].type == "response.completed"


def test_text_format_json_schema_is_enforced(responses_stack: Stack) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    response = _client(responses_stack).responses.create(
        model=MODEL, input="Is it?", reasoning=NO_THINKING, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), schema)


def _wait_for(client: openai.OpenAI, response_id: str, statuses: tuple[str, ...]) -> Any:
    deadline = time.monotonic() + 60
    while (response := client.responses.retrieve(response_id)).status not in statuses:
        assert time.monotonic() < deadline, response.status
        time.sleep(0.2)
    return response


def test_a_background_response_is_polled_replayed_and_cancelled(responses_stack: Stack) -> None:
    client = _client(responses_stack)
    queued = client.responses.create(
        model=MODEL, input="hello", background=True, max_output_tokens=10, temperature=0, reasoning=NO_THINKING
    )
    assert queued.status in ("queued", "in_progress") and queued.background
    done = _wait_for(client, queued.id, ("completed", "incomplete"))
    assert done.output_text and done.usage.output_tokens >= 1
    # Its whole stream can be read again, from any point: sequence numbers past `starting_after`.
    replay = list(client.responses.retrieve(queued.id, stream=True, starting_after=2))
    assert replay[0].sequence_number == 3 and replay[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in replay if e.type == "response.output_text.delta") in done.output_text
    # A long one is cancelled; cancelling again answers the same. The worker is held meanwhile:
    # however fast the engine, the response cannot end before the cancel.
    with responses_stack.workers[-1].paused():
        long = client.responses.create(model=MODEL, input="go on", background=True, max_output_tokens=900)
        cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.cancel(long.id).status == "cancelled"
    with pytest.raises(openai.NotFoundError):
        _client(responses_stack, KEY_B).responses.cancel(long.id)


def test_a_background_response_is_kept_after_its_jobs_log_is_gone(responses_stack: Stack) -> None:
    # Never polled while it runs: the API's housekeeper keeps its result, and a poll after the
    # job's own record and log expired (an hour after it ends) still answers it.
    client = _client(responses_stack)
    response = client.responses.create(
        model=MODEL, input="hello", background=True, max_output_tokens=8, temperature=0, reasoning=NO_THINKING
    )
    job_id = response.id.removeprefix("resp_")
    keys = responses_stack.keys
    with redis.Redis.from_url(responses_stack.redis_url) as direct:
        wait_until(lambda: direct.exists(keys.ended_job(job_id)) == 1, "the ended response's result was not kept")
        assert direct.delete(keys.job(job_id), keys.job_event_log(job_id)) == 2
    done = client.responses.retrieve(response.id)
    assert done.status in ("completed", "incomplete") and done.output_text
    assert done.usage is not None and done.usage.output_tokens >= 1


def test_unsupported_requests_are_400s_naming_the_field(responses_stack: Stack) -> None:
    client = _client(responses_stack)
    with pytest.raises(openai.BadRequestError) as unstored:
        client.responses.create(model=MODEL, input="x", background=True, store=False)
    assert unstored.value.body["param"] == "store"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model=MODEL, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]
        )
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_missing")


def test_a_background_response_survives_its_worker_being_killed(responses_stack: Stack) -> None:
    # Last in the module: a second worker joins, and the one that runs the response is killed.
    # The second starts first: a start (seconds, more on a loaded host) would outlast the API's
    # patience with a job whose model has no live worker.
    responses_stack.start_worker(tiny_random_qwen3_dir("qwen3"), MODEL, dtype="float32", max_model_len=1024)
    client = _client(responses_stack)
    request: Any = {
        "model": MODEL, "input": "go on", "max_output_tokens": 400, "temperature": 0, "reasoning": NO_THINKING
    }  # fmt: skip
    undisturbed = client.responses.create(**request)
    response = client.responses.create(**request, background=True)
    job_id = response.id.removeprefix("resp_")
    wait_until(lambda: responses_stack.job_owner(job_id) is not None, "no worker took the response")
    victim = responses_stack.worker_of(job_id)
    victim.popen.send_signal(signal.SIGKILL)
    victim.popen.wait()
    assert responses_stack.job_state(job_id) in ("running", "queued"), "the response ended before the kill"
    done = _wait_for(client, response.id, ("completed", "incomplete", "failed"))
    assert done.status == undisturbed.status, done.error
    assert done.output_text == undisturbed.output_text  # continued from the tokens already sent
