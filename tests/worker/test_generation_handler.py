"""Preparing a generation request (template, tokens, grammar) runs off the worker's event loop,
so a slow one (the first constrained request builds a token trie: seconds for Qwen's vocabulary on
a busy CPU) does not stop the heartbeat and get the job taken for a dead worker's."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from shared.contract import ChatJob, Generate, Message
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import EngineRequest
from worker.kinds import generate
from worker.kinds.generate import GenerationHandler


class _Inputs:
    claim = SimpleNamespace(next_seq=1, prefix_keys=(), claimed_ms=0)

    async def sent(self) -> None:
        return None

    async def images(self, job: Any) -> dict[str, bytes]:
        return {}


async def test_a_slow_prepare_leaves_the_event_loop_running(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow_prepare_chat(job_id: str, *args: Any) -> EngineRequest:
        time.sleep(0.6)  # holds its thread, as template rendering and a grammar compile do
        return EngineRequest(job_id, [[1, 2, 3]], SamplingParams())

    monkeypatch.setattr(generate, "prepare_chat", slow_prepare_chat)
    handler = GenerationHandler(SimpleNamespace(), SimpleNamespace(), SimpleNamespace(max_running=4))  # type: ignore[arg-type]
    job = ChatJob(job_id="j", created=0, request=Generate(model="m", messages=[Message(role="user", content="hi")]))
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.02)

    beating = asyncio.create_task(heartbeat())
    request = await handler.prepare(job, _Inputs())  # type: ignore[arg-type]
    beating.cancel()
    assert isinstance(request, EngineRequest) and request.request_id == "j"
    assert ticks >= 10, f"the loop ran {ticks} times in 0.6 s of preparing"
