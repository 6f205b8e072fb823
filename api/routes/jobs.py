"""/v1/jobs: submit, list, get, cancel, events, per-step metrics, logs (followed as
server-sent events). A tenant sees only its own jobs: another's is a 404."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.sse import EventSourceResponse, format_sse_event

from api.deps import BearerDep, MetricsDep, PrincipalDep, ServiceDep, principal_of
from api.job_schemas import (
    EventPublic,
    FailurePublic,
    JobCreate,
    JobPublic,
    JobsPublic,
    LinkBytesPublic,
    LogLinePublic,
    LogsPublic,
    MetricsPublic,
    ProgressPublic,
    StepPublic,
)
from api.threads import in_thread
from cpn.contracts import Plan
from cpn.orchestration import JobView, QuoteChoice
from cpn.orchestration.errors import NeverFits, QuotaExceeded, ServiceError
from cpn.orchestration.progress import predicted_through
from cpn.registry.models import JobState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
# The endpoints are `async def` and hand their database work to a worker thread in one
# `run_in_threadpool` call (a submission: `in_thread`, the cheaper hop). A plain `def`
# endpoint costs two hops (FastAPI runs the function, and then the response model's
# validation, in the thread pool).

JobId = Annotated[str, Query(max_length=64)]
#: How often a followed log looks for new lines.
FOLLOW_POLL_S = 0.25


def job_public(view: JobView) -> JobPublic:
    job, p = view.job, view.progress
    return JobPublic(
        id=job.id,
        name=job.name,
        tenant=view.tenant,
        state=job.state,
        reason=job.state_reason,
        priority=job.priority,
        gpus=job.gpus,
        spec=job.spec,
        plan=Plan.model_validate(job.plan) if job.plan is not None else None,
        quote_id=job.quote_id,
        rendezvous=(
            f"{job.rendezvous_host}:{job.rendezvous_port}"
            if job.rendezvous_port is not None
            else None
        ),
        progress=ProgressPublic(
            step=p.step,
            steps=p.steps,
            ranks=p.ranks,
            ranks_reporting=p.ranks_reporting,
            loss=p.loss,
            tokens_per_s=p.tokens_per_s,
            bytes={
                k: LinkBytesPublic(measured=v.measured, predicted=v.predicted)
                for k, v in p.bytes.items()
            },
        ),
        failure=FailurePublic.model_validate(job.failure) if job.failure else None,
        epoch=job.epoch,
        restarts=job.restarts,
        losses=job.losses,
        checkpoint=job.checkpoint,
        created_at=job.created_at,
        scheduled_at=job.scheduled_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
    )


@router.post(
    "",
    response_model=JobPublic,
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"description": "The same Idempotency-Key and body were sent before: that job"},
        403: {"description": "The tenant's GPU quota would be exceeded"},
        409: {"description": "The Idempotency-Key was used with another body"},
        422: {"description": "A field is invalid, or the job can never fit (the shortfall)"},
    },
)
async def submit_job(
    body: JobCreate,
    service: ServiceDep,
    principal: PrincipalDep,
    metrics: MetricsDep,
    response: Response,
    idempotency_key: Annotated[
        str | None,
        Header(
            max_length=128,
            pattern=r"^[^\x00-\x1f\x7f]*$",
            description="Sending the same key (and body) again returns the first job.",
        ),
    ] = None,
) -> JobPublic:
    """Queue a job (the job YAML's fields as JSON). It waits PENDING, with the reason,
    until the GPUs it needs are free; a job that can never fit is refused with the
    shortfall."""
    quote = QuoteChoice(body.quote_id, body.candidate) if body.quote_id is not None else None
    try:
        view, created = await in_thread(
            service.submit,
            principal,
            body.spec(),
            idempotency_key=idempotency_key or None,
            quote=quote,
        )
    except NeverFits:
        metrics.refused.labels("never_fits").inc()
        raise
    except QuotaExceeded:
        metrics.refused.labels("quota").inc()
        raise
    if created:
        metrics.submitted.inc()
    else:
        response.status_code = status.HTTP_200_OK
    return job_public(view)


@router.get("", response_model=JobsPublic)
async def list_jobs(
    service: ServiceDep,
    principal: PrincipalDep,
    state: JobState | None = None,
    skip: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JobsPublic:
    """The tenant's jobs (every tenant's for an admin), newest first."""
    views, count = await run_in_threadpool(
        service.list_jobs, principal, state=state, skip=skip, limit=limit
    )
    return JobsPublic(data=[job_public(v) for v in views], count=count)


@router.get("/{job_id}", response_model=JobPublic)
async def get_job(job_id: str, service: ServiceDep, principal: PrincipalDep) -> JobPublic:
    """State and its reason, plan, progress (step of steps, loss, tokens/s, bytes per
    link class measured beside predicted), failure."""
    return job_public(await run_in_threadpool(service.get, principal, job_id))


@router.post("/{job_id}/cancel", response_model=JobPublic)
async def cancel_job(job_id: str, service: ServiceDep, principal: PrincipalDep) -> JobPublic:
    """Cancel: CANCELLED at once; every worker is stopped and the GPUs freed."""
    return job_public(await run_in_threadpool(service.cancel, principal, job_id))


@router.delete("/{job_id}", response_model=JobPublic)
async def delete_job(job_id: str, service: ServiceDep, principal: PrincipalDep) -> JobPublic:
    """The same as POST /v1/jobs/{id}/cancel (the job's record is kept)."""
    return job_public(await run_in_threadpool(service.cancel, principal, job_id))


@router.get("/{job_id}/events", response_model=list[EventPublic])
async def job_events(
    job_id: str,
    service: ServiceDep,
    principal: PrincipalDep,
    after: Annotated[int, Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[EventPublic]:
    """Every state transition with its reason, allocations, orders, rank states."""
    return [
        EventPublic(id=e.id, at=e.at, kind=e.kind, message=e.message, data=e.data)
        for e in await run_in_threadpool(
            service.events, principal, job_id, after=after, limit=limit
        )
    ]


@router.get("/{job_id}/metrics", response_model=MetricsPublic)
async def job_metrics(
    job_id: str,
    service: ServiceDep,
    principal: PrincipalDep,
    after: Annotated[int, Query(ge=-1, le=2**62, description="steps after this one")] = -1,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> MetricsPublic:
    """The per-step series: loss, the slowest rank's time, tokens/s, bytes by link class
    summed over ranks, and how many ranks reported the step."""
    job, rows = await run_in_threadpool(service.steps, principal, job_id, after=after, limit=limit)
    tokens = int(job.spec["train"]["global_batch"]) * int(job.spec["model"]["seq_len"])
    predicted = None
    ranks = 0
    through: Callable[[int], dict[str, int]] | None = None
    if job.plan is not None:
        per = job.plan["bytes_per_iteration"]
        predicted = {k: int(per[k]) for k in ("intra_node", "intra_site", "wan")}
        p = job.plan["parallel"]
        ranks = int(p["dp"]) * int(p["tp"]) * int(p["pp"])
        through = predicted_through(job.plan, int(job.spec["train"]["steps"]))

    def of_step(step: int) -> dict[str, int] | None:
        if through is None:
            return None
        after, before = through(step + 1), through(step)
        return {k: after[k] - before[k] for k in after}

    return MetricsPublic(
        job_id=job.id,
        ranks=ranks,
        predicted_bytes_per_step=predicted,
        steps=[
            StepPublic(
                step=r.step,
                loss=r.loss_sum / r.loss_count if r.loss_count else None,
                seconds=r.seconds,
                tokens_per_s=tokens / r.seconds if r.seconds > 0 else None,
                ranks=r.ranks,
                bytes={
                    "intra_node": r.bytes_intra_node,
                    "intra_site": r.bytes_intra_site,
                    "wan": r.bytes_wan,
                },
                wan_sync=r.wan_sync,
                predicted_bytes=of_step(r.step),
            )
            for r in rows
        ],
    )


def _line(row: object) -> LogLinePublic:
    return LogLinePublic.model_validate(row, from_attributes=True)


@router.get(
    "/{job_id}/logs",
    response_model=LogsPublic,
    responses={
        200: {
            "description": "The lines as JSON; with follow=true, a text/event-stream of "
            "`line` events (each a LogLinePublic) that ends with one `end` event when the "
            'job has ended, or with one `error` event ({"detail": …}) when it cannot go '
            "on: the API key was revoked, or the server is shutting down (then the event "
            'also says {"retry": true}: follow again with ?after= the id of the last line)',
            "content": {"text/event-stream": {}},
        }
    },
)
async def job_logs(
    job_id: str,
    request: Request,
    service: ServiceDep,
    principal: PrincipalDep,
    credentials: BearerDep,
    rank: Annotated[int | None, Query(ge=0, le=2**31)] = None,
    after: Annotated[int, Query(ge=0, le=2**62, description="lines after this id")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    follow: bool = False,
) -> Response | LogsPublic:
    """What the workers printed (the newest lines of each rank are kept). `follow=true`
    streams new lines as server-sent events and ends cleanly when the job ends."""
    job, lines, ended = await run_in_threadpool(
        service.logs, principal, job_id, rank=rank, after=after, limit=limit
    )
    if not follow:
        return LogsPublic(job_id=job.id, lines=[_line(x) for x in lines], ended=ended)
    key = credentials.credentials if credentials else None
    stopping: asyncio.Event = request.app.state.stopping

    def error(detail: str, retry: bool = False) -> bytes:
        body = {"detail": detail, "retry": True} if retry else {"detail": detail}
        return format_sse_event(data_str=json.dumps(body), event="error")

    async def stream() -> AsyncIterator[bytes]:
        nonlocal lines, ended
        last = after
        while True:
            for row in lines:
                last = row.id
                yield format_sse_event(
                    data_str=_line(row).model_dump_json(), event="line", id=str(row.id)
                )
            try:
                if ended and not lines:
                    final, _, _ = await run_in_threadpool(
                        service.logs, principal, job_id, rank=rank, after=last, limit=1
                    )
                    end = {"state": final.state.value, "reason": final.state_reason}
                    yield format_sse_event(data_str=json.dumps(end), event="end")
                    return
                if not lines:
                    # Not wait_for: Python 3.11's swallows a cancel (the client left) that
                    # comes as the wait ends, and the stream would poll on for nobody.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(FOLLOW_POLL_S):
                            await stopping.wait()
                if stopping.is_set():
                    yield error(
                        f"the server is shutting down; follow again after line {last}", retry=True
                    )
                    return
                # The key is checked again on every poll (through the key cache), so a
                # revoked key stops a stream as promptly as it stops any other request.
                await principal_of(request, key)
                _, lines, ended = await run_in_threadpool(
                    service.logs, principal, job_id, rank=rank, after=last, limit=limit
                )
            except ServiceError as exc:  # the key was revoked, the job is gone
                yield error(str(exc))
                return

    return EventSourceResponse(stream())
