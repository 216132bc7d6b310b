"""``GET /metrics``: Prometheus text (API-side request metrics and every live worker's state)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter()


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    state = request.app.state
    await state.metrics.refresh_workers(state.directory)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
