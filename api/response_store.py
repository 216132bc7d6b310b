"""Stored Responses API responses (``store: true``, the default): what ``GET /v1/responses/{id}``,
``input_items`` and a later ``previous_response_id`` read. Kept in Redis, so every API process
sees them; each belongs to the key that created it (another key gets 404)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from api.tenancy import Tenant
from shared.errors import ErrorKind, RelayError
from shared.redis_keys import RedisKeys


def not_found(response_id: str, param: str | None = None) -> RelayError:
    return RelayError(ErrorKind.NOT_FOUND, f"Response with id '{response_id}' not found.", param)


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]  # this turn's input, each with an id
    conversation: list[dict[str, Any]]  # every item so far (earlier turns, this input, this output)
    owner: str | None
    # A background response until it ends: its request, the conversation before it, its job.
    request: dict[str, Any] | None = None
    earlier: list[dict[str, Any]] | None = None
    job_id: str | None = None

    @property
    def is_final(self) -> bool:
        return self.response["status"] in ("completed", "incomplete", "failed", "cancelled")


class ResponseStore:
    def __init__(self, redis: Redis, keys: RedisKeys, retention_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self._retention_s = retention_s

    async def save(self, stored: StoredResponse) -> None:
        record = {
            "response": stored.response, "input_items": stored.input_items, "conversation": stored.conversation,
            "owner": stored.owner, "request": stored.request, "earlier": stored.earlier, "job_id": stored.job_id,
        }  # fmt: skip
        key = self._keys.stored_response(stored.response["id"])
        await self._redis.set(key, json.dumps(record, ensure_ascii=False), ex=self._retention_s)

    async def get(self, response_id: str, tenant: Tenant, param: str | None = None) -> StoredResponse:
        raw = await self._redis.get(self._keys.stored_response(response_id))
        record = json.loads(raw) if raw is not None else None
        if record is None or not tenant.can_see(record.get("owner")):
            raise not_found(response_id, param)
        return StoredResponse(
            record["response"], record["input_items"], record["conversation"], record["owner"],
            record.get("request"), record.get("earlier"), record.get("job_id"),
        )  # fmt: skip

    async def delete(self, response_id: str, tenant: Tenant) -> None:
        await self.get(response_id, tenant)
        await self._redis.delete(self._keys.stored_response(response_id))
