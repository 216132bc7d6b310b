"""Pieces of llguidance's Lark-like grammar text shared by the grammar builders.

Grammars are written as text (not built through an API) so a failing request can log the exact
grammar it used, and a test can read it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_CALL_TAGS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)

# JSON whitespace is free by default, and a weak or confused model then spends its whole budget
# on blanks (seen with random weights: tabs and newlines until max_tokens). At most one space
# between tokens, like OpenAI's and vLLM's structured output, keeps it compact.
JSON_WHITESPACE_PATTERN = r"\x20?"


class AddedTokenSource(Protocol):
    """The part of a Hugging Face tokenizer needed here."""

    @property
    def added_tokens_decoder(self) -> Mapping[int, Any]: ...


def literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON string escapes are valid Lark escapes)."""
    return json.dumps(text, ensure_ascii=False)


def embedded_json(schema: Mapping[str, Any], is_strict: bool) -> str:
    """A ``%json`` item: JSON conforming to ``schema``, with our whitespace and strictness options.

    Non-strict schemas compile leniently: keywords the library cannot enforce are ignored
    rather than failing the request, which matches OpenAI's best-effort non-strict mode.
    """
    options = {"whitespace_pattern": JSON_WHITESPACE_PATTERN, "lenient": not is_strict}
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


@dataclass(frozen=True)
class TagTokens:
    """Tags (like ``<tool_call>``) that are a single added token in one tokenizer, text → id."""

    token_ids: Mapping[str, int]

    @classmethod
    def from_tokenizer(cls, tokenizer: AddedTokenSource, tags: Iterable[str] = TOOL_CALL_TAGS) -> TagTokens:
        added = {token.content: token_id for token_id, token in tokenizer.added_tokens_decoder.items()}
        return cls({tag: added[tag] for tag in tags if tag in added})

    def render(self, tag: str) -> str:
        """The Lark item that produces ``tag``.

        llguidance keeps every added token (special or not) out of text matching, so a tag that is
        an added token must be named by id; it is also the only form the model was trained on.
        Elsewhere the tag is ordinary text spelled by several tokens.
        """
        token_id = self.token_ids.get(tag)
        return literal(tag) if token_id is None else f"<[{token_id}]>"
