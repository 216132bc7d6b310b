"""Many concurrent streaming clients that check every stream by its SSE event ids (the job's
sequence numbers): a missing id is a lost delta, a repeated one a duplicate."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx


@dataclass
class LoadTally:
    requests: int = 0
    completed_streams: int = 0
    deltas: int = 0
    lost: int = 0
    duplicated: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)  # error codes of 5xx answers
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def server_errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if status >= 500)


def _error_code(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return body[:80].decode(errors="replace")


def _check_ids(ids: list[int], tally: LoadTally) -> None:
    expected = 0
    for event_id in ids:
        if event_id < expected:
            tally.duplicated += 1
        else:
            tally.lost += event_id - expected
            expected = event_id + 1


async def checked_stream(client: httpx.AsyncClient, url: str, body: dict[str, object], tally: LoadTally) -> None:
    tally.requests += 1
    async with client.stream("POST", url, json=body) as response:
        tally.statuses[response.status_code] += 1
        if response.status_code != 200:
            body = await response.aread()
            if response.status_code >= 500:
                tally.refusals[_error_code(body)] += 1
            return
        ids: list[int] = []
        done = False
        async for line in response.aiter_lines():
            if line.startswith("id: "):
                ids.append(int(line[4:]))
            elif line == "data: [DONE]":
                done = True
            elif line.startswith('data: {"error"'):
                tally.errors[json.loads(line[6:])["error"]["code"]] += 1
    _check_ids(ids, tally)
    tally.deltas += max(0, len(ids) - 1)  # id 0 is the role chunk
    if done:
        tally.completed_streams += 1
    else:
        tally.errors["no_done"] += 1


async def _client_loop(
    client: httpx.AsyncClient, url: str, body: dict[str, object], tally: LoadTally, deadline: float, max_requests: int
) -> None:
    for _ in range(max_requests):
        if time.monotonic() >= deadline:
            return
        try:
            await checked_stream(client, url, body, tally)
        except httpx.HTTPError as exc:
            tally.errors[type(exc).__name__] += 1


async def run_load(
    base_url: str,
    body: dict[str, object],
    num_clients: int,
    duration_s: float,
    max_requests_per_client: int = 10**9,
    request_timeout_s: float = 60.0,
    headers: dict[str, str] | None = None,
) -> LoadTally:
    """``num_clients`` clients, each streaming requests back to back until the deadline."""
    tally = LoadTally()
    url = f"{base_url}/v1/chat/completions"
    limits = httpx.Limits(max_connections=num_clients + 8, max_keepalive_connections=num_clients + 8)
    timeout = httpx.Timeout(request_timeout_s, connect=30.0)
    deadline = time.monotonic() + duration_s
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        loops = [_client_loop(client, url, body, tally, deadline, max_requests_per_client) for _ in range(num_clients)]
        await asyncio.gather(*loops)
    return tally
