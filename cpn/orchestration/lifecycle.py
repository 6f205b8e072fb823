"""A scheduled job's state from its ranks' reports: RUNNING once every rank runs,
SUCCEEDED when every rank ended well; when a rank fails, its recovery policy decides
(restart from the last checkpoint, or FAILED with the rank, its exit code and its last
log lines); a loss of infrastructure — an agent holding its GPUs lost, a site engine
that preempted the work or lost a node — puts it in RESCHEDULING, planned again."""

from __future__ import annotations

from collections import Counter
from datetime import datetime

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from cpn.contracts import JobSpec
from cpn.control.settings import ControlSettings
from cpn.orchestration import recovery, states
from cpn.registry.models import (
    FINAL_TASK_STATES,
    Agent,
    AgentStatus,
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
    utcnow,
)

LAST_LINES = 20
#: How a fenced agent's stopped ranks begin their message (`agents.agent.FENCED_REASON`:
#: the protocol has no field of its own for it).
FENCED = "fenced: "


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


def advance(
    session: Session, job: Job, settings: ControlSettings, settle_s: float = 0.0
) -> JobState | None:
    """Apply what the ranks of the job's current epoch reported; returns the new state if
    it changed (RESCHEDULING: restarted after a worker failure).

    A failed rank is judged `settle_s` after it failed (one lease TTL): when a site is
    lost, the other sites' workers fail at once on their broken collectives, while the
    lost agent is declared lost only when its lease expires. Waiting lets that loss be
    seen as a loss (the job is planned again) rather than as its workers' failure. A rank
    that runs but finishes no step for `recovery.stuck_after_s` is a failure too."""
    if job.state not in states.ACTIVE:
        return None
    tasks = {
        t.rank: t
        for t in session.scalars(select(Task).where(Task.job_id == job.id, Task.epoch == job.epoch))
    }
    world = world_size(job)
    failed = sorted(r for r, t in tasks.items() if t.state is TaskState.FAILED)
    stopped = sorted(r for r, t in tasks.items() if t.state is TaskState.STOPPED)
    now = utcnow()
    taken = _taken_by_site(session, settings, job, tasks)
    if taken is not None:
        return taken
    if failed or stopped:
        first = min(tasks[r].updated_at for r in failed + stopped)
        if settle_s and (now - first).total_seconds() < settle_s:
            return None
        # A rank its agent fenced (cut off from us for a lease TTL) is a loss of
        # infrastructure, and the failures beside it are its consequences: the workers of
        # the sites whose agents had not fenced yet fail on their broken collectives.
        fenced = [r for r in stopped if tasks[r].message.startswith(FENCED)]
        rank = fenced[0] if fenced else failed[0] if failed else stopped[0]
        task = tasks[rank]
        lines = last_lines(session, job.id, rank)
        what = f"exited with {task.exit_code}" if rank in failed else "was stopped by its agent"
        reason = f"rank {rank} ({task.site}) {what}"
        if task.message and task.message != f"exited with {task.exit_code}":
            reason += f": {task.message}"
        elif lines:
            reason += f": {lines[-1][:300]}"
        failure = {
            "rank": rank,
            "site": task.site,
            "exit_code": task.exit_code,
            "message": task.message,
            "last_lines": lines,
        }
        if fenced or not failed:
            # Stopped with no stop order of ours (the job would not be active): its agent
            # fenced it, cut off from us for a lease TTL. A loss of infrastructure, not
            # the job's fault: planned again, not counted as a restart.
            recovery.reschedule(session, settings, job, reason)
            return JobState.RESCHEDULING
        return recovery.worker_failed(session, settings, job, failure, reason)
    stuck = _stuck(job, tasks, now)
    if stuck is not None:
        task = tasks[stuck]
        lines = last_lines(session, job.id, stuck)
        limit = JobSpec.model_validate(job.spec).recovery.stuck_after_s
        reason = (
            f"rank {stuck} ({task.site}) is stuck: no step finished for {limit:g} s "
            f"(at step {task.step})"
        )
        failure = {
            "rank": stuck,
            "site": task.site,
            "exit_code": None,
            "message": "stuck",
            "last_lines": lines,
        }
        return recovery.worker_failed(session, settings, job, failure, reason)
    ended = [r for r, t in tasks.items() if t.state is TaskState.SUCCEEDED]
    running = [r for r, t in tasks.items() if t.state in (TaskState.RUNNING, TaskState.SUCCEEDED)]
    if job.state is JobState.SCHEDULED and len(running) == world:
        states.transition(session, job, JobState.RUNNING, f"all {world} ranks run")
    if len(ended) == world:
        states.transition(session, job, JobState.SUCCEEDED, f"all {world} ranks exited with 0")
        return JobState.SUCCEEDED
    return JobState.RUNNING if job.state is JobState.RUNNING else None


