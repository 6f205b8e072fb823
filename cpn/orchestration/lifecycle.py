"""A scheduled job's state from its ranks' reports: RUNNING once every rank runs,
SUCCEEDED when every rank ended well, FAILED (with the rank, its exit code and its last
log lines) as soon as one fails; and FAILED when an agent holding its GPUs is lost
(re-planning from a checkpoint is the failure-recovery work's RESCHEDULING)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from cpn.orchestration import states
from cpn.registry.models import (
    Allocation,
    Gpu,
    GpuStatus,
    Job,
    JobLogLine,
    JobState,
    Node,
    Site,
    Task,
    TaskState,
)

LAST_LINES = 20


def world_size(job: Job) -> int:
    assert job.plan is not None
    p = job.plan["parallel"]
    return int(p["dp"]) * int(p["tp"]) * int(p["pp"])


def last_lines(session: Session, job_id: str, rank: int, n: int = LAST_LINES) -> list[str]:
    rows = session.scalars(
        select(JobLogLine.line)
        .where(JobLogLine.job_id == job_id, JobLogLine.rank == rank)
        .order_by(JobLogLine.id.desc())
        .limit(n)
    ).all()
    return list(reversed(rows))


def advance(session: Session, job: Job) -> JobState | None:
    """Apply what the ranks reported to an active job; returns the new state if changed."""
    if job.state not in states.ACTIVE:
        return None
    tasks = {t.rank: t for t in session.scalars(select(Task).where(Task.job_id == job.id))}
    world = world_size(job)
    failed = sorted(r for r, t in tasks.items() if t.state is TaskState.FAILED)
    stopped = sorted(r for r, t in tasks.items() if t.state is TaskState.STOPPED)
    if failed or stopped:
        rank = failed[0] if failed else stopped[0]
        task = tasks[rank]
        lines = last_lines(session, job.id, rank)
        what = f"exited with {task.exit_code}" if failed else "was stopped by its agent"
        reason = f"rank {rank} ({task.site}) {what}"
        if task.message and task.message != f"exited with {task.exit_code}":
            reason += f": {task.message}"
        elif lines:
            reason += f": {lines[-1][:300]}"
        job.failure = {
            "rank": rank,
            "site": task.site,
            "exit_code": task.exit_code,
            "message": task.message,
            "last_lines": lines,
        }
        states.transition(session, job, JobState.FAILED, reason)
        return JobState.FAILED
    ended = [r for r, t in tasks.items() if t.state is TaskState.SUCCEEDED]
    running = [r for r, t in tasks.items() if t.state in (TaskState.RUNNING, TaskState.SUCCEEDED)]
    if job.state is JobState.SCHEDULED and len(running) == world:
        states.transition(session, job, JobState.RUNNING, f"all {world} ranks run")
    if len(ended) == world:
        states.transition(session, job, JobState.SUCCEEDED, f"all {world} ranks exited with 0")
        return JobState.SUCCEEDED
    return JobState.RUNNING if job.state is JobState.RUNNING else None


def lost_gpus(session: Session, job_ids: list[str]) -> dict[str, str]:
    """Active jobs holding a GPU that is lost → where (site/node)."""
    if not job_ids:
        return {}
    rows = session.execute(
        select(Allocation.job_id, Site.name, Node.name)
        .join(Gpu, Allocation.gpu_id == Gpu.id)
        .join(Node, Gpu.node_id == Node.id)
        .join(Site, Node.site_id == Site.id)
        .where(Allocation.job_id.in_(job_ids), Gpu.status == GpuStatus.LOST)
    )
    out: dict[str, str] = {}
    for job_id, site, node in rows:
        out.setdefault(job_id, f"{site}/{node}")
    return out


def live_tasks(session: Session, job_id: str) -> int:
    return len(
        session.scalars(
            select(Task.rank).where(
                Task.job_id == job_id, Task.state.in_((TaskState.STARTING, TaskState.RUNNING))
            )
        ).all()
    )
