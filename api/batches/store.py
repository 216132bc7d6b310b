"""Batch records in Redis, and the per-batch lock that lets exactly one API process change a
batch at a time (the others skip it, or wait briefly for a cancel)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.asyncio import Redis

from api.batches.record_index import page_of_records
from api.tenancy import SINGLE_USER, Tenant
from api.wire.openai.batch import TERMINAL_STATUSES, Batch
from shared.errors import ErrorKind, RelayError
from shared.redis import NO_REPLICA_ACK, ReplicaAck
from shared.redis_keys import RedisKeys
from shared.redis_replies import texts

# Long enough for one advance of a batch; a process that dies holding it frees it after this.
_LOCK_TTL_MS = 15_000
_RELEASE_IF_OURS = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def not_found(batch_id: str) -> RelayError:
    return RelayError(ErrorKind.NOT_FOUND, f"No batch with id `{batch_id}` (it never existed, or expired).", "batch_id")


class StoredBatch(Batch):
    """The batch as kept in Redis: the public object plus what only the API needs."""

    owner: str | None = None  # the owner id of the key that created it; None without keys
    owner_weight: float = 1.0  # that key's terms in the fair share, for its lines
    owner_ranks_across_tenants: bool = False
    num_lines: int = 0  # lines of its input file, known at creation (before validation counts them)

    def public(self) -> Batch:
        return Batch.model_validate(
            self.model_dump(exclude={"owner", "owner_weight", "owner_ranks_across_tenants", "num_lines"})
        )

    @property
    def tenant(self) -> Tenant:
        """The key that created it, as its lines run: with its terms, seeing only its own."""
        return Tenant(self.owner, False, self.owner_weight, self.owner_ranks_across_tenants)

    @property
    def lines_left(self) -> int:
        """Lines still to run or running (what the per-key batch line limit counts)."""
        counts = self.request_counts
        total = counts.total or self.num_lines
        return max(0, total - counts.completed - counts.failed)


class BatchStore:
    def __init__(
        self, redis: Redis, keys: RedisKeys, retention_s: int, replica_ack: ReplicaAck = NO_REPLICA_ACK
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._retention_s = retention_s
        self._replica_ack = replica_ack
        self._release = redis.register_script(_RELEASE_IF_OURS)

    async def create(self, batch: StoredBatch) -> None:
        keys = self._keys
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.batch(batch.id), batch.model_dump_json())
            pipe.zadd(keys.batches(), {batch.id: batch.created_at})
            pipe.sadd(keys.active_batches(), batch.id)
            await pipe.execute()
        await self._replica_ack.confirm(self._redis, f"batch {batch.id}")

    async def get(self, batch_id: str, tenant: Tenant = SINGLE_USER) -> StoredBatch:
        """The batch, if ``tenant`` may see it (404 otherwise, as for no batch at all)."""
        raw = await self._redis.get(self._keys.batch(batch_id))
        batch = StoredBatch.model_validate_json(raw) if raw is not None else None
        if batch is None or not tenant.can_see(batch.owner):
            raise not_found(batch_id)
        return batch

    async def save(self, batch: StoredBatch) -> None:
        """Write the record; a final batch leaves the active set and expires with its results."""
        keys = self._keys
        async with self._redis.pipeline(transaction=True) as pipe:
            if batch.status in TERMINAL_STATUSES:
                pipe.set(keys.batch(batch.id), batch.model_dump_json(), ex=self._retention_s)
                pipe.srem(keys.active_batches(), batch.id)
                pipe.delete(*keys.batch_keys(batch.id))
            else:
                pipe.set(keys.batch(batch.id), batch.model_dump_json())
            await pipe.execute()

    async def active_ids(self) -> list[str]:
        return sorted(texts(await self._redis.smembers(self._keys.active_batches())))

    async def list(self, limit: int, after: str | None, tenant: Tenant = SINGLE_USER) -> tuple[list[Batch], bool]:
        """The batches ``tenant`` may see, newest first, after the batch ``after``."""
        batches, has_more = await page_of_records(
            self._redis, self._keys.batches(), self._keys.batch, StoredBatch.model_validate_json, limit, after,
            keep=lambda batch: tenant.can_see(batch.owner),
        )  # fmt: skip
        return [batch.public() for batch in batches], has_more

    async def lines_left(self, owner: str | None) -> int:
        """Batch lines the owner's unfinished batches still have to run."""
        left = 0
        for batch_id in await self.active_ids():
            raw = await self._redis.get(self._keys.batch(batch_id))
            if raw is not None:
                batch = StoredBatch.model_validate_json(raw)
                if batch.owner == owner:
                    left += batch.lines_left
        return left

    @asynccontextmanager
    async def locked(self, batch_id: str, wait_s: float = 0.0) -> AsyncIterator[bool]:
        """Yields whether this process holds the batch's lock (trying for up to ``wait_s``)."""
        key, token = self._keys.batch_lock(batch_id), uuid.uuid4().hex
        deadline = time.monotonic() + wait_s
        while not (held := bool(await self._redis.set(key, token, nx=True, px=_LOCK_TTL_MS))):
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        try:
            yield held
        finally:
            if held:
                await self._release(keys=[key], args=[token])
