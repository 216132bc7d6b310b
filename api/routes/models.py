"""``GET /v1/models``: the models that have at least one ready or loading worker, and the LoRA
adapters of those models (``parent``: the model)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.services import services_of
from api.wire.openai.models import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, summary="List the models live or loading workers serve")
async def list_models(request: Request) -> ModelList:
    directory = services_of(request).directory
    cards: list[ModelCard] = []
    for record in sorted(await directory.model_records(), key=lambda r: r.model):
        reading = await directory.model_workers(record.model, fresh=True)
        ready, loading = reading.ready, reading.loading
        if ready or loading:
            cards.append(
                ModelCard(
                    id=record.model,
                    created=int(record.first_seen),
                    max_model_len=record.max_model_len or None,
                    num_live_workers=len(ready),
                    num_loading_workers=len(loading),
                    task=record.task,
                    deterministic=bool(ready) and all(worker.deterministic for worker in ready),
                )
            )
    served = {card.id: card for card in cards}
    for adapter in await directory.adapters.records():
        base = served.get(adapter.base)
        if base is not None and adapter.name not in served:
            cards.append(
                base.model_copy(update={"id": adapter.name, "created": int(adapter.created), "parent": adapter.base})
            )
    return ModelList(data=cards)
