"""``GET /v1/models``: the models that have at least one live worker."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.jobs.worker_directory import WorkerDirectory
from api.wire.openai.models import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, summary="List the models live workers serve")
async def list_models(request: Request) -> ModelList:
    directory: WorkerDirectory = request.app.state.directory
    cards = []
    for record in sorted(await directory.model_records(), key=lambda r: r.model):
        workers = await directory.live_workers(record.model)
        if workers:
            cards.append(
                ModelCard(
                    id=record.model,
                    created=int(record.first_seen),
                    max_model_len=record.max_model_len or None,
                    num_live_workers=len(workers),
                    task=record.task,
                    deterministic=all(worker.deterministic for worker in workers),
                )
            )
    return ModelList(data=cards)
