"""API process entry: uvicorn serving :func:`api.app.create_app`, draining on SIGTERM."""

from __future__ import annotations

import sys

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from api.app import create_app
from api.draining import DrainingServer
from api.services import drain_gate
from api.settings import ApiSettings
from shared.log_setup import configure_logging

# After the drain: how long uvicorn waits for connections still open (a response being written,
# a stream that sse-starlette is cutting off) before it cancels them.
_SHUTDOWN_SLACK_S = 5


def run_api(settings: ApiSettings) -> None:
    configure_logging(settings.log_level, settings.log_format)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        log_config=None,  # keep our handler (text or JSON) for uvicorn's loggers too
        timeout_keep_alive=int(settings.keep_alive_timeout_s),
        timeout_graceful_shutdown=_SHUTDOWN_SLACK_S,
    )
    server = DrainingServer(config, drain_gate(app), settings.drain_timeout_s)
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)  # as uvicorn.run does: a port in use is not a clean exit
