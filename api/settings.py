"""API settings: flags > RELAYLM_* environment > defaults, read once at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network, ip_network
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from shared.adapters import DEFAULT_MAX_BYTES
from shared.settings import CommonSettings


@dataclass(frozen=True)
class ApiKey:
    """A key a client may use, and its terms in the fair share (``shared.fair_share``)."""

    key: str
    weight: float = 1.0
    ranks_across_tenants: bool = False

    @classmethod
    def parse(cls, line: str, where: str) -> ApiKey:
        """``<key> [weight=W] [priority=global]``."""
        key, *options = line.split()
        weight, ranks = 1.0, False
        for option in options:
            name, _, value = option.partition("=")
            if name == "weight":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
                if not 0.01 <= weight <= 1000:
                    raise ValueError(f"{where}: weight must be a number from 0.01 to 1000, not {value!r}")
            elif option == "priority=global":
                ranks = True
            else:
                raise ValueError(f"{where}: unknown key option {option!r} (weight=W or priority=global)")
        return cls(key, weight, ranks)


class ApiSettings(CommonSettings):
    host: str = Field(default="127.0.0.1", description="Interface to listen on (0.0.0.0 for all).")
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port.")
    liveness_check_interval_s: float = Field(
        default=1.0, gt=0, description="While a job is silent this long, check that its worker still lives."
    )
    fair_share: bool = Field(
        default=True,
        description="Serve each queue's waiting jobs by fair share between API keys (the key with the least weighted "
        "tokens served goes next); off: first come, first served (by priority).",
    )
    placement_window_s: float = Field(
        default=2.0,
        ge=0,
        description="How long a chat or completion job waits for the live worker whose prefix cache holds the most "
        "of its conversation or prompt (it claimed an earlier turn, or a prompt this one extends), while that "
        "worker is ready with a free slot; after that, or at once when it is gone, draining or full, any worker of "
        "the model takes it. 0: no placement (the first worker to ask takes each job).",
    )
    no_worker_grace_s: float = Field(
        default=3.0,
        ge=0,
        description="A queued job whose model has no ready worker this long (none, or all still loading) fails "
        "with 503.",
    )
    redis_replica_wait_ms: int = Field(
        default=500,
        ge=0,
        description="Under Sentinel or Cluster, how long accepting a job, a batch or a file waits for a replica to "
        "have it (WAIT 1), so that a failover cannot lose it; past it the request is accepted anyway, with a "
        "warning. 0: no wait.",
    )
    redis_failover_wait_s: float = Field(
        default=45.0,
        ge=0,
        description="Under Sentinel or Cluster, how long an open stream waits for Redis to answer again (a "
        "failover: the sentinels' down-after-milliseconds or the cluster-node-timeout, plus the election); once it "
        "does, the stream reads what it missed from the job's log, past it the stream ends with redis_unavailable. "
        "With one Redis a stream ends at once.",
    )
    sse_ping_interval_s: float = Field(default=15.0, gt=0, description="SSE keep-alive comment period.")
    api_keys: str | None = Field(
        default=None, description="Comma-separated API keys; when any is set, every route but /health needs one."
    )
    api_key_file: Path | None = Field(
        default=None,
        description="File with one API key per line (# comments allowed), each optionally followed by `weight=W` (its "
        "share of the engine against other keys', default 1) and `priority=global` (its requests' `priority` ranks "
        "them before other keys' fair share).",
    )
    admin_api_keys: str | None = Field(
        default=None,
        description="Comma-separated admin keys: they see and manage every key's files, batches and jobs.",
    )
    owner_hash_secret: str | None = Field(
        default=None,
        description="Secret for the keyed hash (HMAC-SHA256) that names a key's owner in Redis; none: one is "
        "generated and kept in Redis. Set it so that reading Redis does not allow guessing keys.",
    )
    max_requests_per_key: int = Field(
        default=0,
        ge=0,
        description="Requests (chat, completion, embedding, background) one API key may have queued or running "
        "at once, over all API processes; past it, 429 + Retry-After. 0: no limit.",
    )
    max_batch_lines_per_key: int = Field(
        default=0,
        ge=0,
        description="Batch lines one API key may have waiting or running over its unfinished batches; a batch "
        "that would pass it is refused with 429 + Retry-After. 0: no limit.",
    )
    metrics_public: bool = Field(default=False, description="Serve /metrics without an API key (for scrapers).")
    cors_allow_origins: str | None = Field(
        default=None, description="Comma-separated origins allowed by CORS ('*' for any); none: no CORS headers."
    )
    max_body_bytes: int = Field(default=16 * 2**20, ge=1024, description="Largest request body; larger gets 413.")
    max_messages: int = Field(default=2048, ge=1, description="Most messages in one chat request.")
    max_tools: int = Field(default=128, ge=0, description="Most tools in one chat request.")
    max_pending_per_model: int = Field(
        default=1024, ge=1, description="Jobs queued or running per model (all workers); past it, 429 + Retry-After."
    )
    retry_after_s: int = Field(
        default=2, ge=1, description="Retry-After seconds sent with a queue-full 429 and a draining 503."
    )
    log_prompts: bool = Field(default=False, description="Log each request's messages (off: prompts never reach logs).")
    reasoning_field: Literal["reasoning_content", "reasoning"] = Field(
        default="reasoning_content",
        description="Field for reasoning text; clients differ (DeepSeek-style reasoning_content, vLLM reasoning).",
    )
    drain_timeout_s: float = Field(
        default=30.0, ge=0, description="On SIGTERM: how long open streams may finish before they are closed."
    )
    max_audio_bytes: int = Field(
        default=25 * 2**20, ge=1024, description="Largest audio upload (/v1/audio/*; OpenAI's 25 MB); larger gets 413."
    )
    max_audio_seconds: float = Field(
        default=3600.0,
        gt=0,
        description="Longest audio transcribed or translated (decoded samples wait in Redis); longer gets 400.",
    )
    audio_window_s: float = Field(
        default=120.0,
        ge=30.0,
        le=1800.0,
        description="Longest transcription window: recordings are cut at quiet moments into windows of at most "
        "this, one job each, which the model's workers share; a shorter recording is one window. Each window "
        "costs about one extra 30 s encoder pass, so shorter windows spread a long file over more workers "
        "but do more work in all.",
    )
    max_images_per_request: int = Field(
        default=16, ge=1, description="Most images in one chat, Responses or Messages request; more gets 400."
    )
    max_image_bytes: int = Field(
        default=20 * 2**20,
        ge=1024,
        description="Largest image (data: URL, download or file), in bytes; larger gets 400.",
    )
    max_image_pixels: int = Field(
        default=40_000_000,
        ge=1,
        # Pillow's own decompression-bomb limit: past it, Pillow refuses before this check could run.
        le=89_478_485,
        description="Largest image as width x height once decoded (a small file can decode huge); larger gets 400.",
    )
    allow_remote_images: bool = Field(
        default=False,
        description="Fetch http(s) image URLs (off: only data: URLs and uploaded files). Private, loopback, "
        "link-local and other non-public addresses are refused unless in --allowed-image-networks.",
    )
    allowed_image_networks: str | None = Field(
        default=None,
        description="Comma-separated CIDRs (e.g. 10.0.5.0/24,fd00::/64) that remote image fetches may reach "
        "although they are not public addresses: an internal image host.",
    )
    image_fetch_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Longest one remote image may take: name lookups, connections, redirects and the download.",
    )
    max_file_bytes: int = Field(
        default=200 * 2**20, ge=1024, description="Largest file upload (/v1/files); files live in Redis memory."
    )
    max_lora_bytes: int = Field(
        default=DEFAULT_MAX_BYTES,
        ge=1024,
        description="Largest LoRA adapter (both files) /v1/load_lora_adapter stores; adapters live in Redis memory.",
    )
    file_retention_s: int = Field(
        default=30 * 24 * 3600, ge=60, description="Files (batch input, output and error files) expire after this."
    )
    result_retention_s: int = Field(
        default=24 * 3600, ge=60, description="Background jobs' results and finished batches expire after this."
    )
    batch_max_requests: int = Field(default=50_000, ge=1, description="Most lines in one batch input file.")
    batch_concurrency: int = Field(
        default=256, ge=1, description="Lines of one batch queued or running at once (the rest wait in Redis)."
    )
    batch_poll_interval_s: float = Field(
        default=0.5,
        gt=0,
        description="How often an API process advances batches and does its job housekeeping (requeues dead "
        "workers' jobs, fails jobs left without a worker, collects background results).",
    )
    keep_alive_timeout_s: float = Field(
        default=75.0,
        gt=0,
        description="Idle HTTP keep-alive before the server closes a connection; longer than clients' pools keep "
        "one (httpx: 5 s), so a reused connection is never closed under a request.",
    )
    log_level: str = Field(default="INFO", description="Python log level.")

    @field_validator("allowed_image_networks")
    @classmethod
    def _networks_are_cidrs(cls, value: str | None) -> str | None:
        """A typo in an allowlist must stop the server at start-up, not quietly allow nothing."""
        _parse_networks(value)
        return value

    @property
    def image_networks(self) -> list[IPv4Network | IPv6Network]:
        return _parse_networks(self.allowed_image_networks)

    def load_admin_api_keys(self) -> list[str]:
        return [key.strip() for key in (self.admin_api_keys or "").split(",") if key.strip()]

    def load_api_keys(self) -> list[ApiKey]:
        """Keys from --api-keys and --api-key-file, read once at start-up; ValueError for a key
        file line it cannot read."""
        keys = [ApiKey(key.strip()) for key in (self.api_keys or "").split(",") if key.strip()]
        if self.api_key_file is not None:
            for number, line in enumerate(self.api_key_file.read_text().splitlines(), start=1):
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(ApiKey.parse(line, f"{self.api_key_file}:{number}"))
        return keys

    @property
    def cors_origins(self) -> list[str]:
        return [origin.strip() for origin in (self.cors_allow_origins or "").split(",") if origin.strip()]


def _parse_networks(value: str | None) -> list[IPv4Network | IPv6Network]:
    """Each CIDR exactly (``10.0.0.1/8`` has host bits set: ValueError, as it is likely a typo)."""
    networks = []
    for text in (value or "").split(","):
        if text.strip():
            try:
                networks.append(ip_network(text.strip(), strict=True))
            except ValueError as exc:
                raise ValueError(f"not a network in CIDR notation: {text.strip()!r} ({exc})") from None
    return networks
