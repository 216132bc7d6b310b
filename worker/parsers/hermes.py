"""Hermes-style tool calls (Qwen2.5, Qwen3): ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``."""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import Enum, auto
from typing import ClassVar

from shared.events import ToolCallDelta
from worker.parsers.base import register_tool_parser
from worker.parsers.json_stream import JsonValueScanner
from worker.parsers.tool_call_blocks import CallReader, ToolCallBlockParser


class _Expect(Enum):
    """Where the reader is in the call object ``{"name": …, "arguments": …}``."""

    OBJECT = auto()
    KEY_OR_END = auto()
    COLON = auto()
    VALUE = auto()
    AFTER_VALUE = auto()
    DONE = auto()


class _Role(Enum):
    """What the JSON being read (a key or a member's value) is for."""

    KEY = auto()
    NAME = auto()
    ARGUMENTS = auto()
    OTHER = auto()


_JSON_WHITESPACE = " \t\r\n"


class HermesCallReader(CallReader):
    """Reads the call object char by char and streams the arguments value as the model writes it."""

    def __init__(self, index: int, new_call_id: Callable[[], str], allowed_names: frozenset[str] | None = None) -> None:
        super().__init__(index, new_call_id)
        self._allowed_names = allowed_names
        self._expect = _Expect.OBJECT
        self._member: JsonValueScanner | None = None  # the key or value being read
        self._role = _Role.KEY
        self._member_text = ""  # text of the key or name being read
        self._key = ""  # the current member's key
        self._name: str | None = None
        self._arguments: JsonValueScanner | None = None
        self._unsent_arguments = ""  # read but not yet sent: waiting for the name, or for the feed to end
        self._unsent_deltas: list[ToolCallDelta] = []

    def feed(self, text: str) -> list[ToolCallDelta]:
        for char in text:
            if self.is_malformed or self._expect is _Expect.DONE:
                break
            self._push(char)
        return self._flush()

    def close(self) -> list[ToolCallDelta]:
        if not self.is_malformed and self._expect is not _Expect.DONE:
            if self._name is None:
                self.is_malformed = True
            else:
                self._finish()
        return self._flush()

    def _flush(self) -> list[ToolCallDelta]:
        deltas, self._unsent_deltas = self._unsent_deltas, []
        if self.has_call:
            deltas += self._argument_deltas(self._unsent_arguments)
            self._unsent_arguments = ""
        return deltas

    def _push(self, char: str) -> None:
        if self._member is not None:
            text = self._member.push(char)
            if text is not None:
                self._take(text)
                if self._member.is_complete:
                    self._end_member()
                return
            if self._member.is_invalid:
                return self._reject()
            self._end_member()  # a number ended just before this char
        if char in _JSON_WHITESPACE:
            return
        expect = self._expect
        if expect is _Expect.OBJECT and char == "{":
            self._expect = _Expect.KEY_OR_END
        elif expect is _Expect.KEY_OR_END and char == '"':
            self._start_member(char, _Role.KEY)
        elif expect in (_Expect.KEY_OR_END, _Expect.AFTER_VALUE) and char == "}":
            self._end_object()
        elif expect is _Expect.AFTER_VALUE and char == ",":
            self._expect = _Expect.KEY_OR_END
        elif expect is _Expect.COLON and char == ":":
            self._expect = _Expect.VALUE
        elif expect is _Expect.VALUE:
            self._start_value(char)
        else:
            self._reject()

    def _start_value(self, char: str) -> None:
        if self._key == "name" and self._name is None:
            if char != '"':
                return self._reject()  # the name must be a string
            self._start_member(char, _Role.NAME)
        elif self._key == "arguments" and self._arguments is None:
            self._start_member(char, _Role.ARGUMENTS)
        else:
            self._start_member(char, _Role.OTHER)

    def _start_member(self, char: str, role: _Role) -> None:
        self._member, self._role = JsonValueScanner(), role
        if role is _Role.ARGUMENTS:
            self._arguments = self._member
        text = self._member.push(char)
        if text is None:
            return self._reject()  # not the start of a JSON value
        self._take(text)
        self._send_header_if_ready()

    def _take(self, text: str) -> None:
        if self._role is _Role.ARGUMENTS:
            self._unsent_arguments += text
        elif self._role is not _Role.OTHER:
            self._member_text += text

    def _end_member(self) -> None:
        text, self._member_text, self._member = self._member_text, "", None
        if self._role is _Role.KEY:
            self._key, self._expect = json.loads(text), _Expect.COLON
            return
        self._expect = _Expect.AFTER_VALUE
        if self._role is _Role.NAME:
            self._name = json.loads(text)
            if self._allowed_names is not None and self._name not in self._allowed_names:
                return self._reject()  # no header has gone out: it waits for the name
            self._send_header_if_ready()

    def _send_header_if_ready(self) -> None:
        """The header goes out once the name is known and the arguments have started."""
        if not self.has_call and self._name is not None and self._arguments is not None:
            self._unsent_deltas.append(self._header(self._name))

    def _end_object(self) -> None:
        if self._name is None:
            return self._reject()
        self._finish()

    def _reject(self) -> None:
        """Not what a call object allows: before the header the block is no call; after it, the call ends."""
        if self.has_call:
            self._finish()
        else:
            self.is_malformed = True

    def _finish(self) -> None:
        """Send what the call still lacks: its header, and the closing of cut-off arguments."""
        assert self._name is not None
        if not self.has_call:
            self._unsent_deltas.append(self._header(self._name))
        if self._arguments is None:
            self._unsent_arguments = "{}"
        else:
            self._unsent_arguments += self._arguments.closing()
        self._member, self._expect = None, _Expect.DONE


@register_tool_parser("hermes")
class HermesToolParser(ToolCallBlockParser):
    # Qwen2.5-Coder's habit: the call as a fenced JSON object. The fence closes at a line start: a
    # JSON string holds no raw newline, so code with fences inside the arguments cannot close it.
    lead_blocks: ClassVar[dict[str, str]] = {"```json": "\n```"}

    def _new_reader(self, index: int, allowed_names: frozenset[str] | None = None) -> CallReader:
        return HermesCallReader(index, self.new_call_id, allowed_names)
