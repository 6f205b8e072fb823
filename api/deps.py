"""Typed dependencies for the routes (the FastAPI full-stack template's pattern)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from cpn.registry import Registry


def get_registry(request: Request) -> Registry:
    registry: Registry = request.app.state.registry
    return registry


def get_db(registry: Annotated[Registry, Depends(get_registry)]) -> Iterator[Session]:
    with registry.read() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_db)]
