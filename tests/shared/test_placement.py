"""Placement by prefix: the keys (pure, property-tested) and the claim against a real Redis, with
workers' heartbeat records written as workers write them."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import Redis

from shared.contract import ChatJob, CompletionJob, Generate, Message, Tool
from shared.job_lifecycle import Claim, JobLifecycle, NotYet
from shared.placement import MAX_KEYS, TEXT_BLOCK_CHARS, TOKEN_BLOCK, prefix_keys
from shared.redis_keys import PLACEMENT_BALANCE_SLACK, WORKER_HEARTBEAT_TTL_S, RedisKeys
from shared.registry import WorkerInfo, WorkerState

MODEL = "m"
WINDOW_S = 0.5

# -- the keys -------------------------------------------------------------------------------------

_texts = st.text(max_size=40)
_messages = st.lists(
    st.builds(Message, role=st.sampled_from(["user", "assistant"]), content=_texts), min_size=1, max_size=12
)


def _chat(messages: list[Message], tools: list[Tool] | None = None, model: str = MODEL) -> ChatJob:
    return ChatJob(job_id="j", created=0, request=Generate(model=model, messages=messages, tools=tools or []))


@given(_messages, _messages)
def test_a_follow_up_holds_every_key_of_the_turn_before_it(earlier: list[Message], later: list[Message]) -> None:
    before = prefix_keys(_chat(earlier))
    after = prefix_keys(_chat([*earlier, *later]))
    assert before == prefix_keys(_chat(list(earlier)))  # the same conversation, the same keys
    assert len(before) == min(len(earlier), MAX_KEYS)
    if len(earlier) + len(later) <= MAX_KEYS:
        assert after[: len(before)] == before
    else:
        assert after[0] == before[0]


@given(_messages, st.data())
def test_an_edited_message_changes_its_key_and_every_later_one(messages: list[Message], data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(messages) - 1))
    edited = list(messages)
    edited[index] = messages[index].model_copy(update={"content": messages[index].content + "!"})
    original, changed = prefix_keys(_chat(messages)), prefix_keys(_chat(edited))
    if len(messages) <= MAX_KEYS:
        assert original[:index] == changed[:index]
        assert all(a != b for a, b in zip(original[index:], changed[index:], strict=True))


def test_the_keys_cover_what_precedes_the_messages() -> None:
    messages = [Message(role="user", content="hi")]
    tool = Tool(name="f", parameters={"type": "object"})
    assert prefix_keys(_chat(messages)) != prefix_keys(_chat(messages, [tool]))
    assert prefix_keys(_chat(messages)) != prefix_keys(_chat(messages, model="other"))
    assert prefix_keys(_completion([""])) == []


def _completion(prompts: list[str] | list[list[int]], adapter: str | None = None) -> CompletionJob:
    return CompletionJob(job_id="c", created=0, request=Generate(model=MODEL, prompts=prompts, adapter=adapter))


@given(st.text(max_size=5000), st.text(min_size=1, max_size=3000))
def test_a_completion_prompt_that_extends_another_holds_the_keys_of_its_whole_blocks(earlier: str, more: str) -> None:
    before, after = prefix_keys(_completion([earlier])), prefix_keys(_completion([earlier + more]))
    whole = len(earlier) // TEXT_BLOCK_CHARS  # the earlier prompt's blocks that the longer one has whole
    assert len(before) == -(-len(earlier) // TEXT_BLOCK_CHARS)
    assert before[:whole] == after[:whole]
    if len(earlier) % TEXT_BLOCK_CHARS:  # its last, partial block is not the longer prompt's
        assert before[whole] not in after
    assert prefix_keys(_completion([earlier + more, "another prompt"])) == after  # the first prompt's keys


def test_completion_keys_name_the_model_the_adapter_and_the_prompts_kind() -> None:
    text = "x" * (3 * TEXT_BLOCK_CHARS)
    keys = prefix_keys(_completion([text]))
    assert len(keys) == 3
    assert set(keys).isdisjoint(prefix_keys(_completion([text], adapter="a")))
    assert prefix_keys(_completion([text], adapter="a"))[1].startswith("~")  # the adapter's key, then the blocks
    ids = list(range(2 * TOKEN_BLOCK + 1))
    assert len(prefix_keys(_completion([ids]))) == 3
    assert prefix_keys(_completion([ids[:TOKEN_BLOCK]]))[0] == prefix_keys(_completion([ids]))[0]
    chat = prefix_keys(_chat([Message(role="user", content=text)]))
    assert set(chat).isdisjoint(keys)


@given(_messages, st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3))
def test_affinity_names_add_keys_after_the_first_message_and_change_no_other(
    messages: list[Message], names: list[str]
) -> None:
    plain = prefix_keys(_chat(messages))
    named = prefix_keys(_chat(messages).model_copy(update={"affinity": tuple(names)}))
    assert len(named) <= MAX_KEYS
    assert named[0] == plain[0]
    if len(messages) + len(names) <= MAX_KEYS:
        assert named[1 + len(names) :] == plain[1:]
    other = prefix_keys(_chat([Message(role="user", content="another")]).model_copy(update={"affinity": (names[0],)}))
    assert other[1] == named[1]  # one name, one key, whatever the messages


def test_an_affinity_name_is_the_tenants_own() -> None:
    job = _chat([Message(role="user", content="hi")]).model_copy(update={"affinity": ("user:alice",)})
    assert prefix_keys(job)[1] != prefix_keys(job.model_copy(update={"tenant": "other-key"}))[1]


# -- the claim ------------------------------------------------------------------------------------


@dataclass
class Env:
    redis: Redis
    keys: RedisKeys
    lifecycle: JobLifecycle

    @property
    def queue(self) -> str:
        return self.keys.queue(MODEL)

    async def heartbeat(self, worker_id: str, state: WorkerState = "ready", num_jobs: int = 0) -> None:
        info = WorkerInfo(
            worker_id=worker_id, instance=f"{worker_id}-i", model=MODEL, state=state, host="h", pid=1,
            started_at=0, heartbeat_at=time.time(), max_num_seqs=2, num_jobs=num_jobs,
        )  # fmt: skip
        await self.redis.set(self.keys.worker(worker_id), info.model_dump_json(), ex=WORKER_HEARTBEAT_TTL_S)
        await self.redis.sadd(self.keys.model_workers(MODEL), worker_id)

    async def create(self, job_id: str, keys: list[str], window_s: float = WINDOW_S) -> str | None:
        return await self.lifecycle.create(
            job_id, b"{}", MODEL, self.queue, prefix_keys=keys, placement_window_s=window_s
        )

    async def claim(self, worker_id: str) -> Claim | NotYet | None:
        return await self.lifecycle.claim(self.queue, worker_id, f"{worker_id}-i")

    async def served(self, worker_id: str, job_id: str, keys: list[str]) -> None:
        """``worker_id`` claimed a job of that conversation (and so holds its keys)."""
        await self.create(job_id, keys, window_s=0)
        claim = await self.claim(worker_id)
        assert isinstance(claim, Claim) and claim.job_id == job_id


@pytest.fixture
async def env(redis_url: str) -> AsyncIterator[Env]:
    """Two live ready workers, ``a`` and ``b``, of the model."""
    client = Redis.from_url(redis_url)
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    env = Env(client, keys, JobLifecycle(client, keys))
    try:
        await env.heartbeat("a")
        await env.heartbeat("b")
        yield env
    finally:
        await client.aclose()


@pytest.fixture
async def placed(env: Env) -> Env:
    """``turn2`` queued, placed on ``a``, which claimed the conversation's first turn."""
    await env.served("a", "turn1", ["s0", "s1"])
    assert await env.create("turn2", ["s0", "s1", "s2"]) == "a"
    return env


