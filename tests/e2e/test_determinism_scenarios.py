"""What ``--deterministic on`` (the default) promises a user of the default model, scenario by
scenario: a request's text (greedy, or sampled with a ``seed``) is the same alone, in a busy
batch, from the prefix cache, after its worker is SIGKILLed mid-stream and another continues
it, and when its worker's torch thread count changes mid-stream because a neighbour on the same
cores turned busy. Each failure message says where the two texts part."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from tests.conftest import make_stack
from tests.support.stack import Process, Stack, wait_until
from worker.service.host_pool import REFRESH_INTERVAL_S
from worker.service.thread_budget import available_cores
from worker.settings import DEFAULT_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

ROME = [{"role": "user", "content": "Write a long, detailed history of the city of Rome."}]
KILL_AT_CHUNK = 20

OnChunk = Callable[[int, ChatCompletionChunk], None]


def _start_default_worker(stack: Stack, default_model_path: Path, **settings: object) -> Process:
    # The worker resolves the default model id itself, from the same conversion cache.
    return stack.start_worker(
        DEFAULT_MODEL, DEFAULT_MODEL, cache_dir=default_model_path.parents[1], max_model_len=2048, **settings
    )


@pytest.fixture(scope="module")
def default_stack(redis_url: str, log_dir: Path, default_model_path: Path) -> Iterator[Stack]:
    """The API and two workers on the default model with default settings (--deterministic on,
    pooled cores), plus --generic-tool-prompt: the default model's template has no tools, and the
    flag changes nothing for a request without them."""
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        for _ in range(2):
            _start_default_worker(stack, default_model_path, generic_tool_prompt=True)
        yield stack
    finally:
        stack.stop()


def _where_they_part(expected: str, got: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), min(len(expected), len(got)))
    return (
        f"the texts part at character {at} (of {len(expected)} expected, {len(got)} got) after "
        f"{expected[max(0, at - 60) : at]!r}: expected {expected[at : at + 60]!r}, got {got[at : at + 60]!r}"
    )


def _first_difference(expected: dict[str, str], got: dict[str, str]) -> str:
    for key in sorted(expected.keys() | got.keys()):
        if expected.get(key) != got.get(key):
            return f"{key}: {_where_they_part(expected.get(key, ''), got.get(key, ''))}"
    return "no difference"


def _stream(client: openai.OpenAI, body: dict[str, Any], on_chunk: OnChunk | None = None) -> dict[str, str]:
    """What the client sees of one streamed chat completion, by choice: its content, the
    arguments of its tool calls and its finish reason. ``on_chunk(n, chunk)`` after each chunk."""
    seen: dict[str, str] = {}
    count = 0
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        for choice in chunk.choices:
            prefix = f"choice {choice.index}"
            if choice.delta.content:
                seen[f"{prefix} content"] = seen.get(f"{prefix} content", "") + choice.delta.content
            for call in choice.delta.tool_calls or []:
                key = f"{prefix} tool call {call.index}"
                if call.function is not None and call.function.name:
                    seen[f"{key} name"] = call.function.name
                if call.function is not None and call.function.arguments:
                    seen[f"{key} arguments"] = seen.get(f"{key} arguments", "") + call.function.arguments
            if choice.finish_reason is not None:
                seen[f"{prefix} finish_reason"] = choice.finish_reason
        count += 1
        if on_chunk is not None:
            on_chunk(count, chunk)
    return seen


def test_a_cached_seeded_prompt_batched_with_seven_new_ones_gives_its_text_alone(default_stack: Stack) -> None:
    """A user sends a sampled request with a seed once, then again at the same moment as seven
    other users send new prompts (one long enough to be prefilled in several chunks): the second
    time its prompt comes from the prefix cache and it decodes in a batch of eight while the
    others prefill beside it. The user gets the same text both times."""
    client = default_stack.client()
    cached = {
        "model": DEFAULT_MODEL,
        "messages": [
            {
                "role": "user",
                "content": "I am planning a week-long walking holiday in the hills of Tuscany in late spring. "
                "Describe, day by day, the villages I should see, the food I should try and what I should pack.",
            }
        ],
        "temperature": 1,
        "seed": 1234,
        "max_tokens": 64,
        "extra_body": {"ignore_eos": True},
    }
    long_prompt = "Summarise this text in two sentences. " + " ".join(
        f"In year {1800 + i} the harbour town built a new pier, and the fishing fleet grew by {i} boats."
        for i in range(40)
    )  # ~1,000 tokens: four chunks of the 256-token prefill budget
    prompts = [
        long_prompt,
        "List five uses of a paperclip.",
        "Explain photosynthesis to a ten-year-old.",
        "Write a limerick about a cat who learns to play the violin.",
        "What should I consider when buying a second-hand bicycle?",
        "Translate 'good morning, how are you?' into French, Spanish and German.",
        "Give me a recipe for a simple tomato soup.",
    ]
    others = [
        {
            "model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 64,
            **({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": 500 + i}),
        }
        for i, prompt in enumerate(prompts)
    ]

    def complete(body: dict[str, Any]) -> tuple[str, int]:
        reply = client.chat.completions.create(**body)
        details = reply.usage.prompt_tokens_details if reply.usage else None
        return reply.choices[0].message.content or "", (details.cached_tokens or 0) if details else 0

    alone, _ = complete(cached)
    with ThreadPoolExecutor(1 + len(others)) as pool:
        (together, num_cached), *_ = pool.map(complete, [cached, *others])
    assert num_cached > 0, "the second time, the prompt should come from the prefix cache"
    assert together == alone, _where_they_part(alone, together)


@pytest.fixture
def two_live_workers(default_stack: Stack, default_model_path: Path) -> Stack:
    """The module's stack with two running workers: a kill test leaves one, so the next one
    starts a fresh worker beside it (default settings, as the fixture's)."""
    if sum(worker.is_running() for worker in default_stack.workers) < 2:
        _start_default_worker(default_stack, default_model_path, generic_tool_prompt=True)
    return default_stack


# Bounded so that an answer under the schema ends (finish_reason "stop") within 160 tokens.
HISTORY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "periods": {
            "type": "array",
            "minItems": 3,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "events": {"type": "string", "maxLength": 80},
                },
                "required": ["name", "events"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["city", "periods"],
    "additionalProperties": False,
}
HISTORY_TOOL = {
    "type": "function",
    "function": {
        "name": "save_city_history",
        "description": "Save a history of a city, period by period.",
        "parameters": HISTORY_SCHEMA,
    },
}
FAILOVER_CASES = [
    pytest.param({"temperature": 0, "max_tokens": 160, "extra_body": {"ignore_eos": True}}, id="rome-greedy"),
    pytest.param(
        {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 160, "extra_body": {"ignore_eos": True}},
        id="rome-seeded-top-p",
    ),
    pytest.param(
        {
            "temperature": 0.7,
            "seed": 1234,
            "max_tokens": 160,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "city_history", "schema": HISTORY_SCHEMA, "strict": True},
            },
        },
        id="json-schema-seeded",
    ),
    pytest.param(
        {"n": 2, "temperature": 0.8, "seed": 1234, "max_tokens": 100, "extra_body": {"ignore_eos": True}},
        id="n2-seeded",
    ),
    pytest.param(
        {
            "temperature": 0,
            "max_tokens": 160,
            "tools": [HISTORY_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "save_city_history"}},
        },
        id="forced-tool-call-greedy",
    ),
]


