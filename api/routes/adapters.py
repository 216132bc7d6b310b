"""``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's routes; admin keys only):
store a LoRA adapter in Redis for every worker of its base model, or remove it. The files are
checked here, against the shapes the base model's workers publish, so an adapter that does not
fit is refused before any request meets it."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request

from api.jobs.worker_directory import WorkerDirectory
from api.routes.chat import ERROR_RESPONSES
from api.services import services_of
from api.tenancy import tenant_of
from api.wire.openai.adapters import LoadLoraAdapterRequest, LoraAdapter, LoraAdapterDeleted, UnloadLoraAdapterRequest
from shared.adapter_files import CONFIG_FILE, WEIGHTS_FILE, AdapterError, ModelShapes, check_fits, read_adapter
from shared.adapters import NAME
from shared.errors import ErrorKind, RelayError

router = APIRouter()


def _require_admin(request: Request) -> None:
    if not tenant_of(request).is_admin:
        raise RelayError(ErrorKind.FORBIDDEN, "Loading and unloading LoRA adapters needs an admin key.")


async def _base_model(directory: WorkerDirectory, named: str | None) -> tuple[str, ModelShapes]:
    """The model the adapter adapts and what an adapter of it must fit (from a ready worker)."""
    if named is None:
        served = [
            record.model
            for record in await directory.model_records()
            if record.task == "generate" and (await directory.model_workers(record.model)).workers
        ]
        if len(served) != 1:
            message = f"Name the model the adapter adapts in `base_model_name` (this server serves {len(served)})."
            raise RelayError(ErrorKind.INVALID_REQUEST, message, "base_model_name")
        named = served[0]
    await directory.require_worker(named)
    for worker in (await directory.model_workers(named)).ready:
        if worker.lora is not None:
            return named, worker.lora
    if (await directory.model_workers(named)).ready:
        message = f"The workers of `{named}` serve no LoRA adapters (they need the native forward)."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "base_model_name")
    raise RelayError(ErrorKind.NO_LIVE_WORKER, f"No ready worker of `{named}` can check the adapter yet.", "model")


def _read(folder: Path, max_bytes: int) -> tuple[bytes, bytes]:
    paths = (folder / CONFIG_FILE, folder / WEIGHTS_FILE)
    missing = [path.name for path in paths if not path.is_file()]
    if missing:
        raise RelayError(ErrorKind.INVALID_REQUEST, f"`{folder}` holds no {' and no '.join(missing)}.", "lora_path")
    size = sum(path.stat().st_size for path in paths)
    if size > max_bytes:
        message = f"The adapter is {size} bytes; this server stores adapters of {max_bytes} bytes at most."
        raise RelayError(ErrorKind.PAYLOAD_TOO_LARGE, message, "lora_path")
    return paths[0].read_bytes(), paths[1].read_bytes()


@router.post(
    "/v1/load_lora_adapter", response_model=LoraAdapter, responses=ERROR_RESPONSES, summary="Store a LoRA adapter"
)
async def load_lora_adapter(request: Request, body: LoadLoraAdapterRequest) -> LoraAdapter:
    _require_admin(request)
    services = services_of(request)
    directory, name = services.directory, body.lora_name
    if not NAME.match(name):
        message = "An adapter's name is 1-128 letters, digits and . _ : / -, starting with a letter or digit."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "lora_name")
    if await directory.model_record(name) is not None:
        raise RelayError(ErrorKind.INVALID_REQUEST, f"`{name}` is a model's name.", "lora_name")
    if not body.load_inplace and await directory.adapters.record(name) is not None:
        message = f"The LoRA adapter `{name}` is already loaded (load_inplace replaces it)."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "lora_name")
    base, shapes = await _base_model(directory, body.base_model_name)
    config, weights = _read(Path(body.lora_path).expanduser(), services.settings.max_lora_bytes)
    try:
        lora_config, updates = read_adapter(config, weights)
        check_fits(updates, shapes)
    except AdapterError as exc:
        raise RelayError(ErrorKind.INVALID_REQUEST, f"The adapter cannot be served: {exc}", "lora_path") from exc
    targets = sorted({target for _, target in updates})
    record = await directory.adapters.put(name, base, config, weights, lora_config.rank, targets)
    return LoraAdapter(id=name, parent=base, rank=record.rank, targets=targets, size=record.size, sha256=record.sha256)


@router.post(
    "/v1/unload_lora_adapter",
    response_model=LoraAdapterDeleted,
    responses=ERROR_RESPONSES,
    summary="Remove a LoRA adapter",
)
async def unload_lora_adapter(request: Request, body: UnloadLoraAdapterRequest) -> LoraAdapterDeleted:
    """Requests running on it finish; new requests for it get 404."""
    _require_admin(request)
    if not await services_of(request).directory.adapters.delete(body.lora_name):
        raise RelayError(ErrorKind.NOT_FOUND, f"No LoRA adapter `{body.lora_name}` is loaded.", "lora_name")
    return LoraAdapterDeleted(id=body.lora_name)
