"""Which models ``relaylm serve`` runs a worker for: the ``--model`` flags, else ``RELAYLM_MODEL``
(comma-separated), else the default chat model and the default embedding model."""

from __future__ import annotations

from collections.abc import Sequence

from relaylm.settings_options import Repeated
from worker.settings import DEFAULT_MODEL, WorkerSettings

# worker.embedding.loader.DEFAULT_EMBEDDING_MODEL, spelled here because importing that module
# imports torch (~1.5 s and ~200 MB) into a supervisor that never runs a model; a test keeps the
# two equal.
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"
DEFAULT_SERVE_MODELS = (DEFAULT_MODEL, DEFAULT_EMBEDDING_MODEL)

SERVE_MODEL_OPTION = Repeated(
    note="Repeat it for several models: one worker each, restarted on its own; every other flag applies to each.",
    env_format="comma-separated",
    default=" and ".join(DEFAULT_SERVE_MODELS),
)

# Settings that name one model or one worker, so several workers cannot share them: what each names.
_ONE_WORKER_SETTINGS = {"served_model_name": "model", "worker_id": "worker"}


class ServeModelsError(ValueError):
    """The models asked for cannot be served together; the message says why and what to do."""


def models_to_serve(flag_models: Sequence[str], settings: WorkerSettings) -> list[str]:
    """``settings`` were read with no ``model`` flag, so its ``model`` is RELAYLM_MODEL's or the default."""
    if flag_models:
        models = [model.strip() for model in flag_models]
    elif "model" in settings.model_fields_set:
        models = [model.strip() for model in settings.model.split(",") if model.strip()]
    else:
        models = list(DEFAULT_SERVE_MODELS)
    if not models or not all(models):
        raise ServeModelsError("--model (or RELAYLM_MODEL) names no model")
    _check_distinct(models)
    if len(models) > 1:
        _check_shareable(models, settings)
    return models


def _check_distinct(models: list[str]) -> None:
    twice = next((model for index, model in enumerate(models) if model in models[:index]), None)
    if twice is not None:
        raise ServeModelsError(
            f"model {twice!r} is named twice; serve runs one worker per model "
            "(for another worker of the same model, start `relaylm worker` beside it)"
        )


def _check_shareable(models: list[str], settings: WorkerSettings) -> None:
    serving = f"serve runs {len(models)} models ({', '.join(models)})"
    for name, what in _ONE_WORKER_SETTINGS.items():
        if name in settings.model_fields_set:
            flag = "--" + name.replace("_", "-")
            raise ServeModelsError(
                f"{flag} (or RELAYLM_{name.upper()}) names one {what}, but {serving}; give one --model with it"
            )
    if settings.task != "auto":
        raise ServeModelsError(
            f"--task {settings.task} (or RELAYLM_TASK) would apply to every worker, but {serving}; "
            "leave it auto (each worker picks generate, embed or transcribe from its model) or give one --model"
        )
