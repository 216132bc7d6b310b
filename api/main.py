"""API process entry: uvicorn serving :func:`api.app.create_app`."""

from __future__ import annotations

import uvicorn

from api.app import create_app
from api.settings import ApiSettings
from shared.log_setup import configure_logging


def run_api(settings: ApiSettings) -> None:
    configure_logging(settings.log_level, settings.log_format)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        log_config=None,  # keep our handler (text or JSON) for uvicorn's loggers too
        timeout_keep_alive=int(settings.keep_alive_timeout_s),
        timeout_graceful_shutdown=int(settings.drain_timeout_s) + 5,
    )
