"""References in a task status that must exist: the job, and the rank in it at this agent.

An agent reports on workers it launched, and it launches workers only on the control
plane's order. Every order is recorded with an `order_queued` event in the transaction
that writes the order (`cpn.control.dispatch.queue`), before the agent can receive it.
So a report is accepted only for a job and rank that a launch order queued for this very
agent placed at its site: any other site token could otherwise fail (or fake the progress
of) another tenant's job, or report on a job that was never scheduled.

Checked on the database thread, inside the transaction that then writes the task, so a
refused report writes nothing.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from cpn.control.errors import InvalidField, quote
from cpn.registry.events import EventKind
from cpn.registry.models import Event


def check_task(session: Session, *, site: str, agent_id: str, job_id: str, rank: int) -> None:
    """Raise InvalidField unless (job_id, rank) is a task this agent was ordered to run."""
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
            "job_id",
            f"no launch order for job {quote(job_id)} was sent to agent {quote(agent_id)}",
        )
    ranks: set[int] = set()
    for data in launches:
        listed = data.get("ranks")
        if not isinstance(listed, list):
            return  # recorded before ranks were: nothing to check the rank against
        ranks.update(r for r in listed if isinstance(r, int))
    if rank not in ranks:
        raise InvalidField(
            "rank",
            f"job {quote(job_id)} has no rank {rank} at site {quote(site)} in its launch orders",
        )


__all__ = ["check_task"]
