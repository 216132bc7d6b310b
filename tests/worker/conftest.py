"""Fixtures of the worker tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    """An asyncio client of the session's real Redis."""
    client = Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()
