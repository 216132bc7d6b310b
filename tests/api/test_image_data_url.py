"""``data:`` URLs of images: the bytes of the base64 form, a 400-worthy refusal for every other
form, and the byte limit known before decoding; (property) any text gives bytes or a refusal."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.images.data_url import is_data_url, parse_data_url
from api.images.refusal import ImageRefused

LIMIT = 1024


def _url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_the_bytes_and_media_type_of_a_base64_url() -> None:
    parsed = parse_data_url(_url(b"\x89PNG\r\n\x1a\n..."), LIMIT)
    assert (parsed.media_type, parsed.data) == ("image/png", b"\x89PNG\r\n\x1a\n...")


@pytest.mark.parametrize(
    "url",
    [
        "DATA:image/png;BASE64,aGk=",  # the scheme and the marker are case-insensitive
        "data:image/png;base64,aGk",  # padding left out
        "data:image/png;base64,a G\r\nk=",  # line-wrapped
        "data:image/png;name=x.png;base64,aGk=",  # parameters before the marker
    ],
)
def test_forms_clients_send_are_read(url: str) -> None:
    assert parse_data_url(url, LIMIT).data == b"hi"


def test_no_media_type_is_rfc_2397s_default() -> None:
    assert parse_data_url("data:;base64,aGk=", LIMIT).media_type == "text/plain"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://example.com/a.png", "does not start with data:"),
        ("data:image/png;base64", "no comma"),
        ("data:image/png,%89PNG", "must be base64"),
        ("data:base64,aGk=", "must be base64"),  # "base64" here is the media type
        ("data:image/png;base64,a", "not base64"),
        ("data:image/png;base64,aGk=aGk=", "not base64"),
        ("data:image/png;base64,aG!k", "not base64"),
        ("data:image/png;base64,aGé=", "not base64"),
    ],
)
def test_malformed_urls_are_refused_saying_why(url: str, why: str) -> None:
    with pytest.raises(ImageRefused) as refused:
        parse_data_url(url, LIMIT)
    assert refused.value.reason == "malformed_data_url"
    assert why in refused.value.message


def test_the_byte_limit_holds_exactly() -> None:
    assert len(parse_data_url(_url(b"x" * LIMIT), LIMIT).data) == LIMIT
    with pytest.raises(ImageRefused) as refused:
        parse_data_url(_url(b"x" * (LIMIT + 1)), LIMIT)
    assert refused.value.reason == "too_large"


def test_is_data_url() -> None:
    assert is_data_url("data:image/png;base64,") and is_data_url("Data:x")
    assert not is_data_url("https://example.com/data:x") and not is_data_url("")


@given(st.binary(max_size=300), st.sampled_from(["image/png", "image/jpeg", "application/octet-stream"]))
def test_any_bytes_come_back_whole(data: bytes, media_type: str) -> None:
    parsed = parse_data_url(_url(data, media_type), LIMIT)
    assert (parsed.data, parsed.media_type) == (data, media_type)


@given(st.text(max_size=200))
def test_any_text_gives_bytes_or_a_refusal(text: str) -> None:
    for url in (text, "data:" + text, "data:image/png;base64," + text):
        try:
            parsed = parse_data_url(url, LIMIT)
        except ImageRefused as refused:
            assert refused.reason in ("malformed_data_url", "too_large")
        else:
            assert len(parsed.data) <= LIMIT
