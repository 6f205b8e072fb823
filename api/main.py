"""The FastAPI application. `cpn serve` runs it beside the gRPC control server."""

from __future__ import annotations

from fastapi import FastAPI

from api.routes import sites
from cpn import __version__
from cpn.registry import Registry


def create_app(registry: Registry) -> FastAPI:
    app = FastAPI(
        title="cpn",
        version=__version__,
        description="Scheduler service for a computing power network.",
    )
    app.state.registry = registry
    app.include_router(sites.router)
    return app
