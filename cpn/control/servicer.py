"""The `cpn.v1.AgentService` servicer: registration, heartbeats, orders, task status.

Runs on the gRPC server's event loop. Heartbeats never touch the database on the way in
(hot lease state lives in `LeaseTable`); registrations and task reports do, on the single
database thread (`ControlState.db`), which also serialises them with the reaper's and the
flusher's writes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, ParamSpec, TypeVar

import grpc
from grpc import aio
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from cpn.control import references, task_output, validation
from cpn.control.auth import authenticated_site
from cpn.control.db_status import database_status
from cpn.control.dispatch import AssignmentDispatcher
from cpn.control.errors import InvalidField, clip_details, quote
from cpn.control.leases import LeaseTable, LiveLease
from cpn.control.reconcile import forget_gone_launches
from cpn.control.settings import ControlSettings
from cpn.control.tokens import SiteTokens
from cpn.registry import Registry
from cpn.registry.events import EventKind, record_event
from cpn.registry.inventory import AgentRegistration, NodeOwnedError, Registered, register_agent
from cpn.registry.job_output import StepRecord, record_task_output
from cpn.registry.models import FINAL_TASK_STATES, Job, Task, TaskState, utcnow
from proto.cpn.v1 import agent_pb2 as pb
from proto.cpn.v1 import agent_pb2_grpc

log = logging.getLogger("cpn.control")
T = TypeVar("T")
P = ParamSpec("P")
if TYPE_CHECKING:
    Context = aio.ServicerContext[Any, Any]


@dataclass(frozen=True)
class TaskReport:
    """A task status as the orchestration sees it (listeners get one per report)."""

    site: str
    agent_id: str
    job_id: str
    rank: int
    state: TaskState
    step: int
    loss: float | None
    bytes_intra_node: int
    bytes_intra_site: int
    bytes_wan: int
    checkpoint_id: str
    exit_code: int
    message: str
    steps: tuple[StepRecord, ...] = ()
    log_lines: tuple[str, ...] = ()
    epoch: int = 0


@dataclass
class ControlState:
    """What the servicer, the reaper and the flusher share."""

    settings: ControlSettings
    registry: Registry
    tokens: SiteTokens
    leases: LeaseTable = field(default_factory=LeaseTable)
    dispatcher: AssignmentDispatcher = field(init=False)
    db: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="cpn-db")
    )
    task_listeners: list[Callable[[TaskReport], None]] = field(default_factory=list)
    #: Called with (site, agent id) once an agent was declared lost (its GPUs marked lost).
    loss_listeners: list[Callable[[str, str], None]] = field(default_factory=list)
    heartbeats: int = 0  # received since start (Prometheus /metrics)

    def __post_init__(self) -> None:
        self.dispatcher = AssignmentDispatcher(self.registry, self.settings.order_poll_s)

    async def run_db(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            call = functools.partial(fn, *args, **kwargs)
            return await asyncio.get_running_loop().run_in_executor(self.db, call)
        except SQLAlchemyError as exc:
            # UNAVAILABLE only when retrying can help (the database is down or busy); an
            # error the request caused must not send a client into endless retries.
            code, details = database_status(exc)
            log.error("registry write failed (%s)", code.name, exc_info=exc)
            raise _Denied(code, details) from exc


class _Denied(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _authorize(site: str) -> None:
    """The token's site must be the site the request speaks for."""
    token_site = authenticated_site.get(None)
    if token_site is None:  # only reachable if the interceptor is not installed
        raise _Denied(grpc.StatusCode.UNAUTHENTICATED, "no authenticated site")
    if site and site != token_site:
        raise _Denied(
            grpc.StatusCode.PERMISSION_DENIED,
            f"site: this token is for site {token_site!r}, not {quote(site)}",
        )


