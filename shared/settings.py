"""Settings both processes need, read once at start-up from flags and the environment."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.redis_keys import RedisKeys

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RELAYLM_", extra="ignore")

    redis_url: str = Field(
        default=DEFAULT_REDIS_URL,
        validation_alias=AliasChoices("RELAYLM_REDIS_URL", "REDIS_URL", "redis_url"),
        description="Redis URL (redis:// or rediss://, with user:password@ if needed). Env: REDIS_URL.",
    )
    key_prefix: str = Field(
        default="relaylm", pattern=r"^[A-Za-z0-9_.\-]+$", description="Prefix of every relaylm key in Redis."
    )

    log_format: Literal["text", "json"] = Field(default="text", description="Log lines as text or as JSON objects.")

    @property
    def keys(self) -> RedisKeys:
        return RedisKeys(self.key_prefix)
