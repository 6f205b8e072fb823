"""References in a task status that must exist: the job, and the rank in it.

An agent reports on workers it launched, and it launches workers only on the control
plane's order. So a report is about a known job when either

- the registry has the job (the orchestration created it), or
- a launch order for the job was queued for this very agent: every order is recorded as an
  `order_queued` event in the same database (see `ControlServer._record_order`), which
  survives a control-plane restart, unlike the orders themselves.

The rank must be one of the job's: below the world size of the job's plan, or among the
ranks the launch order placed at the agent's site.

Checked on the database thread, inside the transaction that then writes the task, so a
refused report writes nothing.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from cpn.control.errors import InvalidField, quote
from cpn.registry.events import EventKind
from cpn.registry.models import Event, Job


def _world_size(plan: dict[str, Any] | None) -> int | None:
    parallel = (plan or {}).get("parallel")
    if not isinstance(parallel, dict):
        return None
    try:
        return int(parallel["dp"]) * int(parallel["tp"]) * int(parallel["pp"])
    except (KeyError, TypeError, ValueError):
        return None


def check_task(session: Session, *, site: str, agent_id: str, job_id: str, rank: int) -> None:
    """Raise InvalidField unless (job_id, rank) is a task this agent may report on."""
    job = session.get(Job, job_id)
    if job is not None:
        world = _world_size(job.plan)
        if world is not None and rank >= world:
            raise InvalidField("rank", f"job {job_id!r} has ranks 0..{world - 1}, got {rank}")
        return
    orders = session.scalars(
        select(Event.data).where(
            Event.kind == EventKind.ORDER_QUEUED.value,
            Event.job_id == job_id,
            Event.site == site,
            Event.agent_id == agent_id,
        )
    ).all()
    launches = [data for data in orders if data.get("kind") == "launch"]
    if not launches:
        raise InvalidField(
            "job_id", f"unknown job {quote(job_id)}: no such job and no launch order for it"
        )
    ranks: set[int] = set()
    for data in launches:
        listed = data.get("ranks")
        if not isinstance(listed, list):
            return  # recorded before ranks were: nothing to check the rank against
        ranks.update(r for r in listed if isinstance(r, int))
    if rank not in ranks:
        raise InvalidField(
            "rank", f"job {job_id!r} has no rank {rank} at site {site!r} in its launch orders"
        )


__all__ = ["check_task"]
