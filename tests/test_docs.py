"""README and the documentation site: the site builds strict, every page is in the nav, every
internal link and anchor resolves, the settings page is the command's own options, examples are
ruff-clean, and nothing speaks of how the product got here.

The examples marked runnable are executed in tests/e2e/test_docs_examples.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from relaylm.cli import main as relaylm_command
from relaylm.settings_page import PAGE as SETTINGS_PAGE
from relaylm.settings_page import render as render_settings
from tests.support.docs import DOCS, README, ROOT, code_blocks, heading_anchors, markdown_files, relative_links

README_MAX_LINES = 250
# History and internal references have no place in what users read.
_HISTORY = re.compile(
    r"\bsessions?\b|(?<![\w&/`])#\d+\b|\brun before\b|\bearlier run|\bprevious run|\bprevious(ly)? (vm|machine)"
    r"|\bpreviously\b|\bused to\b|\bthe vm of\b|\bbefore this change\b",
    re.IGNORECASE,
)


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the details belong in docs/"


def test_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    in_nav = _nav_pages(config["nav"])
    pages = sorted(str(path.relative_to(DOCS)) for path in markdown_files() if path != README)
    assert sorted(in_nav) == pages


def test_the_site_builds_strict(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert build.returncode == 0, build.stderr
    assert not re.search(r"^WARNING", build.stderr, re.MULTILINE), build.stderr


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_internal_links_and_anchors_resolve(path: Path) -> None:
    broken = []
    for line, target, anchor in relative_links(path):
        target_path = (path.parent / target).resolve() if target else path
        if not target_path.exists():
            broken.append(f"line {line}: {target} does not exist")
        elif anchor and target_path.suffix == ".md" and anchor not in heading_anchors(target_path):
            broken.append(f"line {line}: {target or path.name} has no heading #{anchor}")
    assert not broken, "\n".join(broken)


def test_settings_page_is_the_commands_options() -> None:
    assert SETTINGS_PAGE.read_text() == render_settings(), "run python -m relaylm.settings_page"


@pytest.mark.parametrize("command", ["api", "worker", "serve"])
def test_settings_page_names_every_flag(command: str) -> None:
    page = SETTINGS_PAGE.read_text()
    options = [p for p in relaylm_command.commands[command].params if isinstance(p, click.Option)]  # type: ignore[attr-defined]
    missing = [option.opts[0] for option in options if f"`{option.opts[0]}" not in page]
    assert options and not missing


def test_python_examples_are_ruff_clean(tmp_path: Path) -> None:
    files = []
    for path in markdown_files():
        for number, block in enumerate(code_blocks(path)):
            if block.language == "python":
                name = f"{path.stem}_{number}.py".replace("-", "_")
                (tmp_path / name).write_text(block.code)
                files.append(name)
    assert files
    config = ["--no-cache", "--config", str(ROOT / "pyproject.toml")]
    for args in (["check", *config], ["format", "--check", *config]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *args, *files], cwd=tmp_path, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_pages_speak_of_the_product_only(path: Path) -> None:
    hits = [
        f"line {number}: {line.strip()}"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _HISTORY.search(line)
    ]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("command", ["api", "worker", "serve"])
def test_help_speaks_of_the_product_only(command: str) -> None:
    result = CliRunner().invoke(relaylm_command, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0
    assert not _HISTORY.search(result.output), _HISTORY.findall(result.output)


_LOG_CALL = re.compile(r"\b(?:log|logger|LOG|_log|_logger)\.(?:debug|info|warning|error|exception|critical)\(")


def test_log_lines_speak_of_the_product_only() -> None:
    hits = []
    for folder in ("api", "worker", "shared", "relaylm"):
        for source in (ROOT / folder).rglob("*.py"):
            text = source.read_text()
            for match in _LOG_CALL.finditer(text):
                call = text[match.start() : text.find("\n\n", match.start())]
                if _HISTORY.search(call):
                    hits.append(f"{source.relative_to(ROOT)}: {call.splitlines()[0].strip()}")
    assert not hits, "\n".join(hits)
