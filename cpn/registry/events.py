"""Recording what happened: one row per event, written in the caller's transaction so that
an event exists exactly when the change it describes was committed."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy.orm import Session

from cpn.registry.models import Event, utcnow


class EventKind(StrEnum):
    AGENT_REGISTERED = "agent_registered"
    AGENT_LOST = "agent_lost"
    GPU_LOST = "gpu_lost"
    NODE_REMOVED = "node_removed"
    ALLOCATED = "allocated"
    RELEASED = "released"
    ORDER_QUEUED = "order_queued"
    TASK_STATE = "task_state"
    JOB_SUBMITTED = "job_submitted"
    JOB_STATE = "job_state"  # a job's state changed; data: {"from", "to", "reason"}


def record_event(
    session: Session,
    kind: EventKind,
    message: str,
    *,
    site: str | None = None,
    agent_id: str | None = None,
    job_id: str | None = None,
    data: dict[str, Any] | None = None,
    at: datetime | None = None,
) -> Event:
    event = Event(
        at=at or utcnow(),
        kind=kind.value,
        site=site,
        agent_id=agent_id,
        job_id=job_id,
        message=message,
        data=data or {},
    )
    session.add(event)
    return event
