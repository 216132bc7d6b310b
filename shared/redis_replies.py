"""Typed views of raw Redis replies.

relaylm's clients never set ``decode_responses``, so every reply is bytes; redis-py's annotations
allow ``bytes | str`` (and more) for either setting. These helpers narrow a reply once, where it
is read, and fail loudly on a reply of a shape the caller did not ask for.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.events import AnyEvent, decode_event

# The field of an event-log stream entry that holds the encoded event.
EVENT_FIELD = b"e"


def as_bytes(reply: object) -> bytes:
    if isinstance(reply, bytes):
        return reply
    if isinstance(reply, str):
        return reply.encode()
    raise TypeError(f"expected a Redis string reply, got {type(reply).__name__}")


def as_text(reply: object) -> str:
    return as_bytes(reply).decode()


def texts(replies: Iterable[object]) -> list[str]:
    return [as_text(reply) for reply in replies]


def log_events(entries: object) -> list[AnyEvent]:
    """The events in an XRANGE reply over a job's event log, in log order."""
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise TypeError(f"expected an XRANGE reply, got {type(entries).__name__}")
    return [decode_event(as_bytes(fields[EVENT_FIELD])) for _entry_id, fields in entries]