#: A site engine ended these ranks and said why: judged at once (no settling time — the
#: cause is known, not a peer's loss seen from afar). Preemption and a lost node are
#: losses of infrastructure (planned again, not a restart); a cancel at the site is the
#: job's failure, for its recovery policy.
_INFRASTRUCTURE = (TaskState.PREEMPTED, TaskState.NODE_LOST)
_SITE_ENDED = (*_INFRASTRUCTURE, TaskState.CANCELLED)


def _taken_by_site(
    session: Session, settings: ControlSettings, job: Job, tasks: dict[int, Task]
) -> JobState | None:
    """RESCHEDULING or the recovery policy's word if a site engine ended a rank."""
    ended = sorted(r for r, t in tasks.items() if t.state in _SITE_ENDED)
    if not ended:
        return None
    # A preemption or a lost node first: the cancels beside it may be its consequences.
    rank = next((r for r in ended if tasks[r].state in _INFRASTRUCTURE), ended[0])
    task = tasks[rank]
    said = task.message or task.state.value
    reason = f"rank {rank} ({task.site}): the site ended it: {said}"
    if task.state in _INFRASTRUCTURE:
        recovery.reschedule(session, settings, job, reason)
        return JobState.RESCHEDULING
    failure = {
        "rank": rank,
        "site": task.site,
        "exit_code": task.exit_code,
        "message": task.message,
        "last_lines": last_lines(session, job.id, rank),
    }
    return recovery.worker_failed(session, settings, job, failure, reason)


def _stuck(job: Job, tasks: dict[int, Task], now: datetime) -> int | None:
    """The first running rank of a RUNNING job that has not moved on for too long."""
    if job.state is not JobState.RUNNING:
        return None
    limit = (job.spec.get("recovery") or {}).get("stuck_after_s")
    if not limit:
        return None
    for rank in sorted(tasks):
        task = tasks[rank]
        since = task.progressed_at or task.updated_at
        if task.state is TaskState.RUNNING and (now - since).total_seconds() > float(limit):
            return rank
    return None


def lost_gpus(session: Session, job_ids: list[str]) -> dict[str, str]:
    """Active jobs holding a GPU that is lost → where (site/node).

    A site whose ranks of the job's current epoch have all ended is done with its GPUs:
    a node its live agent registered away afterwards (a site engine's agent drops a
    drained node once the launch on it ended, while the other sites' ranks may still be
    finishing) is no loss to the job; how the ranks ended judges it (`advance`). Counted
    against the job's GPUs at the site (a rank per GPU), so a rank that has not reported
    its end keeps the site in the job. An agent lost (its lease expired) is a loss
    whatever its ranks reported: their failure may have been its loss seen early."""
    if not job_ids:
        return {}
    # The lost GPUs first (the loop asks on every pass, and almost always none is lost);
    # the rest only for the jobs that hold one.
    rows = session.execute(
        select(Allocation.job_id, Site.name, Node.name, Agent.status)
        .join(Gpu, Allocation.gpu_id == Gpu.id)
        .join(Node, Gpu.node_id == Node.id)
        .join(Site, Node.site_id == Site.id)
        .outerjoin(Agent, Node.agent_pk == Agent.id)
        .where(Allocation.job_id.in_(job_ids), Gpu.status == GpuStatus.LOST)
    ).all()
    if not rows:
        return {}
    jobs = sorted({job_id for job_id, *_ in rows})
    held = Counter(
        (job_id, site)
        for job_id, site in session.execute(
            select(Allocation.job_id, Site.name)
            .join(Gpu, Allocation.gpu_id == Gpu.id)
            .join(Node, Gpu.node_id == Node.id)
            .join(Site, Node.site_id == Site.id)
            .where(Allocation.job_id.in_(jobs))
        )
    )
    ended = Counter(
        (job_id, site)
        for job_id, site in session.execute(
            select(Task.job_id, Task.site)
            .join(Job, Job.id == Task.job_id)
            .where(
                Task.job_id.in_(jobs),
                Task.epoch == Job.epoch,
                Task.state.in_(FINAL_TASK_STATES),
            )
        )
    )
    out: dict[str, str] = {}
    for job_id, site, node, agent in sorted(rows, key=lambda r: (r[0], r[1], r[2])):
        # An agent lost is a loss whatever the ranks said; a node registered away by a
        # live agent is one only while a rank at its site has not ended.
        if job_id not in out and (
            agent is not AgentStatus.ALIVE or ended[(job_id, site)] < held[(job_id, site)]
        ):
            out[job_id] = f"{site}/{node}"
    return out


def live_tasks(session: Session, job: Job) -> int:
    """Ranks of the job's current epoch that still run on an agent that is not lost."""
    lost = (
        select(Site.name, Agent.agent_id)
        .join(Agent, Agent.site_id == Site.id)
        .where(Agent.status == AgentStatus.LOST)
    )
    return len(
        session.scalars(
            select(Task.rank).where(
                Task.job_id == job.id,
                Task.epoch == job.epoch,
                Task.state.in_((TaskState.PENDING, TaskState.STARTING, TaskState.RUNNING)),
                tuple_(Task.site, Task.agent_id).not_in(lost),
            )
        ).all()
    )
