"""``relaylm serve | api | worker``; every flag also reads from a RELAYLM_* environment variable."""

from __future__ import annotations

from typing import Any

import click

from api.settings import ApiSettings
from relaylm.serve_models import SERVE_MODEL_OPTION, ServeModelsError, models_to_serve
from relaylm.settings_options import build_settings, settings_options
from worker.settings import WorkerSettings


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """relaylm: an OpenAI-compatible LLM server whose API and workers meet in Redis."""


@main.command()
@settings_options(ApiSettings)
def api(**values: Any) -> None:
    """Run the HTTP API (needs Redis; workers may run anywhere)."""
    from api.main import run_api

    run_api(build_settings(ApiSettings, values))


@main.command()
@settings_options(WorkerSettings)
def worker(**values: Any) -> None:
    """Run one worker for one model (needs Redis)."""
    from worker.service.main import run_worker

    run_worker(build_settings(WorkerSettings, values))


@main.command()
@settings_options(ApiSettings, WorkerSettings, repeated={"model": SERVE_MODEL_OPTION})
def serve(**values: Any) -> None:
    """Run everything on this machine: Redis (if none answers), the API and one worker per --model
    (by default a chat and an embedding model; see --model). Ctrl-C stops all."""
    from relaylm.supervisor import Supervisor

    flag_models: tuple[str, ...] = values.pop("model")
    api_settings = build_settings(ApiSettings, values)
    worker_settings = build_settings(WorkerSettings, values)
    try:
        models = models_to_serve(flag_models, worker_settings)
    except ServeModelsError as exc:
        raise click.UsageError(str(exc)) from exc
    given = {name: value for name, value in values.items() if value is not None}
    raise SystemExit(Supervisor(api_settings, worker_settings, models, given).run())
