"""The stream's delivered-sequence cursor: events from the channel and from the job's log, in any
order and any number of times, leave in sequence order, each exactly once; a gap is named."""

from __future__ import annotations

import pytest

from api.jobs.event_cursor import EventCursor
from shared.events import AnyEvent, DeltaEvent, EndEvent, StartEvent, UsageCounts


def _events(*seqs: int) -> list[AnyEvent]:
    made: list[AnyEvent] = []
    for seq in seqs:
        if seq == 0:
            made.append(StartEvent(seq=0, worker_id="w", prompt_tokens=1))
        elif seq == 9:
            made.append(EndEvent(seq=9, usage=UsageCounts(prompt_tokens=1, completion_tokens=8)))
        else:
            made.append(DeltaEvent(seq=seq, content=f"t{seq}"))
    return made


def _drain(cursor: EventCursor) -> list[int]:
    delivered = []
    while (event := cursor.pop()) is not None:
        delivered.append(event.seq)
    return delivered


@pytest.mark.parametrize(
    ("next_seq", "arrivals", "delivered", "missing"),
    [
        (0, [(0, 1, 2)], [0, 1, 2], range(3, 3)),
        (0, [(0, 1, 1, 2, 2)], [0, 1, 2], range(3, 3)),  # duplicates on the channel
        (0, [(0, 2, 3)], [0], range(1, 2)),  # pub/sub dropped 1
        (0, [(0, 2, 3), (1, 2, 3)], [0, 1, 2, 3], range(4, 4)),  # the log filled it
        (0, [(3, 2), (1, 0)], [0, 1, 2, 3], range(4, 4)),  # out of order
        (4, [(0, 1, 2, 3, 4, 5)], [4, 5], range(6, 6)),  # a reconnect after event 3
        (0, [(5,)], [], range(0, 5)),
    ],
)
def test_arrivals_leave_in_order_each_once(
    next_seq: int, arrivals: list[tuple[int, ...]], delivered: list[int], missing: range
) -> None:
    cursor = EventCursor(next_seq)
    for seqs in arrivals:
        cursor.take(_events(*seqs))
    assert _drain(cursor) == delivered
    assert cursor.missing == missing


def test_a_failover_refill_overlapping_the_live_events_repeats_nothing_and_skips_nothing() -> None:
    # Live up to 4; the channel breaks; 5..7 were published meanwhile. The log read after the
    # subscription was renewed has 3..8 (the new primary lacked nothing), and the live channel
    # brings 7, 8, 9 again as the worker goes on.
    cursor = EventCursor()
    cursor.take(_events(0, 1, 2, 3, 4))
    assert _drain(cursor) == [0, 1, 2, 3, 4]
    cursor.take(_events(3, 4, 5, 6, 7, 8))
    cursor.take(_events(7, 8, 9))
    assert _drain(cursor) == [5, 6, 7, 8, 9]
    assert cursor.next_seq == 10 and cursor.missing == range(10, 10)


def test_an_event_already_delivered_is_not_held_again() -> None:
    cursor = EventCursor()
    cursor.take(_events(0, 1))
    assert _drain(cursor) == [0, 1]
    cursor.take(_events(0, 1))
    assert cursor.pop() is None and cursor.missing == range(2, 2)


def test_the_first_copy_of_an_event_is_the_one_delivered() -> None:
    cursor = EventCursor()
    cursor.take([DeltaEvent(seq=0, content="first")])
    cursor.take([DeltaEvent(seq=0, content="second")])
    assert cursor.pop() == DeltaEvent(seq=0, content="first")
