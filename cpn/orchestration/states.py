"""The job state machine: which transitions exist, and the one function that makes them.

    PENDING ──► SCHEDULED ──► RUNNING ──► SUCCEEDED
       │            │  ▲         │  │
       │            │  └─────────┼──┼── RESCHEDULING (a lost agent; failure recovery)
       ▼            ▼            ▼  ▼
    CANCELLED    FAILED / CANCELLED

Every transition goes through `transition()`, which writes the new state, its reason and
an event row in the caller's transaction: a state and the event that explains it are
committed together or not at all. What each state means is documented on
`cpn.registry.models.JobState`.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from cpn.errors import CpnError
from cpn.registry.events import EventKind, record_event
from cpn.registry.models import Job, JobState, utcnow

S = JobState
ALLOWED: dict[JobState, frozenset[JobState]] = {
    S.PENDING: frozenset({S.SCHEDULED, S.CANCELLED, S.FAILED}),
    S.SCHEDULED: frozenset({S.RUNNING, S.FAILED, S.CANCELLED, S.RESCHEDULING}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.RESCHEDULING}),
    S.RESCHEDULING: frozenset({S.SCHEDULED, S.FAILED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}
#: States in which a job holds (or may still hold) GPUs and workers.
ACTIVE = frozenset({S.SCHEDULED, S.RUNNING})
#: States in which a job's GPUs are given back once its workers have stopped.
RELEASING = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.RESCHEDULING})
#: States a job has not left for good.
UNFINISHED = frozenset({S.PENDING, S.SCHEDULED, S.RUNNING, S.RESCHEDULING})


class IllegalTransition(CpnError):
    """A transition the state machine does not have (a bug, or a race lost)."""


def transition(
    session: Session,
    job: Job,
    to: JobState,
    reason: str,
    *,
    at: datetime | None = None,
    data: dict[str, object] | None = None,
) -> None:
    """Move `job` to `to` with `reason`, recording the event in the same transaction."""
    now = at or utcnow()
    was = job.state
    if to not in ALLOWED[was]:
        raise IllegalTransition(f"job {job.id}: {was.value} → {to.value} is not a transition")
    job.state = to
    job.state_reason = reason
    job.updated_at = now
    if to is S.SCHEDULED:
        job.scheduled_at = now
    elif to is S.RUNNING:
        job.started_at = now
    elif to.terminal:
        job.finished_at = now
    record_event(
        session,
        EventKind.JOB_STATE,
        f"job {job.id}: {was.value} → {to.value}: {reason}",
        job_id=job.id,
        data={"from": was.value, "to": to.value, "reason": reason, **(data or {})},
        at=now,
    )
