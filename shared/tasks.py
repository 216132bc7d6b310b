"""Stopping a background task so that it really stops.

``task.cancel()`` asks once. A library that swallows the one ``CancelledError`` it is handed
(redis-py's asyncio client can, when the cancellation lands inside its own timeout scope) leaves
a ``while True`` loop running, and whoever awaits the task waits for ever. So cancellation is
repeated until the task is done: the next request lands at the loop's next ``await``.
"""

from __future__ import annotations

import asyncio
from typing import Any

_RECANCEL_EVERY_S = 0.1


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` until it has finished; whatever it ended with is not raised here."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=_RECANCEL_EVERY_S)
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved
