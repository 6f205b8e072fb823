"""/healthz (the process answers), /readyz (it can serve: the database answers and the
orchestration loop runs), /metrics (Prometheus)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from api.deps import MetricsDep, RegistryDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Not ready, with the reason"}})
def readyz(request: Request, registry: RegistryDep) -> JSONResponse:
    try:
        with registry.read() as session:
            session.execute(text("SELECT 1"))
    except SQLAlchemyError:
        return JSONResponse({"status": "database unavailable"}, status_code=503)
    ready: Callable[[], str | None] | None = getattr(request.app.state, "ready", None)
    problem = ready() if ready is not None else None
    if problem:
        return JSONResponse({"status": problem}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(metrics: MetricsDep) -> Response:
    """Prometheus exposition: jobs by state, scheduling latency, agents alive,
    heartbeats, WAN bytes by link."""
    return Response(generate_latest(metrics.prometheus), media_type=CONTENT_TYPE_LATEST)
