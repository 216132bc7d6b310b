"""``GET /metrics``: Prometheus text (API-side request metrics and every live worker's state)."""

from __future__ import annotations

from collections import Counter

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.jobs.worker_directory import WorkerDirectory
from api.metrics import Metrics
from api.services import services_of
from shared.job_lifecycle import JobLifecycle

router = APIRouter()
DEFAULT_TENANT = "default"  # the one tenant of a server without keys


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    state = services_of(request)
    await refresh_workers(state.metrics, state.directory, state.lifecycle)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def refresh_workers(metrics: Metrics, directory: WorkerDirectory, lifecycle: JobLifecycle) -> None:
    """Copy the registry into the gauges (workers that died disappear from the labels)."""
    for gauge in (
        metrics.running,
        metrics.waiting,
        metrics.kv_usage,
        metrics.prefix_hit_rate,
        metrics.queue_depth,
        metrics.backlog,
        metrics.queued_prefill,
        metrics.model_prefix_hit_rate,
        metrics.live_workers,
        metrics.images_encoded,
        metrics.image_cache_hits,
        metrics.vision_encode_seconds,
        metrics.spec_acceptance_rate,
        metrics.tenant_queued,
        metrics.tenant_running,
        metrics.tenant_rank,
        metrics.tenant_lead,
    ):
        gauge.clear()
    spills = await lifecycle.placement_spills()
    metrics.placement_spills.values = {(model,): count for model, count in spills.items()}
    drafted: dict[tuple[str, ...], float] = {}
    accepted: dict[tuple[str, ...], float] = {}
    records = await directory.model_records()
    for record in records:
        workers = await directory.workers(record.model)
        metrics.live_workers.labels(record.model).set(len(workers))
        metrics.queue_depth.labels(record.model).set(await directory.queue_depth(record.model))
        interactive, batch = await directory.backlog(record.model)
        metrics.backlog.labels(record.model, "interactive").set(interactive)
        metrics.backlog.labels(record.model, "batch").set(batch)
        for lane, queue in (("interactive", lifecycle.keys.queue), ("batch", lifecycle.keys.batch_queue)):
            tokens = await lifecycle.queued_prefill_tokens(queue(record.model))
            metrics.queued_prefill.labels(record.model, lane).set(tokens)
        if workers:
            mean_hit_rate = sum(worker.prefix_cache_hit_rate for worker in workers) / len(workers)
            metrics.model_prefix_hit_rate.labels(record.model).set(mean_hit_rate)
        for worker in workers:
            labels = (record.model, worker.worker_id)
            metrics.running.labels(*labels).set(worker.num_running)
            metrics.waiting.labels(*labels).set(worker.num_waiting)
            metrics.kv_usage.labels(*labels).set(worker.kv_cache_usage)
            metrics.prefix_hit_rate.labels(*labels).set(worker.prefix_cache_hit_rate)
            if worker.speculative != "off":
                drafted[labels] = worker.spec_decode_num_draft_tokens
                accepted[labels] = worker.spec_decode_num_accepted_tokens
                if worker.spec_decode_num_draft_tokens:
                    rate = worker.spec_decode_num_accepted_tokens / worker.spec_decode_num_draft_tokens
                    metrics.spec_acceptance_rate.labels(*labels).set(rate)
            if worker.vision:
                metrics.images_encoded.labels(*labels).set(worker.images_encoded)
                metrics.image_cache_hits.labels(*labels).set(worker.image_cache_hits)
                metrics.vision_encode_seconds.labels(*labels).set(worker.vision_encode_seconds)
    metrics.spec_draft_tokens.values = drafted
    metrics.spec_accepted_tokens.values = accepted
    await refresh_shares(metrics, [record.model for record in records], lifecycle)


async def refresh_shares(metrics: Metrics, models: list[str], lifecycle: JobLifecycle) -> None:
    """Copy each queue's fair share into the tenant gauges."""
    served: dict[tuple[str, ...], float] = {}
    for model in models:
        for lane, queue in (("interactive", lifecycle.keys.queue(model)), ("batch", lifecycle.keys.batch_queue(model))):
            for share in await lifecycle.shares(queue):
                labels = (model, lane, share.tenant or DEFAULT_TENANT)
                served[labels] = share.served_tokens
                if share.rank is not None:
                    metrics.tenant_queued.labels(*labels).set(share.queued)
                    metrics.tenant_rank.labels(*labels).set(share.rank)
                    metrics.tenant_lead.labels(*labels).set(share.lead)
            for tenant, count in Counter(await lifecycle.running_tenants(queue)).items():
                metrics.tenant_running.labels(model, lane, tenant or DEFAULT_TENANT).set(count)
    metrics.tenant_served.values = served
