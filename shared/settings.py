"""Settings both processes need, read once at start-up from flags and the environment."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.connection import RedisTarget, parse_addresses
from shared.redis_keys import RedisKeys

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RELAYLM_", extra="ignore")

    redis_url: str = Field(
        default=DEFAULT_REDIS_URL,
        validation_alias=AliasChoices("RELAYLM_REDIS_URL", "REDIS_URL", "redis_url"),
        description="Redis URL (redis:// or rediss://, with user:password@ if needed). Env: REDIS_URL.",
    )
    redis_sentinels: str | None = Field(
        default=None,
        description="Sentinels as host:port[,host:port...]: Redis is the primary they name for "
        "--redis-sentinel-service, followed through failovers (--redis-url then gives only the "
        "password, the database and TLS).",
    )
    redis_sentinel_service: str = Field(
        default="mymaster", min_length=1, description="The primary's service name, as the sentinels know it."
    )
    key_prefix: str = Field(
        default="relaylm", pattern=r"^[A-Za-z0-9_.\-]+$", description="Prefix of every relaylm key in Redis."
    )

    log_format: Literal["text", "json"] = Field(default="text", description="Log lines as text or as JSON objects.")

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinels_are_addresses(cls, value: str | None) -> str | None:
        if value is not None and value.strip():
            parse_addresses(value)
            return value
        return None

    @property
    def redis_target(self) -> RedisTarget:
        sentinels = parse_addresses(self.redis_sentinels) if self.redis_sentinels else ()
        return RedisTarget(self.redis_url, sentinels, self.redis_sentinel_service)

    @property
    def keys(self) -> RedisKeys:
        return RedisKeys(self.key_prefix)
