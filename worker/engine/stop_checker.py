"""Stop strings over a stream of text deltas: the stop text is not emitted (unless the request
asked for it: ``include``), partial matches are held back until they either complete (stop) or
cannot (release)."""

from __future__ import annotations


class StopStringChecker:
    def __init__(self, stop_strings: tuple[str, ...] | list[str], include: frozenset[str] = frozenset()) -> None:
        """``include``: stop strings that end the text with themselves rather than before."""
        self._stops = tuple(s for s in stop_strings if s)
        self._include = include
        self._held = ""
        self.is_stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> str:
        """Feed new text; return what may be emitted now. Sets ``is_stopped`` on a match."""
        if not self._stops:
            return text
        pending = self._held + text
        match = self._first_completed_match(pending)
        if match is not None:
            match_at, self.matched = match
            self._held = ""
            self.is_stopped = True
            return pending[: match_at + len(self.matched) if self.matched in self._include else match_at]
        keep = self._longest_partial_suffix(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """Generation ended without a match: the held text was real output."""
        held, self._held = self._held, ""
        return held

    def _first_completed_match(self, text: str) -> tuple[int, str] | None:
        """Start and stop string of the match that completes first (ties: the longer stop), as if
        fed char by char.

        Deciding by completion point keeps the result independent of how text is split into deltas.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:length]):
                    best = length
                    break
        return best
