"""Settings both processes need, read once at start-up from flags and the environment."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.redis import RedisTarget, parse_addresses
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
    redis_cluster_nodes: str | None = Field(
        default=None,
        description="Redis Cluster nodes as host:port[,host:port...] (any that answer; the rest are "
        "learned from them): every key shares the hash tag {<key prefix>}, so relaylm follows the "
        "one primary serving its slot through failovers (--redis-url then gives only the password "
        "and TLS; the database must be 0).",
    )
    key_prefix: str = Field(
        default="relaylm", pattern=r"^[A-Za-z0-9_.\-]+$", description="Prefix of every relaylm key in Redis."
    )

    log_format: Literal["text", "json"] = Field(default="text", description="Log lines as text or as JSON objects.")

    @field_validator("redis_sentinels", "redis_cluster_nodes")
    @classmethod
    def _addresses(cls, value: str | None) -> str | None:
        if value is not None and value.strip():
            parse_addresses(value)
            return value
        return None

    @model_validator(mode="after")
    def _one_topology(self) -> CommonSettings:
        if self.redis_sentinels and self.redis_cluster_nodes:
            raise ValueError("give --redis-sentinels or --redis-cluster-nodes, not both")
        if self.redis_cluster_nodes and self.redis_target.primary_options.get("db", 0) != 0:
            raise ValueError("Redis Cluster has only database 0: --redis-url must not name another")
        return self

    @property
    def redis_target(self) -> RedisTarget:
        sentinels = parse_addresses(self.redis_sentinels) if self.redis_sentinels else ()
        nodes = parse_addresses(self.redis_cluster_nodes) if self.redis_cluster_nodes else ()
        return RedisTarget(self.redis_url, sentinels, self.redis_sentinel_service, nodes, self.key_prefix)

    @property
    def keys(self) -> RedisKeys:
        if self.redis_cluster_nodes:
            return RedisKeys.in_cluster(self.key_prefix)
        return RedisKeys(self.key_prefix)
