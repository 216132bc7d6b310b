"""Uploaded and generated files (``/v1/files``), kept in Redis so that every API process sees
them and none holds state of its own. Each file's bytes and metadata expire together. A file
belongs to the key that uploaded it (or whose batch wrote it): another key gets 404."""

from __future__ import annotations

import time
import uuid

from redis.asyncio import Redis

from api.batches.record_index import page_of_records
from api.tenancy import SINGLE_USER, Tenant
from api.wire.openai.batch import FileObject, FilePurpose
from shared.errors import ErrorKind, RelayError
from shared.redis import NO_REPLICA_ACK, ReplicaAck
from shared.redis_keys import RedisKeys
from shared.redis_replies import as_bytes


def not_found(file_id: str) -> RelayError:
    return RelayError(ErrorKind.NOT_FOUND, f"No file with id `{file_id}` (it never existed, or expired).", "file_id")


class StoredFile(FileObject):
    """The metadata as kept in Redis: the public object plus what only the API needs."""

    owner: str | None = None  # the owner id of the key that created it; None without keys
    num_lines: int = 0  # non-empty lines (what a batch of it will queue)

    def public(self) -> FileObject:
        return FileObject.model_validate(self.model_dump(exclude={"owner", "num_lines"}))


class FileStore:
    def __init__(
        self, redis: Redis, keys: RedisKeys, retention_s: int, replica_ack: ReplicaAck = NO_REPLICA_ACK
    ) -> None:
        self._redis = redis
        self._keys = keys
        self.retention_s = retention_s
        self._replica_ack = replica_ack

    async def create(
        self, content: bytes, filename: str, purpose: FilePurpose, ttl_s: int | None = None, owner: str | None = None
    ) -> FileObject:
        now = int(time.time())
        ttl_s = ttl_s or self.retention_s
        meta = StoredFile(
            id=f"file-{uuid.uuid4().hex}",
            bytes=len(content),
            created_at=now,
            expires_at=now + ttl_s,
            filename=filename,
            purpose=purpose,
            owner=owner,
            num_lines=sum(1 for line in content.splitlines() if line.strip()),
        )
        keys = self._keys
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.file_content(meta.id), content, ex=ttl_s)
            pipe.set(keys.file_meta(meta.id), meta.model_dump_json(), ex=ttl_s)
            pipe.zadd(keys.files(), {meta.id: now})
            await pipe.execute()
        await self._replica_ack.confirm(self._redis, f"file {meta.id}")
        return meta.public()

    async def get(self, file_id: str, tenant: Tenant = SINGLE_USER) -> StoredFile:
        """The file's record, if ``tenant`` may see it (404 otherwise, as for no file at all)."""
        raw = await self._redis.get(self._keys.file_meta(file_id))
        meta = StoredFile.model_validate_json(raw) if raw is not None else None
        if meta is None or not tenant.can_see(meta.owner):
            raise not_found(file_id)
        return meta

    async def content(self, file_id: str, tenant: Tenant = SINGLE_USER) -> bytes:
        await self.get(file_id, tenant)
        content = await self._redis.get(self._keys.file_content(file_id))
        if content is None:
            raise not_found(file_id)
        return as_bytes(content)

    async def delete(self, file_id: str, tenant: Tenant = SINGLE_USER) -> None:
        await self.get(file_id, tenant)
        keys = self._keys
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.file_meta(file_id), keys.file_content(file_id))
            pipe.zrem(keys.files(), file_id)
            deleted, _ = await pipe.execute()
        if not deleted:
            raise not_found(file_id)

    async def list(
        self, purpose: str | None, limit: int, after: str | None, newest_first: bool, tenant: Tenant = SINGLE_USER
    ) -> tuple[list[FileObject], bool]:
        """A page of the files ``tenant`` may see (and whether more follow)."""
        files, has_more = await page_of_records(
            self._redis, self._keys.files(), self._keys.file_meta, StoredFile.model_validate_json, limit, after,
            newest_first, keep=lambda meta: (purpose is None or meta.purpose == purpose) and tenant.can_see(meta.owner),
        )  # fmt: skip
        return [meta.public() for meta in files], has_more
