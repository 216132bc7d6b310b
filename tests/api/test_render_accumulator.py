"""The accumulator every renderer reads: events in, per-choice state and deltas out. Whole and
streamed must agree, so the property tests split the same output into arbitrary deltas and check
that the final state does not depend on where the splits fall."""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.render.accumulator import JobFailed, JobResult, collect, follow
from api.render.chat import collect_completion
from api.render.events import EventReplay
from api.render.responses import ResponseBuilder, collect_response, response_events
from api.wire.responses import ResponsesRequest
from shared.contract import ChatJob, Generate, Message, Sampling
from shared.errors import ErrorKind
from shared.events import (
    AnyEvent,
    DeltaEvent,
    EmbeddingsEvent,
    EndEvent,
    ErrorEvent,
    StartEvent,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    UsageCounts,
)


def _job(n: int = 1) -> ChatJob:
    request = Generate(model="m", messages=[Message(role="user", content="x")], sampling=Sampling(n=n))
    return ChatJob(job_id="chatcmpl-t", created=1, request=request)


class _Replay(EventReplay):
    """A replay that counts how often it was closed."""

    num_closes = 0

    async def close(self) -> None:
        self.num_closes += 1


def _numbered(*events: Any) -> list[AnyEvent]:
    """Events numbered in order, as a job's stream numbers them."""
    return [event.model_copy(update={"seq": seq}) for seq, event in enumerate(events)]


def _delta(**fields: Any) -> DeltaEvent:
    return DeltaEvent(seq=0, **fields)


def _end(prompt_tokens: int = 3, completion_tokens: int = 2, cached_tokens: int = 0) -> EndEvent:
    usage = UsageCounts(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens)
    return EndEvent(seq=0, usage=usage)


def _apply_all(result: JobResult, events: list[AnyEvent]) -> None:
    for event in events:
        result.apply(event)


def test_interleaved_choices_keep_their_own_text_and_finish() -> None:
    result = JobResult(num_choices=2)
    _apply_all(
        result,
        _numbered(
            StartEvent(seq=0, worker_id="w", prompt_tokens=4),
            _delta(index=1, content="B1", token_ids=[7]),
            _delta(index=0, content="A1", token_ids=[5]),
            _delta(index=1, content="B2", token_ids=[8], finish_reason="length"),
            _delta(index=0, content="A2", token_ids=[6], finish_reason="stop", stop_reason="END"),
            _end(prompt_tokens=4, completion_tokens=4, cached_tokens=1),
        ),
    )
    first, second = result.choices
    assert (first.content, first.token_ids, first.finish_reason, first.stop_reason) == ("A1A2", [5, 6], "stop", "END")
    assert (second.content, second.token_ids, second.finish_reason, second.stop_reason) == (
        "B1B2",
        [7, 8],
        "length",
        None,
    )
    assert (result.num_prompt_tokens, result.num_completion_tokens, result.num_cached_tokens) == (4, 4, 1)


def test_a_delta_reports_what_it_added_and_whether_it_was_the_first() -> None:
    result = JobResult(num_choices=2)
    first = result.apply(_delta(index=1, content="Hi", reasoning="hm", token_ids=[1]))
    second = result.apply(_delta(index=1, content=None, finish_reason="stop", stop_reason=2))
    assert first is not None and second is not None
    assert (first.index, first.content, first.reasoning, first.token_ids, first.is_first) == (1, "Hi", "hm", [1], True)
    assert (second.content, second.finish_reason, second.stop_reason, second.is_first) == (None, "stop", 2, False)
    assert result.choices[0].num_deltas == 0


def test_start_and_end_events_give_the_prompt_size_and_usage() -> None:
    result = JobResult(prompt_tokens=9)  # read before the result was made
    assert (result.num_prompt_tokens, result.num_completion_tokens, result.usage) == (9, 0, None)
    assert result.apply(StartEvent(seq=0, worker_id="w", prompt_tokens=5)) is None
    assert result.num_prompt_tokens == 5
    result.apply(_end(prompt_tokens=6, completion_tokens=1))
    assert result.usage is not None and (result.num_prompt_tokens, result.num_completion_tokens) == (6, 1)


def test_tool_calls_assemble_by_index() -> None:
    result = JobResult()
    _apply_all(
        result,
        [
            _delta(tool_calls=[ToolCallDelta(index=0, id="c0", name="get", arguments="")]),
            _delta(
                tool_calls=[ToolCallDelta(index=0, arguments='{"a": '), ToolCallDelta(index=1, id="c1", name="put")]
            ),
            _delta(tool_calls=[ToolCallDelta(index=1, arguments="{}"), ToolCallDelta(index=0, arguments="1}")]),
        ],
    )
    calls = result.choices[0].tool_calls
    assert [(i, c.id, c.name, c.arguments) for i, c in sorted(calls.items())] == [
        (0, "c0", "get", '{"a": 1}'),
        (1, "c1", "put", "{}"),
    ]


