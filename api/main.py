"""The FastAPI application. `cpn serve` runs it beside the gRPC control server and the
orchestration loop; tests run it in-process with `create_app(registry, ...)`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import FastAPI

from api import errors
from api.routes import health, jobs, quotes, sites, topology, ui
from cpn import __version__
from cpn.control.settings import ControlSettings
from cpn.orchestration import JobService, ServiceMetrics
from cpn.orchestration.tenants import KeyCache
from cpn.registry import Registry


def create_app(
    registry: Registry,
    *,
    settings: ControlSettings | None = None,
    service: JobService | None = None,
    metrics: ServiceMetrics | None = None,
    ready: Callable[[], str | None] | None = None,
) -> FastAPI:
    """`ready()` returns why the process cannot serve yet (None: ready), for /readyz."""
    settings = settings or ControlSettings(database_url=registry.url)
    app = FastAPI(
        title="cpn",
        version=__version__,
        description="Scheduler service for a computing power network: submit training jobs, "
        "get quotes, follow progress and logs. Authenticate with `Authorization: Bearer "
        "<API key>` (`cpn keys create`).",
    )
    app.state.registry = registry
    app.state.settings = settings
    app.state.service = service or JobService(registry, settings)
    app.state.metrics = metrics or ServiceMetrics(registry)
    app.state.keys = KeyCache(settings.api_key_cache_s)
    #: Set when the server is asked to stop: followed log streams end at once (uvicorn
    #: would otherwise wait for them, and a job that never ends kept `cpn serve` running).
    app.state.stopping = asyncio.Event()
    app.state.ready = ready
    errors.install(app)
    for module in (jobs, quotes, sites, topology, health):
        app.include_router(module.router)
    ui.install(app)
    return app
