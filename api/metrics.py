"""Prometheus metrics, named like vLLM's (``vllm:`` → ``relaylm:``) so dashboards adapt easily.

Request latencies and token counts are measured in the API, where the client's view is. Worker
state (running and waiting sequences, KV-cache use, prefix-cache hits) comes from the registry
heartbeats in Redis and is refreshed on each scrape: one ``/metrics`` on any API process shows
every worker, and workers expose no port of their own.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS_S = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ReportedCounter(Collector):
    """A counter kept outside this process (in Redis for the whole deployment, or in each
    worker's heartbeat), copied in on each scrape: ``values`` by label values."""

    def __init__(self, name: str, documentation: str, labels: list[str], registry: CollectorRegistry) -> None:
        self._name, self._documentation, self._labels = name, documentation, labels
        self.values: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labels)
        for label_values, value in sorted(self.values.items()):
            family.add_metric(list(label_values), value)
        yield family


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "relaylm:http_requests", "HTTP requests by route and status", ["route", "method", "status"], registry=r
        )
        self.ttft = Histogram(
            "relaylm:time_to_first_token_seconds", "Request arrival to first token", ["model"],
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "relaylm:inter_token_latency_seconds", "Gap between streamed token deltas", ["model"],
            buckets=_ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "relaylm:e2e_request_latency_seconds", "Request arrival to last event", ["model"],
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.queue_time = Histogram(
            "relaylm:request_queue_time_seconds", "Enqueue to a worker starting the job", ["model"],
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("relaylm:prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.generation_tokens = Counter("relaylm:generation_tokens", "Tokens generated", ["model"], registry=r)
        self.request_success = Counter(
            "relaylm:request_success", "Finished requests by finish reason", ["model", "finished_reason"], registry=r
        )
        self.request_failure = Counter(
            "relaylm:request_failure", "Requests ended by an error, by code", ["model", "code"], registry=r
        )
        self.placements = Counter(
            "relaylm:placements",
            "Chat and completion jobs by placement: matched (left to the worker that holds most of its conversation "
            "or prompt for the placement window), none (any worker's)",
            ["model", "outcome"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "relaylm:queue_depth", "Interactive jobs queued or running per model", ["model"], registry=r
        )
        self.audio_seconds = Counter(
            "relaylm:audio_seconds", "Seconds of audio transcribed or translated", ["model", "task"], registry=r
        )
        self.audio_real_time_factor = Histogram(
            "relaylm:audio_real_time_factor", "Request wall time per second of audio (below 1: faster than real time)",
            ["model"], buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5), registry=r,
        )  # fmt: skip
        self.images = Counter(
            "relaylm:images", "Images taken into requests, by where they came from (data, remote, file)", ["source"],
            registry=r,
        )  # fmt: skip
        self.request_images = Histogram(
            "relaylm:request_images", "Images in one request that has any", buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )  # fmt: skip
        self.image_refusals = Counter(
            "relaylm:image_refusals", "Image parts refused (the request got 400), by reason", ["reason"], registry=r
        )
        self.image_fetch_time = Histogram(
            "relaylm:image_fetch_seconds", "Fetching one remote image (lookups, redirects and download)",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.unreplicated_writes = Counter(
            "relaylm:redis_unreplicated_writes",
            "Jobs, batches and files accepted before a replica acknowledged them (a failover could lose them)",
            registry=r,
        )
        self.backlog = Gauge(
            "relaylm:queue_backlog",
            "Jobs queued and not yet claimed per model, by lane (interactive, batch): what to scale workers on",
            ["model", "lane"],
            registry=r,
        )
        self.placement_spills = ReportedCounter(
            "relaylm:placements_spilled",
            "Chat and completion jobs claimed by a worker other than the one they were placed on: the placement "
            "window ended, or that worker was gone, draining or full (deployment-wide: every API process reports the "
            "same count)",
            ["model"],
            registry=r,
        )
        self.queued_prefill = Gauge(
            "relaylm:queue_prefill_tokens",
            "Prompt tokens of the jobs queued per model, by lane (estimated at 4 characters a token before any "
            "tokenizer sees them): the prefill work waiting, what to scale workers on for long prompts",
            ["model", "lane"],
            registry=r,
        )
        self.model_prefix_hit_rate = Gauge(
            "relaylm:model_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache (0-1), the mean over a model's live workers",
            ["model"],
            registry=r,
        )
        self.live_workers = Gauge("relaylm:live_workers", "Workers heartbeating per model", ["model"], registry=r)
        worker_labels = ["model", "worker"]
        self.running = Gauge("relaylm:num_requests_running", "Sequences in the batch", worker_labels, registry=r)
        self.waiting = Gauge(
            "relaylm:num_requests_waiting", "Sequences waiting in the engine", worker_labels, registry=r
        )
        self.kv_usage = Gauge(
            "relaylm:kv_cache_usage_perc", "Share of the KV budget's blocks held (0-1)", worker_labels, registry=r
        )
        self.prefix_hit_rate = Gauge(
            "relaylm:prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache (0-1)",
            worker_labels,
            registry=r,
        )
        # A vision worker's own counts since it started (read from its heartbeat, so gauges).
        self.images_encoded = Gauge(
            "relaylm:images_encoded", "Images a worker's vision tower encoded", worker_labels, registry=r
        )
        self.image_cache_hits = Gauge(
            "relaylm:image_cache_hits", "Images served from a worker's image-embedding cache", worker_labels, registry=r
        )
        self.vision_encode_seconds = Gauge(
            "relaylm:vision_encode_seconds", "Time a worker's vision tower spent encoding", worker_labels, registry=r
        )
        # Speculation, under vLLM's names: tokens drafted and drafted tokens kept, per worker since it started.
        self.spec_draft_tokens = ReportedCounter(
            "relaylm:spec_decode_num_draft_tokens",
            "Tokens a worker drafted (n-gram speculation)",
            worker_labels,
            registry=r,
        )
        self.spec_accepted_tokens = ReportedCounter(
            "relaylm:spec_decode_num_accepted_tokens",
            "Drafted tokens a worker kept: each was the token sampled at its position",
            worker_labels,
            registry=r,
        )
        self.spec_acceptance_rate = Gauge(
            "relaylm:spec_decode_draft_acceptance_rate",
            "Share of a worker's drafted tokens it kept, since it started",
            worker_labels,
            registry=r,
        )

        # The fair share, per queue and tenant (the keyed hash of its API key; `default` without keys).
        tenant_labels = ["model", "lane", "tenant"]
        self.tenant_queued = Gauge(
            "relaylm:tenant_queued_jobs", "Jobs a tenant has queued, not yet claimed", tenant_labels, registry=r
        )
        self.tenant_running = Gauge(
            "relaylm:tenant_running_jobs", "Jobs of a tenant that workers are running", tenant_labels, registry=r
        )
        self.tenant_served = ReportedCounter(
            "relaylm:tenant_served_tokens",
            "Prompt and output tokens served to a tenant's jobs (deployment-wide, since Redis last lost its data)",
            tenant_labels,
            registry=r,
        )
        self.tenant_rank = Gauge(
            "relaylm:tenant_fair_share_rank",
            "A waiting tenant's place by service: 0 has the least and is served next (within a priority band)",
            tenant_labels,
            registry=r,
        )
        self.tenant_lead = Gauge(
            "relaylm:tenant_service_lead",
            "A waiting tenant's service above the least served waiting tenant's, in tokens weighted by cost (an "
            "output token counts 2, a prompt token 1) and divided by its key's weight",
            tenant_labels,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