def test_output_items_follow_the_order_the_output_opened() -> None:
    result = JobResult()
    updates = []
    for event in [
        _delta(reasoning="think"),
        _delta(reasoning="ing", content="Sure."),
        _delta(tool_calls=[ToolCallDelta(index=0, id="c0", name="f", arguments='{"x"')]),
        _delta(content=" ", tool_calls=[ToolCallDelta(index=0, arguments=": 1}")]),
    ]:
        added = result.apply(event)
        assert added is not None
        updates += added.items
    items = result.choices[0].items
    assert [(i.kind, i.text) for i in items] == [
        ("reasoning", "thinking"),
        ("text", "Sure."),
        ("tool_call", '{"x": 1}'),
        ("text", " "),
    ]
    assert (items[2].call_id, items[2].call_index, items[2].name) == ("c0", 0, "f")
    assert [(u.position, u.is_new, u.text, u.closed_text) for u in updates] == [
        (0, True, "think", None),
        (0, False, "ing", None),
        (1, True, "Sure.", "thinking"),
        (2, True, '{"x"', "Sure."),
        # The call ended as the text opened; its last argument text still belongs to it.
        (3, True, " ", '{"x"'),
        (2, False, ": 1}", None),
    ]


def test_a_fragment_with_a_new_id_opens_a_new_item_for_its_index() -> None:
    result = JobResult()
    _apply_all(
        result,
        [
            _delta(tool_calls=[ToolCallDelta(index=0, id="a", name="f", arguments="1")]),
            _delta(tool_calls=[ToolCallDelta(index=0, id="b", name="g", arguments="2")]),
            _delta(tool_calls=[ToolCallDelta(index=0, arguments="3")]),
        ],
    )
    choice = result.choices[0]
    assert [(i.call_id, i.name, i.text) for i in choice.items] == [("a", "f", "1"), ("b", "g", "23")]
    assert (choice.tool_calls[0].id, choice.tool_calls[0].name, choice.tool_calls[0].arguments) == ("b", "g", "123")


def test_logprobs_carry_each_tokens_offset_in_the_content() -> None:
    result = JobResult()
    assert result.choices[0].logprobs is None
    top = [TopLogprob(token="x", logprob=-2.0)]
    first = result.apply(
        _delta(
            content="Hello",
            logprobs=[TokenLogprob(token="Hel", logprob=-0.5, top=top), TokenLogprob(token="lo", logprob=-0.1)],
        )
    )
    result.apply(_delta(content=" there"))  # no logprobs: the offsets still move on
    last = result.apply(_delta(content="!", logprobs=[TokenLogprob(token="!", logprob=-0.2)]))
    assert first is not None and last is not None
    assert (first.logprob_offsets, last.logprob_offsets) == ([0, 3], [11])
    choice = result.choices[0]
    assert choice.logprobs is not None and [e.token for e in choice.logprobs] == ["Hel", "lo", "!"]
    assert choice.logprob_offsets == [0, 3, 11]


def test_an_empty_logprobs_list_adds_none() -> None:
    result = JobResult()
    result.apply(_delta(content="a", logprobs=[]))
    assert result.choices[0].logprobs is None


def test_a_delta_for_a_choice_beyond_the_expected_adds_it() -> None:
    result = JobResult(num_choices=1)
    result.apply(_delta(index=2, content="c"))
    assert [c.content for c in result.choices] == ["", "", "c"]


def test_embeddings_are_kept() -> None:
    result = JobResult(num_choices=0)
    assert result.apply(EmbeddingsEvent(seq=1, vectors=[[0.5, 1.0]])) is None
    assert result.embeddings == [[0.5, 1.0]]


def test_an_error_event_is_kept_and_raised_with_its_seq() -> None:
    result = JobResult()
    result.apply(_delta(content="partial"))
    with pytest.raises(JobFailed) as raised:
        result.apply(ErrorEvent(seq=4, kind=ErrorKind.CONTEXT_LENGTH_EXCEEDED, message="too long", param="messages"))
    error = raised.value
    assert result.error is error
    assert (error.seq, error.kind, error.message, error.param) == (
        4,
        ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        "too long",
        "messages",
    )
    assert result.choices[0].content == "partial"


async def test_follow_yields_each_event_with_its_delta_and_leaves_the_stream_open() -> None:
    events = _numbered(StartEvent(seq=0, worker_id="w", prompt_tokens=2), _delta(content="a"), _end())
    replay = _Replay(_job(), events)
    result = JobResult()
    seen = [(event.type, delta is not None) async for event, delta in follow(replay, result)]
    assert seen == [("start", False), ("delta", True), ("end", False)]
    assert replay.num_closes == 0 and result.choices[0].content == "a"


async def test_follow_raises_the_error_event() -> None:
    events = _numbered(_delta(content="a"), ErrorEvent(seq=0, kind=ErrorKind.INTERNAL, message="boom"))
    with pytest.raises(JobFailed) as raised:
        async for _ in follow(_Replay(_job(), events), JobResult()):
            pass
    assert (raised.value.seq, raised.value.to_body()["error"]["message"]) == (1, "boom")


