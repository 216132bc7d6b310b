"""A stream's delivered-sequence cursor: the one place that decides which event its client gets next.

Events reach a stream from the job's channel (live, at most once) and from the job's log (read
back after a gap, a silence, or a subscription renewed on a new Redis primary), so the same event
may come twice, and a later one before an earlier one. The cursor holds what the client has not
been given yet, by sequence number, and hands it out in order, each event exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.events import AnyEvent


class EventCursor:
    def __init__(self, next_seq: int = 0) -> None:
        self.next_seq = next_seq  # the first event the client has not been given
        self._held: dict[int, AnyEvent] = {}

    def take(self, events: Iterable[AnyEvent]) -> None:
        """Hold ``events`` for delivery; one already delivered, or already held, is a duplicate
        and dropped (the first copy is kept: every copy of an event is the same event)."""
        for event in events:
            if event.seq >= self.next_seq:
                self._held.setdefault(event.seq, event)

    def pop(self) -> AnyEvent | None:
        """The next event in order, or None while it has not arrived."""
        event = self._held.pop(self.next_seq, None)
        if event is not None:
            self.next_seq += 1
        return event

    @property
    def missing(self) -> range:
        """The events that a later held event skipped (a gap for the log to fill); empty when
        nothing is held, or the next event is."""
        if not self._held:
            return range(self.next_seq, self.next_seq)
        return range(self.next_seq, min(self._held))
