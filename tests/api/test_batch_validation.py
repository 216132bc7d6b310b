"""Batch input files, line by line: OpenAI's rules, each problem reported with its line number;
and (property) any bytes at all give a verdict, never an exception."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from api.batches.validation import validate_batch_file

KNOWN = {"tiny"}.__contains__


def _line(custom_id: str, url: str = "/v1/chat/completions", **body: Any) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _check(text: str, endpoint: str = "/v1/chat/completions", max_requests: int = 100) -> Any:
    return validate_batch_file(text.encode(), endpoint, max_requests, KNOWN)


def test_a_good_file_gives_its_lines_by_number_and_its_model() -> None:
    result = _check(_line("a") + "\n\n" + _line("b") + "\n")
    assert not result.errors
    assert sorted(result.lines) == [1, 3] and result.model == "tiny"
    assert result.lines[3].custom_id == "b"


def test_every_problem_is_reported_with_its_line() -> None:
    lines = [
        _line("a"),
        "[1, 2",
        _line("a"),
        _line("c", url="/v1/completions"),
        _line("d", stream=True),
        _line("e", model="other"),
        _line("f", messages=[]),
        json.dumps({"custom_id": "g", "method": "GET", "url": "/v1/chat/completions", "body": {}}),
    ]
    result = _check("\n".join(lines))
    assert [(e.line, e.code) for e in result.errors] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_url"),
        (5, "stream_unsupported"),
        (6, "model_not_found"),
        (7, "invalid_request"),
        (8, "invalid_request"),
    ]
    assert result.errors[-1].param == "method"
    assert result.errors[4].param == "body.model"


def test_bad_inputs_in_batch_lines_are_refused_as_in_json_bodies() -> None:
    lines = [
        _line("a", messages=[{"role": "user", "content": []}]),  # an empty content array
        _line("b", logit_bias={"-1": 5}),  # a token id that cannot exist
        _line("c", metadata={"\ud800": "x"}),  # a lone surrogate in a key
        _line("d", response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"\udfff": 1}}}),
    ]
    result = _check("\n".join(lines))
    assert [(e.line, e.code) for e in result.errors] == [(n, "invalid_request") for n in (1, 2, 3, 4)]
    assert result.errors[0].param is not None and result.errors[0].param.startswith("body.messages.0")
    assert result.errors[1].param == "body.logit_bias"
    assert result.errors[2].param == "body.metadata.\\ud800"
    assert result.errors[3].param == "body.response_format.json_schema.schema.\\udfff"


def test_one_model_per_batch() -> None:
    result = validate_batch_file(
        (_line("a") + "\n" + _line("b", model="other")).encode(),
        "/v1/chat/completions",
        10,
        {"tiny", "other"}.__contains__,
    )
    assert [(e.line, e.code) for e in result.errors] == [(2, "mixed_models")]


def test_file_level_problems_have_no_line() -> None:
    assert [e.code for e in _check("").errors] == ["empty_file"]
    assert [e.code for e in _check("\n".join(_line(str(i)) for i in range(3)), max_requests=2).errors] == [
        "too_many_requests"
    ]
    not_utf8 = validate_batch_file(b"\xff\xfe", "/v1/chat/completions", 10, KNOWN)
    assert [(e.line, e.code) for e in not_utf8.errors] == [(None, "invalid_file")]


def test_embedding_lines_are_checked_against_the_embeddings_request() -> None:
    good = json.dumps(
        {"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {"model": "tiny", "input": "hi"}}
    )
    bad = json.dumps(
        {"custom_id": "y", "method": "POST", "url": "/v1/embeddings", "body": {"model": "tiny", "input": []}}
    )
    result = _check(good + "\n" + bad, endpoint="/v1/embeddings")
    assert sorted(result.lines) == [1] and [(e.line, e.code) for e in result.errors] == [(2, "invalid_request")]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=80), st.sampled_from([_line("a").encode(), _line("b").encode()]))))
def test_any_bytes_get_a_verdict_with_lines_inside_the_file(chunks: list[bytes]) -> None:
    content = b"\n".join(chunks)
    result = validate_batch_file(content, "/v1/chat/completions", 100, KNOWN)
    num_lines = len(content.decode("utf-8", errors="replace").splitlines())
    assert result.errors or result.lines
    assert all(error.line is None or 1 <= error.line <= num_lines for error in result.errors)
    assert set(result.lines).isdisjoint({error.line for error in result.errors})
