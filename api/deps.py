"""Typed dependencies for the routes (the FastAPI full-stack template's pattern):

def get_job(job_id: str, service: ServiceDep, principal: PrincipalDep) -> JobPublic: ...
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.threads import in_thread
from cpn.control.settings import ControlSettings
from cpn.orchestration import JobService, Principal, ServiceMetrics
from cpn.orchestration.tenants import KeyCache, authenticate, check_form
from cpn.registry import Registry

# The getters below are `async def` on purpose: FastAPI runs a plain `def` dependency in
# a worker thread, and these only read app.state — three thread hops per request for
# nothing, which the profile of POST /v1/jobs showed as its largest single cost.


async def get_registry(request: Request) -> Registry:
    registry: Registry = request.app.state.registry
    return registry


def get_db(registry: Annotated[Registry, Depends(get_registry)]) -> Iterator[Session]:
    with registry.read() as session:
        yield session


async def get_service(request: Request) -> JobService:
    service: JobService = request.app.state.service
    return service


async def get_settings(request: Request) -> ControlSettings:
    settings: ControlSettings = request.app.state.settings
    return settings


async def get_metrics(request: Request) -> ServiceMetrics:
    metrics: ServiceMetrics = request.app.state.metrics
    return metrics


_bearer = HTTPBearer(
    auto_error=False,
    description="An API key from `cpn keys create`, sent as `Authorization: Bearer <key>`.",
)


async def get_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The tenant and role the request's API key acts for (401 otherwise)."""
    return await principal_of(request, credentials.credentials if credentials else None)


async def principal_of(request: Request, key: str | None) -> Principal:
    """Who `key` acts for, answered from the key cache when it can be
    (ControlSettings.api_key_cache_s bounds how long a revoked key still works): a hit
    costs no database round trip and no hop to a worker thread; a miss looks the key up
    in one. Unauthorized if the key is missing, malformed, unknown or revoked."""
    key = check_form(key)
    cache: KeyCache = request.app.state.keys
    principal = cache.get(key)
    if principal is None:
        registry: Registry = request.app.state.registry
        principal = await in_thread(_lookup, registry, key)
        cache.put(key, principal)
    return principal


def _lookup(registry: Registry, key: str) -> Principal:
    with registry.read() as session:
        return authenticate(session, key)


RegistryDep = Annotated[Registry, Depends(get_registry)]
SessionDep = Annotated[Session, Depends(get_db)]
ServiceDep = Annotated[JobService, Depends(get_service)]
SettingsDep = Annotated[ControlSettings, Depends(get_settings)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
