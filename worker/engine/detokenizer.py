"""Incremental detokenization that never emits half a UTF-8 character.

Decoding token by token breaks multi-byte characters split across byte-level BPE tokens and
drops the leading spaces some tokenizers attach by context. So each step decodes a short
window (from ``prefix_offset``) twice — with and without the new tokens — and emits the
difference, holding it back while it ends in U+FFFD (an incomplete character).
"""

from __future__ import annotations

from typing import Protocol

# A UTF-8 character is at most 4 bytes; byte-level tokens carry at least one byte each, so a
# replacement character still pending after this many tokens is a genuinely invalid sequence.
_MAX_HELD_TOKENS = 4
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly empty)."""
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        num_held = len(self._token_ids) - self._read_offset
        if full_text.endswith(_REPLACEMENT_CHAR) and num_held < _MAX_HELD_TOKENS:
            return ""
        if len(full_text) <= len(prefix_text):
            # Nothing visible yet (e.g. a skipped special token); keep the window.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of generation: whatever is still held back, replacement characters included."""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
