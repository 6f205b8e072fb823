"""After a loss: which checkpoint a job resumes from, and how it is planned again.

A job whose placement lost an agent goes RESCHEDULING (`reschedule`): the newest complete
checkpoint its current epoch wrote *so far*, up to the last step the control plane saw it
reach, becomes its resume point — fixed now, so that whatever a fenced (cut-off, not yet
stopped) worker of that epoch writes later is never used. Its other workers are then
stopped and its GPUs freed by the loop, and admission plans it again (`replan`): the same
layout if it fits on what is left, else the best layout `parallel: auto` finds within the
job's GPU budget (fewer GPUs if need be), with the same global batch, so the loss curve
goes on from the checkpoint.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from cpn.contracts import JobSpec, OnWorkerError, Plan, Reservations, Topology
from cpn.control.settings import ControlSettings
from cpn.errors import InfeasibleError, InputError
from cpn.orchestration import states
from cpn.registry.models import Job, JobState, JobStep, Task, utcnow
from cpn.scheduler import SolverSettings, plan_job
from cpn.train.checkpoint import CheckpointStore

log = logging.getLogger("cpn.orchestration")

#: Budgets `replan` tries with `parallel: auto` when the job's layout no longer fits.
MAX_AUTO_BUDGETS = 8


def epoch_store(settings: ControlSettings, job_id: str, epoch: int) -> str | None:
    """Where epoch `epoch` of a job writes its checkpoints (None: no checkpoint root)."""
    root = settings.checkpoint_root
    return None if root is None else f"{root.rstrip('/')}/{job_id}/e{epoch}"


def newest_checkpoint(
    session: Session, settings: ControlSettings, job: Job
) -> dict[str, Any] | None:
    """The newest complete step of the job's current epoch, for the same model, that the
    control plane has seen the epoch reach (its per-step series): a step written by
    workers that went out of touch before it — a site cut off, training on unseen — is
    not trusted, and the series goes on without a gap. None if there is none."""
    url = epoch_store(settings, job.id, job.epoch)
    if url is None or job.epoch == 0:
        return None
    seen = session.scalar(select(func.max(JobStep.step)).where(JobStep.job_id == job.id))
    if seen is None:
        return None
    try:
        store = CheckpointStore(url)
        spec = JobSpec.model_validate(job.spec)
        for step in reversed(store.complete_steps()):
            if step > seen + 1:  # steps 0..step-1 are in it: the last one must have been seen
                continue
            if store.info(step).model == spec.model.model_dump():
                return {"epoch": job.epoch, "step": step, "path": store.step_url(step)}
    except InputError as exc:  # an unreadable store: resume from the previous point
        log.warning("job %s: checkpoints of epoch %d unusable: %s", job.id, job.epoch, exc)
    return None


def reschedule(session: Session, settings: ControlSettings, job: Job, why: str) -> None:
    """Fence the job's current epoch and queue it to be planned again (in the caller's
    transaction): its resume point is fixed now, and it counts as an infrastructure loss
    (not against `recovery.max_restarts`)."""
    found = newest_checkpoint(session, settings, job)
    if found is not None:
        job.checkpoint = found
    job.losses += 1
    point = job.checkpoint
    resume = (
        f"resumes from step {point['step']} (epoch {point['epoch']})"
        if point
        else "starts again from step 0 (no checkpoint)"
    )
    states.transition(
        session,
        job,
        JobState.RESCHEDULING,
        f"{why}; epoch {job.epoch} fenced, planned again on what is left, {resume}",
        data={"epoch": job.epoch, "checkpoint": point},
    )


def worker_failed(
    session: Session,
    settings: ControlSettings,
    job: Job,
    failure: dict[str, Any],
    reason: str,
) -> JobState:
    """A rank failed in user code (or is stuck): the job's recovery policy decides. With
    `on_worker_error: restart` and restarts left, the epoch is fenced and the job planned
    again after a backoff (doubling per restart), from its last checkpoint; else FAILED,
    with the rank, its exit code and last lines in `failure`."""
    policy = JobSpec.model_validate(job.spec).recovery
    if policy.on_worker_error is OnWorkerError.RESTART and job.restarts < policy.max_restarts:
        job.restarts += 1
        delay = min(
            settings.restart_backoff_s * 2 ** (job.restarts - 1), settings.restart_backoff_max_s
        )
        job.not_before = utcnow() + timedelta(seconds=delay)
        found = newest_checkpoint(session, settings, job)
        if found is not None:
            job.checkpoint = found
        point = job.checkpoint
        resume = f"from step {point['step']} (epoch {point['epoch']})" if point else "from step 0"
        states.transition(
            session,
            job,
            JobState.RESCHEDULING,
            f"{reason}; restart {job.restarts} of {policy.max_restarts} in {delay:g} s, "
            f"resuming {resume}",
            data={"epoch": job.epoch, "checkpoint": point, "failure": failure},
        )
        return JobState.RESCHEDULING
    if policy.on_worker_error is OnWorkerError.RESTART and policy.max_restarts:
        reason += f" (after {job.restarts} restarts)"
    job.failure = failure
    states.transition(session, job, JobState.FAILED, reason, data={"failure": failure})
    return JobState.FAILED


def replan(
    spec: JobSpec,
    previous: Plan,
    topology: Topology,
    held: Reservations,
    settings: ControlSettings,
) -> tuple[Plan, str]:
    """A plan for a job that ran with `previous`: its layout if that fits, else `auto`
    within its GPU budget, largest budget first. InfeasibleError if nothing fits."""
    solver = SolverSettings(time_limit=settings.plan_time_limit_s)
    same = spec.model_copy(update={"parallel": previous.parallel, "gpus": None})
    try:
        return plan_job(topology, same, held, settings=solver), "the same layout"
    except (InfeasibleError, InputError) as exc:
        first = exc
    budget = previous.parallel.world_size
    free = topology.gpu_count - sum(
        len(gpus) for nodes in held.gpus.values() for gpus in nodes.values()
    )
    tried = 0
    for gpus in range(min(budget, free), 0, -1):
        if tried == MAX_AUTO_BUDGETS:
            break
        auto = JobSpec.model_validate(
            {**spec.model_dump(mode="json"), "parallel": "auto", "gpus": gpus}
        )
        tried += 1
        try:
            plan = plan_job(topology, auto, held, settings=solver)
        except (InfeasibleError, InputError):
            continue
        p = plan.parallel
        return plan, f"layout dp={p.dp} tp={p.tp} pp={p.pp} on {gpus} GPUs (auto)"
    raise InfeasibleError(f"{first}; and no other layout within {budget} GPUs fits")


def restart_epoch(session: Session, job: Job) -> None:
    """Before a new epoch of a job that ran: its ranks start over (a new layout may number
    them otherwise) and the per-step series goes on from the resume point."""
    session.execute(delete(Task).where(Task.job_id == job.id))
    start = int(job.checkpoint["step"]) if job.checkpoint else 0
    session.execute(delete(JobStep).where(JobStep.job_id == job.id, JobStep.step >= start))


__all__ = [
    "epoch_store",
    "newest_checkpoint",
    "replan",
    "reschedule",
    "restart_epoch",
    "worker_failed",
]
