"""What workers send back besides their state: per-step metrics and log lines.

Written in the same transaction as the task status that carried them (the servicer's
ReportTaskStatus), so a step or a line is stored exactly when the report is.

- Steps are summed per (job, step) over the ranks that reported them (`JobStep`): the
  series stays one row per step whatever the job's size. `Task.metrics_steps` is the next
  step expected from the rank, so a batch the agent sends twice (its reply was lost) is
  not counted twice.
- Log lines are appended per rank and only the newest `keep` lines of each rank are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from cpn.registry.models import Job, JobLogLine, JobStep, Task, utcnow


@dataclass(frozen=True)
class StepRecord:
    """One training step of one rank (the protocol's StepMetrics)."""

    step: int
    loss: float | None
    seconds: float
    bytes_intra_node: int
    bytes_intra_site: int
    bytes_wan: int
    #: The WAN sync that ran the step (`wan_sync` of the worker's record), if reported.
    wan_sync: str | None = None


def record_task_output(
    session: Session,
    task: Task,
    steps: Sequence[StepRecord],
    log_lines: Sequence[str],
    *,
    keep_lines: int,
) -> None:
    if not steps and not log_lines:
        return
    if session.get(Job, task.job_id) is None:
        return  # a report about a job this control plane does not know: nothing to keep
    if steps:
        _record_steps(session, task, steps)
    if log_lines:
        _record_lines(session, task.job_id, task.rank, log_lines, keep_lines)


def _record_steps(session: Session, task: Task, steps: Sequence[StepRecord]) -> None:
    # A step is counted once per rank: the first record of it wins, within a report as
    # across reports (a worker restarted in the same epoch replays the steps after its
    # checkpoint, and its agent may batch both runs of a step into one report).
    first: dict[int, StepRecord] = {}
    for s in steps:
        if s.step >= (task.metrics_steps or 0):
            first.setdefault(s.step, s)
    fresh = sorted(first.values(), key=lambda s: s.step)
    if not fresh:
        return
    wanted = {s.step for s in fresh}
    rows = {
        row.step: row
        for row in session.scalars(
            select(JobStep)
            .where(JobStep.job_id == task.job_id, JobStep.step.in_(wanted))
            .with_for_update()
        )
    }
    now = utcnow()
    for s in fresh:
        row = rows.get(s.step)
        if row is None:
            row = rows[s.step] = JobStep(
                job_id=task.job_id,
                step=s.step,
                ranks=0,
                loss_sum=0.0,
                loss_count=0,
                seconds=0.0,
                bytes_intra_node=0,
                bytes_intra_site=0,
                bytes_wan=0,
            )
            session.add(row)
        row.ranks += 1
        if s.loss is not None:
            row.loss_sum += s.loss
            row.loss_count += 1
        row.seconds = max(row.seconds, s.seconds)
        row.bytes_intra_node += s.bytes_intra_node
        row.bytes_intra_site += s.bytes_intra_site
        row.bytes_wan += s.bytes_wan
        if s.wan_sync is not None:  # every rank runs the same sync at a step
            row.wan_sync = s.wan_sync
        row.at = now
    task.metrics_steps = fresh[-1].step + 1


def _record_lines(
    session: Session, job_id: str, rank: int, lines: Sequence[str], keep: int
) -> None:
    now = utcnow()
    session.add_all(JobLogLine(job_id=job_id, rank=rank, line=line, at=now) for line in lines)
    session.flush()
    # The id of the oldest line to keep; everything of this rank before it goes.
    cutoff = session.scalar(
        select(JobLogLine.id)
        .where(JobLogLine.job_id == job_id, JobLogLine.rank == rank)
        .order_by(JobLogLine.id.desc())
        .offset(keep - 1)
        .limit(1)
    )
    if cutoff is not None:
        session.execute(
            delete(JobLogLine).where(
                JobLogLine.job_id == job_id, JobLogLine.rank == rank, JobLogLine.id < cutoff
            )
        )
