"""An agent process that registers after a restart: its workers of launches it no longer
follows are gone.

A local agent's workers die with it (`cpn.train.guard`); a site engine's agent adopts the
launches its engine still runs. Either way, the registration lists the launches the new
process follows. Any rank this agent had reported as still queued, starting or running
in a launch not listed will never report again: without this, an agent restarted within
its lease's TTL (no loss is declared: the new lease simply replaces the old) would leave
such a job SCHEDULED or RUNNING for ever. The ranks are marked NODE_LOST, which the
orchestration loop judges at once as a loss of infrastructure (planned again).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from cpn.registry.events import EventKind, record_event
from cpn.registry.models import Task, TaskState, utcnow

#: Rank states that expect more reports.
LIVE = (TaskState.PENDING, TaskState.STARTING, TaskState.RUNNING)


def forget_gone_launches(
    session: Session, site: str, agent_id: str, launches: frozenset[tuple[str, int]]
) -> list[str]:
    """Mark this agent's live ranks outside `launches` lost; the jobs they belong to."""
    tasks = session.scalars(
        select(Task)
        .where(Task.site == site, Task.agent_id == agent_id, Task.state.in_(LIVE))
        .with_for_update()
    ).all()
    jobs: list[str] = []
    now = utcnow()
    for task in tasks:
        if (task.job_id, task.epoch) in launches:
            continue
        task.state = TaskState.NODE_LOST
        task.message = f"LOST: agent {agent_id} restarted and no longer runs this launch"
        task.updated_at = now
        if task.job_id not in jobs:
            jobs.append(task.job_id)
    for job_id in jobs:
        record_event(
            session,
            EventKind.TASK_STATE,
            f"job {job_id}: agent {agent_id} restarted without its workers (epoch lost)",
            site=site,
            agent_id=agent_id,
            job_id=job_id,
        )
    return jobs