async def test_collect_closes_the_stream_however_it_ends() -> None:
    finished = _Replay(_job(), _numbered(_delta(content="ok"), _end()))
    assert (await collect(finished, JobResult())).choices[0].content == "ok"
    failed = _Replay(_job(), _numbered(ErrorEvent(seq=0, kind=ErrorKind.INTERNAL, message="boom")))
    with pytest.raises(JobFailed):
        await collect(failed, JobResult())
    assert (finished.num_closes, failed.num_closes) == (1, 1)


async def test_chat_renders_the_results_choices() -> None:
    events = _numbered(
        _delta(index=0, reasoning="r", content="Hi", finish_reason="stop"),
        _delta(
            index=1, tool_calls=[ToolCallDelta(index=0, id="c", name="f", arguments="{}")], finish_reason="tool_calls"
        ),
        _end(),
    )
    completion = await collect_completion(EventReplay(_job(n=2), events), "reasoning_content")
    first, second = completion.model_dump(mode="json")["choices"]
    assert first["message"] == {"role": "assistant", "content": "Hi", "reasoning_content": "r"}
    assert second["message"]["content"] is None
    assert second["message"]["tool_calls"] == [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]


async def test_a_responses_stream_ends_an_item_with_its_text_as_the_next_one_opens() -> None:
    """The call's last argument text came with the text that ended it: ``done`` already went out
    without it, and the final response has all of it."""
    events = _numbered(
        _delta(tool_calls=[ToolCallDelta(index=0, id="c", name="f", arguments='{"a"')]),
        _delta(content="x", tool_calls=[ToolCallDelta(index=0, arguments=": 1}")], finish_reason="stop"),
        _end(),
    )
    body = ResponsesRequest(model="m", input="hi")
    finals: list[dict[str, Any]] = []

    async def keep(final: dict[str, Any]) -> None:
        finals.append(final)

    sent = [
        json.loads(e["data"])
        async for e in response_events(EventReplay(_job(), events), ResponseBuilder(body, "j"), keep)
    ]
    done = next(e for e in sent if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == '{"a"'
    [final] = finals
    assert final["output"][0]["arguments"] == '{"a": 1}'
    collected = await collect_response(EventReplay(_job(), events), ResponseBuilder(body, "j"))
    assert collected["output"] == final["output"]


# -- whole and streamed agree --------------------------------------------------------------------


@st.composite
def _splits(draw: st.DrawFn, text: str) -> list[str]:
    """``text`` cut at arbitrary places (empty pieces included)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in pairwise(bounds)]


_TEXT = st.text(alphabet="ab é😀\n", max_size=30)


@given(st.data(), _TEXT, _TEXT)
def test_the_final_text_does_not_depend_on_how_it_was_split(data: st.DataObject, content: str, reasoning: str) -> None:
    whole = JobResult()
    whole.apply(_delta(reasoning=reasoning, content=content))
    split = JobResult()
    for piece in data.draw(_splits(reasoning)):
        split.apply(_delta(reasoning=piece))
    for piece in data.draw(_splits(content)):
        split.apply(_delta(content=piece))
    for result in (whole, split):
        choice = result.choices[0]
        assert (choice.content, choice.reasoning, choice.num_content_chars) == (content, reasoning, len(content))
        assert [(i.kind, i.text) for i in choice.items] == [(i.kind, i.text) for i in whole.choices[0].items]


@given(st.data(), st.lists(st.text(alphabet='{}":a1 ', max_size=12), min_size=1, max_size=3))
def test_tool_call_arguments_do_not_depend_on_how_they_were_split(data: st.DataObject, arguments: list[str]) -> None:
    result = JobResult()
    for index, text in enumerate(arguments):
        result.apply(_delta(tool_calls=[ToolCallDelta(index=index, id=f"c{index}", name="f", arguments="")]))
        for piece in data.draw(_splits(text)):
            result.apply(_delta(tool_calls=[ToolCallDelta(index=index, arguments=piece)]))
    choice = result.choices[0]
    assert [choice.tool_calls[i].arguments for i in range(len(arguments))] == arguments
    assert [(i.call_id, i.text) for i in choice.items] == [(f"c{i}", text) for i, text in enumerate(arguments)]


@given(st.data(), st.lists(st.text(alphabet="ab é", min_size=1, max_size=3), max_size=12))
def test_logprob_offsets_do_not_depend_on_how_tokens_were_grouped(data: st.DataObject, tokens: list[str]) -> None:
    """Tokens whose text is the content: each token's offset is where it starts in the content."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(tokens)), max_size=5)))
    bounds = [0, *cuts, len(tokens)]
    result = JobResult()
    for a, b in pairwise(bounds):
        group = tokens[a:b]
        logprobs = [TokenLogprob(token=token, logprob=-1.0) for token in group]
        result.apply(_delta(content="".join(group), logprobs=logprobs))
    starts = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert result.choices[0].logprob_offsets == starts