async def test_a_follow_up_is_left_to_the_worker_that_holds_its_conversation(env: Env) -> None:
    await env.served("a", "turn1", ["s", "s1"])
    assert await env.create("turn2", ["s", "s1", "s1a", "s2"]) == "a"
    waiting = await env.claim("b")
    assert isinstance(waiting, NotYet) and 0 < waiting.ready_in_s <= WINDOW_S
    claim = await env.claim("a")
    assert isinstance(claim, Claim) and claim.job_id == "turn2"
    assert await env.lifecycle.placement_spills() == {}


async def test_another_worker_takes_it_once_the_window_ends(placed: Env) -> None:
    env = placed
    started = time.monotonic()
    claim = await env.claim("b")
    while isinstance(claim, NotYet):
        await asyncio.sleep(claim.ready_in_s)
        claim = await env.claim("b")
    assert isinstance(claim, Claim) and claim.job_id == "turn2"
    assert WINDOW_S * 0.9 <= time.monotonic() - started < WINDOW_S + 1.0
    assert await env.lifecycle.placement_spills() == {MODEL: 1}


@pytest.mark.parametrize("preferred", ["dead", "draining", "full"])
async def test_a_preferred_worker_that_cannot_take_it_holds_nothing_back(placed: Env, preferred: str) -> None:
    env = placed
    if preferred == "dead":
        await env.redis.delete(env.keys.worker("a"))
    else:
        await env.heartbeat("a", state="draining" if preferred == "draining" else "ready", num_jobs=2)
    claim = await env.claim("b")
    assert isinstance(claim, Claim) and claim.job_id == "turn2"
    assert await env.lifecycle.placement_spills() == {MODEL: 1}


async def test_no_placement_where_no_live_worker_or_every_one_holds_the_prefix(env: Env) -> None:
    assert await env.create("fresh", ["x1"]) is None  # nobody holds it
    assert isinstance(await env.claim("b"), Claim)
    await env.served("a", "p1", ["sys", "u1"])
    await env.served("b", "p2", ["sys", "u2"])
    assert await env.create("shared", ["sys", "u3"]) is None  # both hold the system prompt
    await env.heartbeat("a", state="draining")
    assert await env.create("after", ["sys", "u1", "u4"]) is None  # its holder drains: no new placement
    await env.heartbeat("a")
    assert await env.create("again", ["sys", "u1", "u5"]) == "a"


