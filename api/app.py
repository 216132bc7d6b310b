"""The FastAPI application: connections are opened in the lifespan, never at import time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from api.batches.file_store import FileStore
from api.batches.runner import BatchRunner
from api.batches.store import BatchStore
from api.draining import DrainingMiddleware
from api.errors import install_error_handlers
from api.images.loader import ImageLoader
from api.images.request import ImageIntake
from api.jobs.client import JobClient
from api.jobs.detached import DetachedJobs
from api.jobs.event_router import EventRouter
from api.jobs.housekeeping import Housekeeper
from api.jobs.results import ResultStore
from api.jobs.worker_directory import WorkerDirectory
from api.metrics import Metrics
from api.middleware import ApiKeyMiddleware, BodyGuardMiddleware
from api.request_context import RequestContextMiddleware
from api.response_store import ResponseStore
from api.routes import (
    adapters,
    audio,
    background,
    batches,
    chat,
    completions,
    embeddings,
    files,
    health,
    messages,
    metrics,
    models,
    responses,
    resume,
    tokenize,
)
from api.services import Services, drain_gate, install
from api.settings import ApiSettings
from api.tenancy import KeyRing
from shared.job_lifecycle import JobLifecycle
from shared.redis import ReplicaAck, connect_redis

logger = logging.getLogger("relaylm.api")

# Liveness must answer without a key (load balancers and orchestrators probe it).
PUBLIC_PATHS = ("/health",)
# Longest one shutdown step may take before the process goes on without it.
_SHUTDOWN_STEP_S = 5.0


async def _bounded_step(name: str, step: Awaitable[None]) -> None:
    try:
        await asyncio.wait_for(step, _SHUTDOWN_STEP_S)
    except TimeoutError:
        logger.warning("shutdown: %s took over %.0f s; going on without it", name, _SHUTDOWN_STEP_S)
    except Exception:
        logger.exception("shutdown: %s failed; going on", name)


def create_app(settings: ApiSettings) -> FastAPI:
    app_metrics = Metrics()
    redis = connect_redis(settings.redis_target)  # connects on first use, inside the server's loop
    keys = settings.keys

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router = EventRouter(redis, keys)
        directory = WorkerDirectory(redis, keys)
        await router.start()
        replica_ack = ReplicaAck(
            settings.redis_replica_wait_ms if settings.redis_target.is_replicated else 0,
            keys.replica_ack(),
            app_metrics.unreplicated_writes.inc,
        )
        lifecycle = JobLifecycle(redis, keys, replica_ack)
        client = JobClient(lifecycle, keys, router, directory, settings, app_metrics)
        files = FileStore(redis, keys, settings.file_retention_s, replica_ack)
        batches = BatchStore(redis, keys, settings.result_retention_s, replica_ack)
        results = ResultStore(redis, keys, lifecycle, settings.result_retention_s)
        install(
            app.state,
            Services(
                settings=settings,
                redis=redis,
                metrics=app_metrics,
                directory=directory,
                lifecycle=lifecycle,
                jobs=client,
                files=files,
                batches=batches,
                responses=ResponseStore(redis, keys, settings.result_retention_s),
                images=ImageIntake(ImageLoader(settings, app_metrics), directory, files),
                results=results,
            ),
        )
        housekeeper = Housekeeper(
            lifecycle, directory, results, settings.batch_poll_interval_s, settings.no_worker_grace_s
        )
        line_states = DetachedJobs(lifecycle, settings.reasoning_field)
        runner = BatchRunner(redis, keys, settings, batches, files, line_states, client, directory, lifecycle)
        housekeeper.start()
        runner.start()
        logger.info("API ready; Redis at %s", settings.redis_target.describe())
        try:
            yield
        finally:
            # uvicorn waits for the lifespan's end without a limit: each step gets one, so a
            # SIGTERM always ends the process even if a Redis socket will not close.
            await _bounded_step("batch runner stop", runner.stop())
            await _bounded_step("housekeeper stop", housekeeper.stop())
            await _bounded_step("event router stop", router.stop())
            await _bounded_step("Redis close", redis.aclose())

    app = FastAPI(
        title="relaylm",
        summary="OpenAI-compatible LLM serving with workers behind Redis",
        version="0.1.0",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    # Added innermost first: CORS answers preflights, then keys are checked, then bodies are read.
    # Uploads may exceed the JSON limit (multipart framing adds a little to the file's own size).
    file_limit = settings.max_file_bytes + 64 * 1024
    audio_limit = settings.max_audio_bytes + 64 * 1024
    path_limits = {
        "/v1/files": file_limit,
        "/v1/audio/transcriptions": audio_limit,
        "/v1/audio/translations": audio_limit,
    }
    app.add_middleware(BodyGuardMiddleware, max_body_bytes=settings.max_body_bytes, path_limits=path_limits)
    keyring = KeyRing(settings.load_api_keys(), settings.load_admin_api_keys(), redis, keys, settings.owner_hash_secret)
    if not keyring.is_empty:
        public = [*PUBLIC_PATHS, *(["/metrics"] if settings.metrics_public else [])]
        app.add_middleware(ApiKeyMiddleware, keyring=keyring, exempt_paths=public)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=[
                "authorization",
                "content-type",
                "last-event-id",
                "x-request-id",
                "x-api-key",
                "anthropic-version",
                "anthropic-beta",
            ],
            expose_headers=["x-request-id"],
        )
    app.add_middleware(DrainingMiddleware, gate=drain_gate(app), retry_after_s=settings.retry_after_s)
    app.add_middleware(RequestContextMiddleware, metrics=app_metrics)
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(embeddings.router)
    app.include_router(audio.router)
    app.include_router(messages.router)
    app.include_router(responses.router)
    app.include_router(tokenize.router)
    app.include_router(resume.router)
    app.include_router(background.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(models.router)
    app.include_router(adapters.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    return app
