"""Follows one JSON value char by char, so a parser can pass it on while the model writes it and still
know where it ends, and how to close it into valid JSON when generation stops half-way.

What has been passed on can always be closed by appending text: whatever sits between values
(blanks, a comma, the next key and its colon) and half an escape sequence are held until the next
value starts or the container closes, and dropped if the value is cut off there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum, auto
from typing import Protocol

_WHITESPACE = frozenset(" \t\r\n")
_VALUE_STARTS = frozenset('{["tfn-0123456789')
_CLOSERS = {"{": "}", "[": "]"}
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset('"\\/bfnrt')

# The JSON number grammar as moves between states; chars are classed "0", "1" (1-9), "e" (e or E).
_NUMBER_MOVES = {
    ("start", "-"): "sign",
    **{(state, "0"): "zero" for state in ("start", "sign")},
    **{(state, "1"): "int" for state in ("start", "sign")},
    **{("int", digit): "int" for digit in "01"},
    **{(state, "."): "dot" for state in ("zero", "int")},
    **{(state, digit): "frac" for state in ("dot", "frac") for digit in "01"},
    **{(state, "e"): "exp_mark" for state in ("zero", "int", "frac")},
    **{("exp_mark", sign): "exp_sign" for sign in "+-"},
    **{(state, digit): "exp" for state in ("exp_mark", "exp_sign", "exp") for digit in "01"},
}
_NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp"})


class _Token(Protocol):
    is_closed: bool  # its last char has been read

    @property
    def is_complete(self) -> bool:
        """Valid as it stands if the next char is not part of it."""

    def push(self, char: str) -> str | None:
        """Text to pass on for ``char``, or None when ``char`` is not part of the token."""

    def closing(self) -> str: ...


class _StringToken:
    """Raw control characters (invalid in JSON strings) are escaped on the way through; an escape
    the model got wrong keeps its backslash as a literal one."""

    def __init__(self) -> None:
        self._escape = ""  # an escape sequence read so far, held until complete
        self.is_closed = False

    @property
    def is_complete(self) -> bool:
        return self.is_closed

    def push(self, char: str) -> str:
        if self._escape:
            return self._push_escape(char)
        if char == "\\":
            self._escape = char
            return ""
        if char == '"':
            self.is_closed = True
            return char
        return json.dumps(char)[1:-1] if char < " " else char

    def _push_escape(self, char: str) -> str:
        sequence = self._escape + char
        is_unicode = sequence.startswith("\\u")
        if sequence == "\\u" or (is_unicode and char in _HEX_DIGITS and len(sequence) < 6):
            self._escape = sequence
            return ""
        self._escape = ""
        if (not is_unicode and char in _SIMPLE_ESCAPES) or (is_unicode and char in _HEX_DIGITS):
            return sequence
        return "\\\\" + sequence[1:-1] + self.push(char)

    def closing(self) -> str:
        return '"'


class _LiteralToken:
    def __init__(self, first_char: str) -> None:
        self._rest = _LITERALS[first_char][1:]
        self.is_closed = False

    @property
    def is_complete(self) -> bool:
        return self.is_closed

    def push(self, char: str) -> str | None:
        if char != self._rest[0]:
            return None
        self._rest = self._rest[1:]
        self.is_closed = not self._rest
        return char

    def closing(self) -> str:
        return self._rest


class _NumberToken:
    def __init__(self, first_char: str) -> None:
        self._state = _NUMBER_MOVES[("start", _number_class(first_char))]
        self.is_closed = False  # a number only ends at a char that is not part of it

    @property
    def is_complete(self) -> bool:
        return self._state in _NUMBER_ENDS

    def push(self, char: str) -> str | None:
        state = _NUMBER_MOVES.get((self._state, _number_class(char)))
        if state is None:
            return None
        self._state = state
        return char

    def closing(self) -> str:
        return "" if self.is_complete else "0"


def _number_class(char: str) -> str:
    if char in "123456789":
        return "1"
    return "e" if char in "eE" else char


def _new_token(first_char: str) -> _Token:
    if first_char == '"':
        return _StringToken()
    if first_char in _LITERALS:
        return _LiteralToken(first_char)
    return _NumberToken(first_char)


class _Expect(Enum):
    """What an open container accepts next."""

    VALUE_OR_CLOSE = auto()  # after "["
    KEY_OR_CLOSE = auto()  # after "{"
    KEY = auto()  # after "," in an object
    VALUE = auto()  # after ":" or after "," in an array
    COLON = auto()
    COMMA_OR_CLOSE = auto()


_MAY_CLOSE = frozenset({_Expect.VALUE_OR_CLOSE, _Expect.KEY_OR_CLOSE, _Expect.COMMA_OR_CLOSE})
_MAY_START_VALUE = frozenset({_Expect.VALUE_OR_CLOSE, _Expect.VALUE})


@dataclass
class _Container:
    closer: str
    expect: _Expect


class JsonValueScanner:
    """One JSON value, pushed char by char starting at its first char."""

    def __init__(self) -> None:
        self._containers: list[_Container] = []  # innermost last
        self._token: _Token | None = None
        self._is_key = False  # the token is an object key (held, not passed on)
        self._held = ""
        self.is_complete = False
        self.is_invalid = False

    def push(self, char: str) -> str | None:
        """Text to pass on for ``char`` ("" while held), or None when ``char`` is not part of the value:
        the value ended before it, or it breaks the JSON grammar (then ``is_invalid``)."""
        if self.is_complete or self.is_invalid:
            return None
        if self._token is not None:
            text = self._token.push(char)
            if text is not None:
                if self._is_key:
                    self._held, text = self._held + text, ""
                if self._token.is_closed:
                    self._end_token()
                return text
            if not self._token.is_complete:
                self._fail()
                return None
            self._end_token()
            if self.is_complete:
                return None
        return self._push_between_tokens(char)

    def closing(self) -> str:
        """What to append to the text passed on so far to make it one complete JSON value."""
        if self.is_complete:
            return ""
        token_end = self._token.closing() if self._token is not None and not self._is_key else ""
        return token_end + "".join(container.closer for container in reversed(self._containers))

    def _push_between_tokens(self, char: str) -> str | None:
        container = self._containers[-1] if self._containers else None
        expect = container.expect if container else _Expect.VALUE
        if char in _VALUE_STARTS and expect in _MAY_START_VALUE:
            return self._start_value(char)
        if container is None:
            self._fail()
            return None
        if char == container.closer and expect in _MAY_CLOSE:
            self._containers.pop()
            self._end_value()
            return self._release_held() + char
        if char == "," and expect is _Expect.COMMA_OR_CLOSE:
            container.expect = _Expect.KEY if container.closer == "}" else _Expect.VALUE
        elif char == '"' and expect in (_Expect.KEY, _Expect.KEY_OR_CLOSE):
            self._token, self._is_key = _StringToken(), True
        elif char == ":" and expect is _Expect.COLON:
            container.expect = _Expect.VALUE
        elif char not in _WHITESPACE:
            self._fail()
            return None
        self._held += char
        return ""

    def _start_value(self, char: str) -> str:
        if char in _CLOSERS:
            is_object = char == "{"
            self._containers.append(
                _Container(_CLOSERS[char], _Expect.KEY_OR_CLOSE if is_object else _Expect.VALUE_OR_CLOSE)
            )
        else:
            self._token = _new_token(char)
        return self._release_held() + char

    def _end_token(self) -> None:
        self._token = None
        if self._is_key:
            self._is_key = False
            self._containers[-1].expect = _Expect.COLON
        else:
            self._end_value()

    def _end_value(self) -> None:
        if self._containers:
            self._containers[-1].expect = _Expect.COMMA_OR_CLOSE
        else:
            self.is_complete = True

    def _release_held(self) -> str:
        held, self._held = self._held, ""
        return held

    def _fail(self) -> None:
        self.is_invalid = True
