"""How far a job has got, from what its ranks reported: step of steps, loss, tokens/s,
and the bytes each link class carried, measured beside the plan's prediction.

Measured bytes are summed over the steps every rank has reported (`JobStep` rows with
all ranks in), and the prediction is the plan's bytes for that many steps
(`predicted_through`: per iteration, plus under `wan: outer` each outer exchange whole at
its step, per phase of a `wan: auto` schedule), so the two are comparable at any moment of
the run, not only at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from cpn.contracts import JobSpec
from cpn.contracts.plan import BytesPerIteration, WanAutoChoice, predicted_bytes
from cpn.registry.models import Job, JobStep, Task

LINK_CLASSES = ("intra_node", "intra_site", "wan")
#: tokens/s is averaged over this many of the last complete steps.
RATE_WINDOW = 10


def predicted_through(plan: Mapping[str, Any], steps: int) -> Callable[[int], dict[str, int]]:
    """For a stored plan of a run of `steps`: a function of `done` giving the predicted
    bytes by link class of the first `done` steps (`cpn.contracts.plan.predicted_bytes`),
    with the plan's two parts it needs validated once and alone (a plan's thousands of
    shards are not read for this)."""
    per = BytesPerIteration.model_validate(plan["bytes_per_iteration"])
    auto = plan.get("wan_auto")
    choice = WanAutoChoice.model_validate(auto) if auto else None
    return lambda done: predicted_bytes(per, choice, done, steps)


@dataclass(frozen=True)
class LinkBytes:
    measured: int
    predicted: int | None  # None: no plan yet


@dataclass(frozen=True)
class Progress:
    steps: int  # of the job
    step: int  # steps every rank has finished
    ranks: int  # world size (0 before a plan)
    ranks_reporting: int
    loss: float | None
    tokens_per_s: float | None
    bytes: dict[str, LinkBytes] = field(default_factory=dict)

    @classmethod
    def empty(cls, spec: JobSpec) -> Progress:
        return cls(spec.train.steps, 0, 0, 0, None, None, {})


def job_progress(session: Session, job: Job) -> Progress:
    spec = job.spec
    steps_total = int(spec["train"]["steps"])
    if job.plan is None:
        return Progress(steps_total, 0, 0, 0, None, None, {})
    parallel = job.plan["parallel"]
    world = int(parallel["dp"]) * int(parallel["tp"]) * int(parallel["pp"])
    reporting = (
        session.scalar(select(func.count()).select_from(Task).where(Task.job_id == job.id)) or 0
    )
    complete = select(JobStep).where(JobStep.job_id == job.id, JobStep.ranks >= world)
    totals = session.execute(
        select(
            func.count(),
            func.coalesce(func.sum(JobStep.bytes_intra_node), 0),
            func.coalesce(func.sum(JobStep.bytes_intra_site), 0),
            func.coalesce(func.sum(JobStep.bytes_wan), 0),
        ).where(JobStep.job_id == job.id, JobStep.ranks >= world)
    ).one()
    done = int(totals[0])
    predicted = predicted_through(job.plan, steps_total)(done)
    measured = dict(zip(LINK_CLASSES, (int(v) for v in totals[1:]), strict=True))
    recent = session.scalars(complete.order_by(JobStep.step.desc()).limit(RATE_WINDOW)).all()
    loss = None
    for row in recent:
        if row.loss_count:
            loss = row.loss_sum / row.loss_count
            break
    seconds = sum(r.seconds for r in recent)
    tokens = len(recent) * int(spec["train"]["global_batch"]) * int(spec["model"]["seq_len"])
    return Progress(
        steps=steps_total,
        step=done,
        ranks=world,
        ranks_reporting=int(reporting),
        loss=loss,
        tokens_per_s=tokens / seconds if recent and seconds > 0 else None,
        bytes={k: LinkBytes(measured=measured[k], predicted=predicted[k]) for k in LINK_CLASSES},
    )
