"""The API process's services: built once in the app's lifespan, and the only way a route or
helper reaches them (``services_of(request)``, or ``Depends(services_of)``). Nothing else reads
``app.state``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from fastapi import Request
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.datastructures import State

from api.batches.file_store import FileStore
from api.batches.store import BatchStore
from api.draining import DrainGate
from api.images.request import ImageIntake
from api.jobs.client import JobClient
from api.jobs.results import ResultStore
from api.jobs.worker_directory import WorkerDirectory
from api.metrics import Metrics
from api.response_store import ResponseStore
from api.settings import ApiSettings
from shared.job_lifecycle import JobLifecycle


@dataclass(frozen=True)
class Services:
    settings: ApiSettings
    redis: Redis
    metrics: Metrics
    directory: WorkerDirectory
    lifecycle: JobLifecycle
    jobs: JobClient
    files: FileStore
    batches: BatchStore
    responses: ResponseStore
    images: ImageIntake
    results: ResultStore


def install(state: State, services: Services) -> None:
    """The lifespan hands the app its services (``state``: the app's)."""
    state.services = services


def services_of(request: Request) -> Services:
    return cast(Services, request.app.state.services)


def drain_gate(app: Starlette) -> DrainGate:
    """The app's one gate, made on first use: ``create_app`` gives it to the middleware and
    ``run_api`` to the server (both before the lifespan builds the services)."""
    gate: DrainGate | None = getattr(app.state, "drain_gate", None)
    if gate is None:
        gate = app.state.drain_gate = DrainGate()
    return gate