@pytest.mark.parametrize("settings", FAILOVER_CASES)
def test_a_killed_workers_stream_continues_as_the_undisturbed_one(
    two_live_workers: Stack, settings: dict[str, Any]
) -> None:
    """A user streams a long answer about Rome (greedy or seeded; as JSON under a schema; two
    choices at once; or as a forced tool call); after ~20 chunks the serving worker is SIGKILLed
    and the other continues the job from the tokens already sent. Every choice's content,
    tool-call arguments and finish reason are what the undisturbed stream gave."""
    stack = two_live_workers
    client = stack.client()
    body = {"model": DEFAULT_MODEL, "messages": ROME, **settings}
    expected = _stream(client, body)
    killed: list[Process] = []
    cut_short: list[bool] = []

    def kill_the_serving_worker(count: int, chunk: ChatCompletionChunk) -> None:
        if count == KILL_AT_CHUNK:
            victim = stack.worker_of(chunk.id)
            victim.popen.send_signal(signal.SIGKILL)
            killed.append(victim)
            victim.popen.wait(timeout=10)
            cut_short.append(stack.job_state(chunk.id) in ("running", "queued"))  # a dead worker ends nothing

    got = _stream(client, body, kill_the_serving_worker)
    assert killed and killed[0].popen.wait(timeout=10) == -signal.SIGKILL, "the stream ended before the kill"
    assert cut_short == [True], "the job ended before the kill"
    assert got == expected, _first_difference(expected, got)


