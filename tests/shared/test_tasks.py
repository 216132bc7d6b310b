"""A background loop stops even when something inside it swallows the cancellation it was sent."""

from __future__ import annotations

import asyncio

import pytest

from shared.tasks import cancel_and_wait


async def _loop_that_swallows_one_cancellation(iterations: list[int]) -> None:
    swallowed = False
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True  # as a client library's timeout scope can do
        iterations.append(1)


async def test_a_loop_that_swallows_a_cancellation_still_stops() -> None:
    iterations: list[int] = []
    task = asyncio.create_task(_loop_that_swallows_one_cancellation(iterations))
    await asyncio.sleep(0.05)
    await asyncio.wait_for(cancel_and_wait(task), 5)
    assert task.cancelled()
    assert iterations  # it did run, and went on after the first cancellation


async def test_a_task_that_failed_or_finished_is_waited_for_without_raising() -> None:
    async def fail() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(fail())
    finished = asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    await cancel_and_wait(failed)
    await cancel_and_wait(finished)
    with pytest.raises(RuntimeError):
        failed.result()
    assert finished.done() and not finished.cancelled()
