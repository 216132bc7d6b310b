"""Who is asking: the API key a request came with, named by a keyed hash, and what it may see.

Every file, batch and job records the owner that created it; another key gets 404 for it (not
403: it must not learn that the object exists). Admin keys see everything. With no keys
configured there is one user, who sees everything, as before keys existed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.requests import Request

from api.settings import ApiKey
from shared.errors import ErrorKind, RelayError
from shared.redis_keys import RedisKeys
from shared.redis_replies import as_bytes

# Hex digits of the HMAC kept as the owner id: 128 bits, no collision between real keys.
_OWNER_ID_CHARS = 32
# A secret read from Redis is used this long before it is read again: a Redis that lost its
# data gets the one secret back (the first process to ask after it writes it), so API processes
# never disagree for longer than this about who owns what.
_SECRET_REUSE_S = 1.0
# The stored secret, or this new one when there is none (one round trip, on any Redis version).
_GET_OR_SET = """
local stored = redis.call('GET', KEYS[1])
if stored then return stored end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
"""


@dataclass(frozen=True)
class Tenant:
    owner: str | None  # None: the server has no keys (one user)
    is_admin: bool
    weight: float = 1.0  # its share of the engine against other keys' (shared.fair_share)
    ranks_across_tenants: bool = False  # its requests' priority ranks them before other keys' shares

    def can_see(self, owner: str | None) -> bool:
        return self.is_admin or owner == self.owner


SINGLE_USER = Tenant(owner=None, is_admin=True)


def tenant_of(request: Request) -> Tenant:
    """The tenant the key middleware found for this request (the single user without keys)."""
    tenant = request.scope.get("state", {}).get("tenant")
    return tenant if isinstance(tenant, Tenant) else SINGLE_USER


class KeyRing:
    """The configured keys, and the owner id of each: HMAC-SHA256 of the key under a secret that
    every API process shares (so a key's objects are found from any of them), never the key."""

    def __init__(
        self, api_keys: list[ApiKey], admin_keys: list[str], redis: Redis, keys: RedisKeys, secret: str | None
    ) -> None:
        admins = [ApiKey(key) for key in admin_keys]
        self._entries = [(entry.key.encode(), False) for entry in api_keys] + [
            (entry.key.encode(), True) for entry in admins
        ]
        self._terms = {entry.key.encode(): entry for entry in [*api_keys, *admins]}
        self._redis = redis
        self._keys = keys
        self._configured_secret = secret.encode() if secret else None
        self._stored_secret: tuple[bytes, float] | None = None  # (secret, read at)
        self._get_or_set = redis.register_script(_GET_OR_SET)

    @property
    def is_empty(self) -> bool:
        return not self._entries

    def match(self, token: bytes) -> tuple[bytes, bool] | None:
        """The configured key equal to ``token`` and whether it is an admin's. Every key is
        compared, always, so timing reveals neither a match nor which key."""
        found: tuple[bytes, bool] | None = None
        for key, is_admin in self._entries:
            if hmac.compare_digest(token, key) and found is None:
                found = (key, is_admin)
        return found

    async def tenant(self, key: bytes, is_admin: bool) -> Tenant:
        secret = await self._secret()
        owner = hmac.new(secret, key, hashlib.sha256).hexdigest()[:_OWNER_ID_CHARS]
        terms = self._terms[key]
        return Tenant(owner, is_admin, terms.weight, terms.ranks_across_tenants)

    async def _secret(self) -> bytes:
        if self._configured_secret is not None:
            return self._configured_secret
        now = time.monotonic()
        if self._stored_secret is not None and now - self._stored_secret[1] < _SECRET_REUSE_S:
            return self._stored_secret[0]
        try:
            stored = await self._get_or_set(keys=[self._keys.owner_hash_secret()], args=[secrets.token_hex(32)])
        except RedisError as exc:
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc
        self._stored_secret = (as_bytes(stored), now)
        return self._stored_secret[0]
