"""Stop strings across arbitrary delta boundaries: never emitted, partial matches held back."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from worker.engine.stop_checker import StopStringChecker


def _run(stops: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    return _run_matched(stops, deltas)[:3]


def _run_matched(
    stops: list[str], deltas: list[str], include: frozenset[str] = frozenset()
) -> tuple[str, bool, list[str], str | None]:
    checker = StopStringChecker(stops, include)
    emitted: list[str] = []
    for delta in deltas:
        emitted.append(checker.push(delta))
        if checker.is_stopped:
            return "".join(emitted), True, emitted, checker.matched
    emitted.append(checker.flush())
    return "".join(emitted), False, emitted, checker.matched


def test_stop_split_across_deltas_is_not_emitted() -> None:
    text, stopped, pieces = _run(["</end>"], ["Hello </", "en", "d> tail"])
    assert (text, stopped) == ("Hello ", True)
    assert pieces[0] == "Hello "  # "</" was held back, not sent


def test_partial_match_is_released_when_it_does_not_complete() -> None:
    text, stopped, pieces = _run(["STOP"], ["a ST", "ay"])
    assert (text, stopped) == ("a STay", False)
    assert pieces == ["a ", "STay", ""]


def test_earliest_of_several_stops_wins() -> None:
    assert _run(["xyz", "b"], ["a b xyz"])[:2] == ("a ", True)


def test_no_stops_passes_everything_through() -> None:
    assert _run([], ["a", "b"]) == ("ab", False, ["a", "b", ""])


_alphabet = st.sampled_from("ab\n</>é")


@given(
    text=st.text(alphabet=_alphabet, max_size=40),
    stops=st.lists(st.text(alphabet=_alphabet, min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_any_split_gives_the_text_before_the_first_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    emitted, stopped, _, matched = _run_matched(stops, deltas)
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if matches:
        # The stop that completes first (then the longer one) decides, as when fed char by char.
        assert stopped
        first = min(matches)
        assert emitted == text[: first[1]]
        assert matched == first[2]  # the stop reported is the one that cut the text
    else:
        assert not stopped
        assert emitted == text
        assert matched is None
    assert not any(s in emitted for s in stops)
    # Asked to keep the stop strings: the same cut, after the stop instead of before it.
    kept, kept_stopped, _, kept_matched = _run_matched(stops, deltas, frozenset(stops))
    assert (kept_stopped, kept_matched) == (stopped, matched)
    assert kept == (text[: first[0]] if matches else text)


def test_the_stop_completing_first_wins_over_an_earlier_longer_one() -> None:
    assert _run(["<", "><<"], ["><<"])[:2] == (">", True)
    assert _run(["<", "><<"], [">", "<", "<"])[:2] == (">", True)


def test_the_matched_stop_is_named() -> None:
    assert _run_matched(["xyz", "b"], ["a ", "b xyz"])[3] == "b"
    assert _run_matched(["xyz"], ["no match"])[3] is None


def test_only_the_included_stops_stay_in_the_text() -> None:
    """A tool-call plan's markup stops are never kept, whatever the request asked for its own."""
    assert _run_matched(["</tool>", "."], ["a.b"], frozenset({"."}))[0] == "a."
    assert _run_matched(["</tool>", "."], ["a</tool>b"], frozenset({"."}))[0] == "a"