# Thread count changed mid-stream: two workers of the default model pool the host's cores (no
# --num-threads). The older, A, takes jobs at once; the younger, B, takes a job only once it has
# waited SPILL_WAIT_S (A full, busy elsewhere or dead). A is given one slot, so a second request
# sent while A streams waits and B takes it: B turns busy, and A drops from all the cores' threads
# to half of them at its next registry read (worker/service/host_pool.py), mid-stream.
_THREADS = re.compile(r"torch threads: (\d+)")


def _thread_counts(worker: Process) -> list[int]:
    """Each torch thread count the worker's host pool applied, in order (its log)."""
    return [int(n) for n in _THREADS.findall(worker.log())]


def _picked(worker: Process) -> int:
    return worker.log().count("event=picked")


def _num_jobs(stack: Stack, worker: Process) -> int:
    info = stack.worker_info(f"{stack.key_prefix}-worker{stack.workers.index(worker)}")
    return info.num_jobs if info is not None else 0


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture(scope="module")
def pooled_pair(redis_url: str, log_dir: Path, default_model_path: Path) -> Iterator[Stack]:
    """The API, worker A (default settings but one slot) and, younger, worker B (defaults), both
    on the default model and sizing their own threads on the same cores."""
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        _start_default_worker(stack, default_model_path, max_num_seqs=1)
        younger = _start_default_worker(stack, default_model_path)
        _wait_for(lambda: "(rank 1 on its cores)" in younger.log(), "B never saw A as the older worker")
        yield stack
    finally:
        stack.stop()


@pytest.mark.skipif(available_cores() < 2, reason="one core: a worker's thread count never changes")
@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234}], ids=["greedy", "seeded"]
)
def test_a_streams_text_is_the_same_when_its_worker_drops_to_fewer_threads_mid_stream(
    pooled_pair: Stack, sampling: dict[str, Any]
) -> None:
    """A user streams an answer from worker A while A has the host's cores to itself; then
    streams the same request again, and mid-stream another user's long request lands on B, a
    worker of the same model on the same cores: A goes from all the cores' threads to half of
    them for the rest of the stream (its log says so). The user gets the same text both times."""
    a, b = pooled_pair.workers
    cores = available_cores()
    client = pooled_pair.client()
    body = {"model": DEFAULT_MODEL, "messages": ROME, "max_tokens": 160, "extra_body": {"ignore_eos": True}, **sampling}
    neighbour_body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "max_tokens": 160,
        "extra_body": {"ignore_eos": True},
    }
    # B is idle (an earlier case's neighbour request has ended): A runs on every core again.
    _wait_for(lambda: _thread_counts(a)[-1:] == [cores], f"A never went back to {cores} threads:\n{a.log()}")
    picked_a, picked_b, changes = _picked(a), _picked(b), len(_thread_counts(a))
    alone = _stream(client, body)
    assert (_picked(a), _picked(b)) == (picked_a + 1, picked_b), "A alone should have served the first stream"
    assert len(_thread_counts(a)) == changes, "A's thread count changed while it streamed alone"

    dropped_at: list[int] = []
    with ThreadPoolExecutor(1) as pool:
        neighbour: list[Future[Any]] = []

        def load_b_then_watch_a(count: int, _chunk: ChatCompletionChunk) -> None:
            if count == 10:
                # A is held until B has taken the neighbour's request and its registry record
                # says so, and past A's registry refresh period: A reads that B is busy as soon
                # as it continues, with most of its stream still to come, however fast the engine.
                with a.paused():
                    held_at = time.monotonic()
                    neighbour.append(pool.submit(client.chat.completions.create, **neighbour_body))
                    wait_until(lambda: _picked(b) == picked_b + 1, "B never took the neighbour's request")
                    wait_until(lambda: _num_jobs(pooled_pair, b) > 0, "B's registry record never said it was busy")
                    time.sleep(max(0.0, held_at + REFRESH_INTERVAL_S - time.monotonic()))
            elif count > 10 and not dropped_at and cores // 2 in _thread_counts(a)[changes:]:
                dropped_at.append(count)

        disturbed = _stream(client, body, load_b_then_watch_a)
        neighbour[0].result(timeout=120)
    assert _picked(b) == picked_b + 1, "B should have taken the neighbour's request"
    assert dropped_at, f"A's thread count did not drop to {cores // 2} during the stream:\n{a.log()[-3000:]}"
    assert disturbed == alone, f"(A dropped to {cores // 2} threads at chunk {dropped_at[0]}) " + _first_difference(
        alone, disturbed
    )
