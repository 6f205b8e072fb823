"""Typed dependencies for the routes (the FastAPI full-stack template's pattern):

def get_job(job_id: str, service: ServiceDep, principal: PrincipalDep) -> JobPublic: ...
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from cpn.control.settings import ControlSettings
from cpn.orchestration import JobService, Principal, ServiceMetrics
from cpn.orchestration.tenants import authenticate
from cpn.registry import Registry


def get_registry(request: Request) -> Registry:
    registry: Registry = request.app.state.registry
    return registry


def get_db(registry: Annotated[Registry, Depends(get_registry)]) -> Iterator[Session]:
    with registry.read() as session:
        yield session


def get_service(request: Request) -> JobService:
    service: JobService = request.app.state.service
    return service


def get_settings(request: Request) -> ControlSettings:
    settings: ControlSettings = request.app.state.settings
    return settings


def get_metrics(request: Request) -> ServiceMetrics:
    metrics: ServiceMetrics = request.app.state.metrics
    return metrics


_bearer = HTTPBearer(
    auto_error=False,
    description="An API key from `cpn keys create`, sent as `Authorization: Bearer <key>`.",
)


def get_principal(
    registry: Annotated[Registry, Depends(get_registry)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The tenant and role the request's API key acts for (401 otherwise)."""
    with registry.read() as session:
        return authenticate(session, credentials.credentials if credentials else None)


RegistryDep = Annotated[Registry, Depends(get_registry)]
SessionDep = Annotated[Session, Depends(get_db)]
ServiceDep = Annotated[JobService, Depends(get_service)]
SettingsDep = Annotated[ControlSettings, Depends(get_settings)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