async def _abort(context: Context, exc: Exception) -> NoReturn:
    if isinstance(exc, InvalidField):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, clip_details(str(exc)))
    if isinstance(exc, _Denied):
        await context.abort(exc.code, clip_details(str(exc)))
    raise exc


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, state: ControlState) -> None:
        self.s = state
        self._peers_cache: tuple[int, list[LiveLease]] = (0, [])

    # ------------------------------------------------------------------ helpers

    def _live_lease(self, site: str, agent_id: str, lease_id: str) -> LiveLease:
        lease = self.s.leases.get(lease_id)
        if lease is None or lease.key != (site, agent_id):
            raise _Denied(grpc.StatusCode.NOT_FOUND, "lease_id: unknown lease; register again")
        if lease.restored:
            raise _Denied(
                grpc.StatusCode.NOT_FOUND, "lease_id: the control plane restarted; register again"
            )
        if lease.expired(time.monotonic()):
            raise _Denied(grpc.StatusCode.NOT_FOUND, "lease_id: lease expired; register again")
        return lease

    def _peers(self, site: str) -> list[pb.Peer]:
        version, cached = self._peers_cache
        if version != self.s.leases.peers_version:
            cached = [
                lease
                for lease in self.s.leases.live()
                if lease.probe_address and not lease.restored
            ]
            cached.sort(key=lambda lease: lease.key)
            self._peers_cache = (self.s.leases.peers_version, cached)
        return [
            pb.Peer(site=lease.site, agent_id=lease.agent_id, probe_address=lease.probe_address)
            for lease in cached
            if lease.site != site
        ]

    # ------------------------------------------------------------------ RPCs

    async def Register(self, request: pb.RegisterRequest, context: Context) -> pb.RegisterResponse:
        try:
            _authorize(request.site)
            reg = validation.register_request(request)
        except (InvalidField, _Denied) as exc:
            await _abort(context, exc)
        ttl_ms = int(self.s.settings.lease_ttl_s * 1000)
        lease_id = str(uuid.uuid4())
        try:
            registered, gone = await self.s.run_db(self._register_tx, reg, lease_id, ttl_ms)
        except NodeOwnedError as exc:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, clip_details(f"{exc.field}: {exc}")
            )
        except _Denied as exc:
            await _abort(context, exc)
        lease = LiveLease(
            lease_id=lease_id,
            site=reg.site,
            agent_id=reg.agent_id,
            agent_pk=registered.agent_pk,
            site_id=registered.site_id,
            lease_pk=registered.lease_pk,
            ttl_s=self.s.settings.lease_ttl_s,
            expires_mono=time.monotonic() + self.s.settings.lease_ttl_s,
            probe_address=reg.probe_address,
            gpu_ids=registered.gpu_ids,
        )
        self.s.leases.put(lease)
        if gone:
            log.warning(
                "agent %s/%s restarted without the workers of %s",
                reg.site, reg.agent_id, ", ".join(gone),
            )  # fmt: skip
            for listener in self.s.loss_listeners:  # the loop looks at every job now
                listener(reg.site, reg.agent_id)
        log.info(
            "agent %s/%s registered (%d nodes, registration %d)",
            reg.site,
            reg.agent_id,
            len(reg.nodes),
            registered.registrations,
        )
        return pb.RegisterResponse(
            lease_id=lease_id,
            lease_ttl_ms=ttl_ms,
            heartbeat_interval_ms=int(self.s.settings.heartbeat_interval_s * 1000),
            peers=self._peers(reg.site),
            peers_version=self.s.leases.peers_version,
        )

    def _register_tx(
        self, reg: AgentRegistration, lease_id: str, ttl_ms: int
    ) -> tuple[Registered, list[str]]:
        with self.s.registry.write() as session:
            registered = register_agent(
                session,
                reg,
                lease_id=lease_id,
                ttl_ms=ttl_ms,
                now=utcnow(),
                site_settings=self.s.tokens.settings.get(reg.site),
            )
            gone = (
                []
                if reg.launches is None
                else forget_gone_launches(session, reg.site, reg.agent_id, reg.launches)
            )
        return registered, gone

    def _beat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        """One heartbeat, unary or on a stream: check it, renew the lease in memory."""
        _authorize(request.site)
        beat = validation.heartbeat_request(request, known_sites=self.s.tokens.settings)
        self.s.heartbeats += 1
        lease = self._live_lease(request.site, request.agent_id, request.lease_id)
        validation.usage_references(request.gpus, lease.gpu_ids)
        self.s.leases.renew(lease, time.monotonic(), beat.health, request.gpus, beat.links)
        version = self.s.leases.peers_version
        response = pb.HeartbeatResponse(
            lease_ttl_ms=int(lease.ttl_s * 1000),
            heartbeat_interval_ms=int(self.s.settings.heartbeat_interval_s * 1000),
            peers_version=version,
        )
        if request.peers_version != version:
            response.peers_changed = True
            response.peers.extend(self._peers(request.site))
        return response

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: Context
    ) -> pb.HeartbeatResponse:
        try:
            return self._beat(request)
        except (InvalidField, _Denied) as exc:
            await _abort(context, exc)

    async def HeartbeatStream(
        self, request_iterator: AsyncIterator[pb.HeartbeatRequest], context: Context
    ) -> AsyncIterator[pb.HeartbeatResponse]:
        async for request in request_iterator:
            try:
                response = self._beat(request)
            except (InvalidField, _Denied) as exc:
                await _abort(context, exc)
            yield response

    async def WatchAssignments(
        self, request: pb.WatchAssignmentsRequest, context: Context
    ) -> AsyncIterator[pb.Assignment]:
        try:
            _authorize(request.site)
            validation.lease(request.site, request.agent_id, request.lease_id)
            self._live_lease(request.site, request.agent_id, request.lease_id)
        except (InvalidField, _Denied) as exc:
            await _abort(context, exc)
        try:
            async for assignment in self.s.dispatcher.stream(request.site, request.agent_id):
                yield assignment
        except _Denied as exc:  # the database failed: the agent retries with backoff
            await _abort(context, exc)

    async def ReportTaskStatus(
        self, request: pb.ReportTaskStatusRequest, context: Context
    ) -> pb.ReportTaskStatusResponse:
        try:
            _authorize(request.site)
            state = validation.task_status_request(request)
            steps = task_output.steps(request)
            log_lines = task_output.log_lines(request)
            self._live_lease(request.site, request.agent_id, request.lease_id)
        except (InvalidField, _Denied) as exc:
            await _abort(context, exc)
        report = TaskReport(
            site=request.site,
            agent_id=request.agent_id,
            job_id=request.job_id,
            rank=request.rank,
            state=state,
            step=request.step,
            loss=request.loss if request.HasField("loss") else None,
            bytes_intra_node=request.bytes.intra_node,
            bytes_intra_site=request.bytes.intra_site,
            bytes_wan=request.bytes.wan,
            checkpoint_id=request.checkpoint_id,
            exit_code=request.exit_code,
            message=request.message,
            steps=steps,
            log_lines=log_lines,
            epoch=request.epoch,
        )
        try:
            await self.s.run_db(self._task_tx, report)
        except (InvalidField, _Denied) as exc:
            await _abort(context, exc)
        for listener in self.s.task_listeners:
            try:
                listener(report)
            except Exception:
                log.exception("task listener failed")
        return pb.ReportTaskStatusResponse()

    def _task_tx(self, r: TaskReport) -> None:
        with self.s.registry.write() as session:
            references.check_task(
                session, site=r.site, agent_id=r.agent_id, job_id=r.job_id, rank=r.rank
            )
            # The epoch and the spec only: a job's plan (one row per shard) is large.
            job = session.execute(
                select(Job.epoch, Job.spec).where(Job.id == r.job_id)
            ).one_or_none()
            job_epoch = None if job is None else job.epoch
            if job is not None:
                _check_against_job(r, job.epoch, job.spec)
            if job_epoch is not None and r.epoch < job_epoch:
                # A worker of a fenced epoch (stopped, or cut off and not yet told): its
                # state is no longer the rank's, its steps not the job's.
                log.info(
                    "job %s rank %d: report of epoch %d ignored (the job is at epoch %d)",
                    r.job_id,
                    r.rank,
                    r.epoch,
                    job_epoch,
                )
                return
            task = session.scalar(select(Task).where(Task.job_id == r.job_id, Task.rank == r.rank))
            previous = task.state if task is not None else None
            if task is None:
                task = Task(job_id=r.job_id, rank=r.rank)
                session.add(task)
            elif task.epoch != r.epoch:  # the first report of a new epoch: a new task
                previous = None
                task.metrics_steps = 0
            task.epoch = r.epoch
            now = utcnow()
            if previous != r.state or r.step > (task.step or 0):
                task.progressed_at = now  # started, or moved on: not stuck
            task.site = r.site
            task.agent_id = r.agent_id
            task.state = r.state
            task.step = r.step
            if r.loss is not None:
                task.loss = r.loss
            task.bytes_intra_node = r.bytes_intra_node
            task.bytes_intra_site = r.bytes_intra_site
            task.bytes_wan = r.bytes_wan
            if r.checkpoint_id:
                task.checkpoint_id = r.checkpoint_id
            task.exit_code = r.exit_code if r.state in _FINAL else None
            task.message = r.message
            task.updated_at = now
            session.flush()
            record_task_output(
                session, task, r.steps, r.log_lines, keep_lines=self.s.settings.log_lines_kept
            )
            if previous != r.state:
                record_event(
                    session,
                    EventKind.TASK_STATE,
                    f"job {r.job_id} rank {r.rank}: {r.state.value}"
                    + (f" ({r.message})" if r.message else ""),
                    site=r.site,
                    agent_id=r.agent_id,
                    job_id=r.job_id,
                    data={"rank": r.rank, "state": r.state.value, "step": r.step},
                )


def _check_against_job(r: TaskReport, epoch: int, spec: dict[str, Any]) -> None:
    """Refuse what no worker of the job can report: an epoch the control plane has not
    started (it would replace the rank's task of the current one), steps beyond the
    job's `train.steps` (a step's series would stop at the bogus one)."""
    if r.epoch > epoch:
        raise InvalidField("epoch", f"{r.epoch} is newer than the job's epoch {epoch}")
    train = spec.get("train")
    total = train.get("steps") if isinstance(train, dict) else None
    if not isinstance(total, int):
        return  # not a stored JobSpec: nothing to check against
    if r.step > total:
        raise InvalidField("step", f"at most the job's train.steps ({total}), got {r.step}")
    for i, s in enumerate(r.steps):
        if s.step >= total:
            raise InvalidField(
                f"steps[{i}].step", f"at most {total - 1} (0-based; train.steps = {total})"
            )


_FINAL = FINAL_TASK_STATES

__all__ = ["AgentServicer", "ControlState", "TaskReport"]
