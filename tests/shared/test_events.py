"""The event union round-trips through msgpack; unknown types are refused."""

from __future__ import annotations

import msgpack
import pytest
from pydantic import ValidationError

from shared.errors import ErrorKind
from shared.events import DeltaEvent, EndEvent, ErrorEvent, StartEvent, UsageCounts, decode_event, encode_event


@pytest.mark.parametrize(
    "event",
    [
        StartEvent(seq=0, worker_id="w1", prompt_tokens=12),
        DeltaEvent(seq=1, index=2, content="héllo 🎉"),
        DeltaEvent(seq=2, finish_reason="length"),
        EndEvent(seq=3, usage=UsageCounts(prompt_tokens=1, completion_tokens=2, cached_tokens=1)),
        ErrorEvent(seq=4, kind=ErrorKind.CONTEXT_LENGTH_EXCEEDED, message="too long", param="messages"),
    ],
)
def test_every_event_round_trips(event: object) -> None:
    assert decode_event(encode_event(event)) == event  # type: ignore[arg-type]


def test_unknown_event_type_is_refused() -> None:
    with pytest.raises(ValidationError):
        decode_event(msgpack.packb({"type": "surprise", "seq": 0}))


def test_error_event_becomes_the_same_relay_error() -> None:
    error = ErrorEvent(seq=0, kind=ErrorKind.WORKER_LOST, message="gone").to_exception()
    assert error.status == 503
    assert error.to_body() == {
        "error": {"message": "gone", "type": "service_unavailable_error", "param": None, "code": "worker_lost"}
    }
