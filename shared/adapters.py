"""LoRA adapters stored in Redis, so that every worker of their base model, on any host, serves
them without a shared filesystem: a record per adapter (which base model, its files' SHA-256 and
size) and its PEFT files beside it. Workers fetch the files on an adapter's first request and
check them against the record's digest; the API lists, resolves and (for admin keys) stores
and deletes them."""

from __future__ import annotations

import hashlib
import re
import time

from pydantic import BaseModel, Field
from redis.asyncio import Redis

from shared.redis_keys import RedisKeys

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
"""What an adapter may be called (it is a model name to clients, and part of a Redis key)."""
DEFAULT_MAX_BYTES = 256 * 2**20
"""The largest adapter (both files) stored by default: rank 64 on every target of an 8B model is ~170 MB."""


class AdapterRecord(BaseModel):
    name: str
    base: str = Field(description="The model it adapts: jobs for it run on that model's workers.")
    sha256: str = Field(description="Of the config's bytes followed by the weights'.")
    size: int = Field(description="Bytes of both files.")
    rank: int
    targets: list[str]
    created: float


def digest(config: bytes, weights: bytes) -> str:
    return hashlib.sha256(config + weights).hexdigest()


class AdapterStore:
    def __init__(self, redis: Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._keys = keys

    async def record(self, name: str) -> AdapterRecord | None:
        raw = await self._redis.hget(self._keys.adapters(), name)
        return None if raw is None else AdapterRecord.model_validate_json(raw)

    async def records(self) -> list[AdapterRecord]:
        raw = await self._redis.hvals(self._keys.adapters())
        return sorted((AdapterRecord.model_validate_json(item) for item in raw), key=lambda r: r.name)

    async def files(self, record: AdapterRecord) -> tuple[bytes, bytes] | None:
        """The adapter's config and weights, as stored under ``record``; None when they are gone
        or are another adapter's now (unloaded and stored again under the name)."""
        config, weights = await self._redis.hmget(self._keys.adapter_files(record.name), ["config", "weights"])
        if not isinstance(config, bytes) or not isinstance(weights, bytes) or digest(config, weights) != record.sha256:
            return None
        return config, weights

    async def put(
        self, name: str, base: str, config: bytes, weights: bytes, rank: int, targets: list[str]
    ) -> AdapterRecord:
        """Store (or replace) an adapter: files first, then its record, in one transaction."""
        record = AdapterRecord(
            name=name, base=base, sha256=digest(config, weights), size=len(config) + len(weights), rank=rank,
            targets=sorted(targets), created=time.time(),
        )  # fmt: skip
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._keys.adapter_files(name), mapping={"config": config, "weights": weights})
            pipe.hset(self._keys.adapters(), name, record.model_dump_json())
            await pipe.execute()
        return record

    async def ensure(self, name: str, base: str, config: bytes, weights: bytes, rank: int, targets: list[str]) -> bool:
        """``put``, unless these files are stored under ``name`` for ``base`` already (a worker
        started with ``--lora`` then writes nothing at its next start); True when it stored them."""
        found = await self.record(name)
        if found is not None and found.base == base and found.sha256 == digest(config, weights):
            # ``put`` writes a record and its files in one transaction: files of the record's size
            # under the name are the record's.
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hstrlen(self._keys.adapter_files(name), "config")
                pipe.hstrlen(self._keys.adapter_files(name), "weights")
                config_len, weights_len = await pipe.execute()
            if (config_len, weights_len) == (len(config), len(weights)):
                return False
        await self.put(name, base, config, weights, rank, targets)
        return True

    async def delete(self, name: str) -> bool:
        """Remove an adapter; False when there was none."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._keys.adapters(), name)
            pipe.delete(self._keys.adapter_files(name))
            removed, _ = await pipe.execute()
        return bool(removed)