async def test_a_burst_of_one_message_requests_places_nothing(env: Env) -> None:
    await env.served("b", "burst1", ["one"])
    assert await env.create("burst2", ["one"]) is None


async def test_a_busy_holder_is_passed_over_for_an_idle_worker(env: Env) -> None:
    await env.served("a", "turn1", ["s0", "s1"])
    info = WorkerInfo.model_validate_json(await env.redis.get(env.keys.worker("a")) or b"")
    busy = info.model_copy(update={"num_jobs": PLACEMENT_BALANCE_SLACK + 1, "max_num_seqs": 64})
    await env.redis.set(env.keys.worker("a"), busy.model_dump_json(), ex=WORKER_HEARTBEAT_TTL_S)
    assert await env.create("turn2", ["s0", "s1", "s2"]) is None


async def test_a_worker_behind_a_placed_job_takes_the_next_one(placed: Env) -> None:
    env = placed
    await env.lifecycle.create("plain", b"{}", MODEL, env.queue)  # an older API's job: no placement
    claim = await env.claim("b")
    assert isinstance(claim, Claim) and claim.job_id == "plain"
    assert await env.lifecycle.queued_job_ids(env.queue) == ["turn2"]


async def test_a_restarted_worker_holds_nothing_of_its_earlier_process(env: Env) -> None:
    await env.served("a", "turn1", ["s0", "s1"])
    info = WorkerInfo(
        worker_id="a", instance="a-new", model=MODEL, state="ready", host="h", pid=2, started_at=0,
        heartbeat_at=time.time(), max_num_seqs=2,
    )  # fmt: skip
    await env.redis.set(env.keys.worker("a"), info.model_dump_json(), ex=WORKER_HEARTBEAT_TTL_S)
    assert await env.create("turn2", ["s0", "s1", "s2"]) is None


async def test_a_job_handed_back_is_any_workers(placed: Env) -> None:
    env = placed
    claim = await env.claim("a")
    assert isinstance(claim, Claim)
    assert await env.lifecycle.requeue("turn2", claim.epoch)  # a worker that could not run it hands it back
    taken = await env.claim("b")
    assert isinstance(taken, Claim) and taken.job_id == "turn2"


async def test_a_released_key_places_nothing_unless_a_later_claim_named_it_again(env: Env) -> None:
    await env.served("a", "turn1", ["s0", "s1"])
    await env.served("a", "other1", ["o0", "o1"])
    first = await env.claim("a")  # nothing queued: the claims above are the ones that count
    assert first is None
    held = env.keys.worker_held_keys("a", "a-i")
    scores = {key.decode(): int(score) for key, score in await env.redis.zrange(held, 0, -1, withscores=True)}
    # Its cache let turn 1 go; the other conversation's key "o1" was claimed again since.
    await env.lifecycle.release_prefix_keys("a", "a-i", [("s0", scores["s0"]), ("s1", scores["s1"])])
    await env.lifecycle.release_prefix_keys("a", "a-i", [("o1", scores["o1"] - 1)])
    assert sorted(key.decode() for key in await env.redis.zrange(held, 0, -1)) == ["o0", "o1"]
    assert await env.create("turn2", ["s0", "s1", "s2"]) is None
    assert await env.create("other2", ["o0", "o1", "o2"]) == "a"


async def test_a_claim_names_the_keys_it_recorded(env: Env) -> None:
    await env.create("turn1", ["s0", "s1"], window_s=0)
    claim = await env.claim("a")
    assert isinstance(claim, Claim) and claim.prefix_keys == ("s0", "s1")
    held = env.keys.worker_held_keys("a", "a-i")
    assert await env.redis.zscore(held, "s1") == claim.claimed_ms


async def test_a_one_message_turn_is_placed_on_the_worker_its_affinity_name_ran_on(env: Env) -> None:
    await env.served("b", "first", ["m1", "name"])
    assert await env.create("second", ["m2", "name"]) == "b"  # another first message, the same name
    assert await env.create("unnamed", ["m3"]) is None


async def test_queued_prefill_tokens_add_up_the_estimates_of_the_queued_jobs(env: Env) -> None:
    for index, tokens in enumerate((100, 250, 50)):
        await env.lifecycle.create(f"q{index}", b"{}", MODEL, env.queue, prefill_tokens=tokens)
    assert await env.lifecycle.queued_prefill_tokens(env.queue) == 400
    assert await env.lifecycle.queued_prefill_tokens(env.queue, sample=2) == round(350 * 3 / 2)
    assert isinstance(await env.claim("a"), Claim)
    assert await env.lifecycle.queued_prefill_tokens(env.queue) == 300
    assert await env.lifecycle.queued_prefill_tokens(env.keys.batch_queue(MODEL)) == 0
