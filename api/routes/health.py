"""Liveness (``/health``: the process answers) and readiness (``/ready``: Redis answers and a
ready worker serves the model)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from api.services import services_of

router = APIRouter()


@router.get("/health", summary="Liveness: 200 while the API process runs")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/ready",
    summary="Readiness: Redis answers and a ready worker serves the model",
    responses={503: {"description": "Not ready: Redis unreachable, or no ready worker for the model"}},
)
async def ready(request: Request, model: str | None = None) -> JSONResponse:
    directory = services_of(request).directory
    try:
        await services_of(request).redis.ping()
        records = await directory.model_records()
        models = [model] if model else [record.model for record in records]
        ready_models = {}
        for name in models:
            adapter = await directory.adapters.record(name) if model else None  # an adapter is as ready as its base
            workers = await directory.workers(name if adapter is None else adapter.base)
            ready_models[name] = sum(worker.state == "ready" for worker in workers)
    except RedisError as exc:
        return JSONResponse({"status": "unavailable", "redis": f"unreachable: {exc}"}, status_code=503)
    is_ready = any(count > 0 for count in ready_models.values())
    body = {"status": "ready" if is_ready else "not_ready", "redis": "ok", "ready_workers": ready_models}
    return JSONResponse(body, status_code=200 if is_ready else 503)
