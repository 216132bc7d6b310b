"""The API's lifespan end is bounded: uvicorn waits for it without a limit, so one stuck step
(a Redis socket that will not close) must not keep a SIGTERMed process alive."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from api import app as api_app


def test_a_stuck_shutdown_step_is_given_up_after_its_limit(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(api_app, "_SHUTDOWN_STEP_S", 0.2)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="relaylm.api"):
        asyncio.run(api_app._bounded_step("stuck close", asyncio.sleep(60)))
    assert time.monotonic() - started < 5
    assert "stuck close took over" in caplog.text


def test_a_failing_shutdown_step_is_logged_and_the_next_one_runs(caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []

    async def fails() -> None:
        raise OSError("socket already gone")

    async def closes() -> None:
        ran.append("closed")

    async def shut_down() -> None:
        await api_app._bounded_step("router stop", fails())
        await api_app._bounded_step("Redis close", closes())

    with caplog.at_level(logging.ERROR, logger="relaylm.api"):
        asyncio.run(shut_down())
    assert ran == ["closed"]
    assert "router stop failed" in caplog.text
