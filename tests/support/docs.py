"""Reading README.md and docs/: pages, headings' anchors as MkDocs makes them, links, code blocks."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
RUNNABLE = "<!-- runnable -->"

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*(?:\{#(?P<id>[\w-]+)[^}]*\})?\s*#*\s*$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
_INLINE_CODE = re.compile(r"`[^`]*`")


@dataclass(frozen=True)
class CodeBlock:
    path: Path
    line: int  # of the opening fence
    language: str
    code: str
    runnable: bool

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_files() -> list[Path]:
    """README.md and every page of the site."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def _prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    fence: str | None = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = _FENCE.match(line)
        if match and (fence is None or match["fence"].startswith(fence)):
            fence = None if fence else match["fence"]
            continue
        if fence is None:
            yield number, line


@functools.cache
def heading_anchors(path: Path) -> frozenset[str]:
    """The anchors MkDocs gives the page's headings (toc's slugify, repeats numbered _1, _2...)."""
    anchors: set[str] = set()
    for _, line in _prose_lines(path):
        match = _HEADING.match(line)
        if not match:
            continue
        anchor = match["id"] or slugify(re.sub(r"[`*]", "", match[2]), "-")
        unique, count = anchor, 0
        while unique in anchors:
            count += 1
            unique = f"{anchor}_{count}"
        anchors.add(unique)
    return frozenset(anchors)


def relative_links(path: Path) -> Iterator[tuple[int, str, str]]:
    """(line, target path or '' for the page itself, anchor or '') of every link within the repository."""
    for number, line in _prose_lines(path):
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            target = match["target"]
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            yield number, file_part, anchor


def code_blocks(path: Path) -> list[CodeBlock]:
    blocks: list[CodeBlock] = []
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        fence, indent = match["fence"], len(match["indent"])
        language = match["info"].strip().split(" ")[0].lower()
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        code = "\n".join(line[indent:] for line in lines[index + 1 : end]) + "\n"
        runnable = index > 0 and lines[index - 1].strip() == RUNNABLE
        blocks.append(CodeBlock(path, index + 1, language, code, runnable))
        index = end + 1
    return blocks


def runnable_blocks() -> list[CodeBlock]:
    return [block for path in markdown_files() for block in code_blocks(path) if block.runnable]
