"""Qwen3 ``<think>`` reasoning: tables, held partial tags, and any split agreeing with the whole."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.parsers.helpers import Message, cuts_for, every_way_to_split, free_text, parse_reasoning, split_at
from worker.parsers.base import reasoning_parser_class
from worker.parsers.qwen3_reasoning import Qwen3ReasoningParser

# (text, starts_in_reasoning, expected)
CASES: dict[str, tuple[str, bool, Message]] = {
    "plain text": ("Hello <b>there</b>", False, Message(content="Hello <b>there</b>")),
    "model opens the block": (
        "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
        False,
        Message(reasoning="\nLet me think.\n", content="The answer is 4."),
    ),
    "prompt opened the block": (
        "Let me think.\n</think>\n\nThe answer is 4.",
        True,
        Message(reasoning="Let me think.\n", content="The answer is 4."),
    ),
    "prompt opened the block and the model opens it again": (
        "<think>hmm</think>ok",
        True,
        Message(reasoning="hmm", content="ok"),
    ),
    "empty block (thinking switched off by /no_think)": (
        "<think>\n\n</think>\n\nHi!",
        False,
        Message(reasoning="\n\n", content="Hi!"),
    ),
    "blanks inside the content are kept": ("<think>a</think> \n b \n", False, Message(reasoning="a", content="b \n")),
    "closing tag without an opening one is content": ("x</think>y", False, Message(content="x</think>y")),
    "a later <think> is content": ("Hi <think>x</think>", False, Message(content="Hi <think>x</think>")),
    "ends inside the block": ("<think>still going </thi", False, Message(reasoning="still going </thi")),
    "ends inside an opened-by-prompt block": ("still going", True, Message(reasoning="still going")),
    "ends after the closing tag": ("<think>done</think>\n\n", False, Message(reasoning="done")),
    "half an opening tag is content": ("<thin", False, Message(content="<thin")),
    "half an opening tag is reasoning in an opened block": ("<thin", True, Message(reasoning="<thin")),
    "a near miss is reasoning": (
        "<think>a</thinking> b</think>c",
        False,
        Message(reasoning="a</thinking> b", content="c"),
    ),
    "nothing at all": ("", True, Message()),
}


@pytest.mark.parametrize("text, starts_in_reasoning, expected", CASES.values(), ids=CASES.keys())
def test_table_whole_and_split_every_way(text: str, starts_in_reasoning: bool, expected: Message) -> None:
    for pieces in every_way_to_split(text):
        assert parse_reasoning(pieces, starts_in_reasoning) == expected, pieces


def test_registered_by_name() -> None:
    assert reasoning_parser_class("qwen3") is Qwen3ReasoningParser


def test_split_closing_tag_is_held_and_never_emitted() -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("step 1</thi").reasoning == "step 1"
    delta = parser.feed("nk>\n\nAnswer")
    assert (delta.reasoning, delta.content) == ("", "Answer")


def test_held_text_that_is_no_tag_is_released_as_what_it_is() -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning=False)
    assert parser.feed("<thi").is_empty
    assert parser.feed("s is it").content == "<this is it"
    parser = Qwen3ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("a </thi").reasoning == "a "
    assert parser.finish().reasoning == "</thi"


def test_blanks_after_the_block_wait_for_the_content() -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("r</think>\n").reasoning == "r"
    assert parser.feed("\n").is_empty
    assert parser.feed("  x").content == "x"


_thoughts = free_text.filter(lambda text: "think>" not in text)


@st.composite
def _model_output(draw: st.DrawFn) -> tuple[str, bool, Message]:
    starts_in_reasoning = draw(st.booleans())
    opening = draw(st.sampled_from(["", "<think>", "<think>\n"]))
    reasoning = draw(_thoughts)
    if not (opening or starts_in_reasoning):
        text = opening + reasoning + draw(st.sampled_from(["", "</think>\n\n"])) + draw(free_text)
        return text, starts_in_reasoning, Message(content=text)
    text = opening + reasoning
    expected = Message(reasoning=opening.removeprefix("<think>") + reasoning)
    if draw(st.booleans()):  # else generation stopped while thinking
        answer = draw(st.sampled_from(["", "\n", "\n\n", " "])) + draw(free_text)
        text += "</think>" + answer
        expected.content = answer.lstrip()
    return text, starts_in_reasoning, expected


@settings(max_examples=200, deadline=None)
@given(case=_model_output(), data=st.data())
def test_generated_output_gives_its_message_however_split(case: tuple[str, bool, Message], data: st.DataObject) -> None:
    text, starts_in_reasoning, expected = case
    assert parse_reasoning([text], starts_in_reasoning) == expected
    assert parse_reasoning(split_at(text, data.draw(cuts_for(text))), starts_in_reasoning) == expected
    assert parse_reasoning(list(text), starts_in_reasoning) == expected


_tag_soup = st.lists(st.sampled_from(["<think>", "</think>", "<thi", "</th", "nk>", "\n", " ", "a", "é", "<", "/"]))


@settings(max_examples=200, deadline=None)
@given(pieces=_tag_soup, starts_in_reasoning=st.booleans(), data=st.data())
def test_any_text_cut_anywhere_agrees_with_whole(
    pieces: list[str], starts_in_reasoning: bool, data: st.DataObject
) -> None:
    text = "".join(pieces)
    whole = parse_reasoning([text], starts_in_reasoning)
    assert parse_reasoning(split_at(text, data.draw(cuts_for(text))), starts_in_reasoning) == whole
    assert parse_reasoning(list(text), starts_in_reasoning) == whole
    if "</think>" not in text:  # nothing to split at: all of it comes back, less an opening tag
        assert whole.reasoning + whole.content == text.removeprefix("<think>")
