"""The job service: what the REST API asks of the orchestration layer.

Every method takes the `Principal` the request acts for and sees only that tenant's jobs
(an admin sees all); another tenant's job is `NotFound`, exactly like one that does not
exist, so ids cannot be probed. Methods are synchronous (the API calls them from its
worker threads) and each write is one transaction.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Integer,
    Select,
    Text,
    bindparam,
    cast,
    exists,
    func,
    insert,
    literal,
    select,
    true,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from cpn.contracts import JobSpec, Plan, Topology
from cpn.control.settings import ControlSettings
from cpn.orchestration import states
from cpn.orchestration.errors import (
    Conflict,
    InvalidRequest,
    NeverFits,
    NotFound,
    QuotaExceeded,
    Unauthorized,
)
from cpn.orchestration.feasibility import FeasibilityCache, topology_fingerprint
from cpn.orchestration.progress import Progress, job_progress
from cpn.orchestration.tenants import Principal
from cpn.registry import EmptyRegistry, Registry, build_topology
from cpn.registry.events import EventKind
from cpn.registry.models import (
    Event,
    Job,
    JobLogLine,
    JobState,
    JobStep,
    Quote,
    Task,
    Tenant,
    utcnow,
)

#: How long a snapshot of the live topology answers "could this job ever fit?".
SNAPSHOT_S = 1.0


def gpus_of(spec: JobSpec) -> int:
    """GPUs a job asks for: its world size, or its budget with parallel: auto."""
    if spec.parallel == "auto":
        assert spec.gpus is not None
        return spec.gpus
    return spec.parallel.world_size


def request_hash(body: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class QuoteChoice:
    quote_id: str
    candidate: int


@dataclass(frozen=True)
class JobView:
    job: Job
    tenant: str | None
    progress: Progress


class JobService:
    def __init__(
        self,
        registry: Registry,
        settings: ControlSettings,
        wake: Callable[[], None] | None = None,
        capacity_version: Callable[[], int] | None = None,
        submitted: Callable[[], None] | None = None,
    ) -> None:
        """`wake`: tell the orchestration loop a job came or went. `submitted`: tell it a
        job was queued, when it has a cheaper tick for that (Orchestrator.submitted; by
        default `wake`). `capacity_version`: changes whenever the live agents change (the
        control server's peers version), so that the never-fit check sees a new site at
        once, not up to SNAPSHOT_S later."""
        self.registry = registry
        self.settings = settings
        self.wake = wake or (lambda: None)
        self.submitted = submitted or self.wake
        self._feasible = FeasibilityCache()
        self.capacity_version = capacity_version or (lambda: 0)
        self._snapshot: tuple[float, Topology | None, str, int] = (float("-inf"), None, "", -1)
        self._snapshot_lock = threading.Lock()

    # ------------------------------------------------------------------ reading

    def _visible(self, session: Session, principal: Principal, job_id: str) -> Job:
        # An id that cannot be one (too long, or with a NUL that PostgreSQL refuses in a
        # query) is simply not found.
        job = session.get(Job, job_id) if _could_be_id(job_id) else None
        if job is None or not (principal.admin or job.tenant_id == principal.tenant_id):
            raise NotFound(f"job {job_id[:64]!r}: no such job")
        return job

    def get(self, principal: Principal, job_id: str) -> JobView:
        with self.registry.read() as session:
            job = self._visible(session, principal, job_id)
            return self._view(session, job)

    def _view(self, session: Session, job: Job) -> JobView:
        tenant = session.get(Tenant, job.tenant_id) if job.tenant_id is not None else None
        return JobView(job, tenant.name if tenant else None, job_progress(session, job))

    def list_jobs(
        self,
        principal: Principal,
        *,
        state: JobState | None = None,
        skip: int = 0,
        limit: int = 50,
    ) -> tuple[list[JobView], int]:
        where = [] if principal.admin else [Job.tenant_id == principal.tenant_id]
        if state is not None:
            where.append(Job.state == state)
        with self.registry.read() as session:
            count = session.scalar(select(func.count()).select_from(Job).where(*where)) or 0
            jobs = session.scalars(
                select(Job)
                .where(*where)
                .order_by(Job.created_at.desc(), Job.id)
                .offset(skip)
                .limit(limit)
            ).all()
            return [self._view(session, j) for j in jobs], count

    def events(
        self, principal: Principal, job_id: str, *, after: int = 0, limit: int = 1000
    ) -> list[Event]:
        with self.registry.read() as session:
            self._visible(session, principal, job_id)
            return list(
                session.scalars(
                    select(Event)
                    .where(Event.job_id == job_id, Event.id > after)
                    .order_by(Event.id)
                    .limit(limit)
                )
            )

    def steps(
        self, principal: Principal, job_id: str, *, after: int = -1, limit: int = 10_000
    ) -> tuple[Job, list[JobStep]]:
        with self.registry.read() as session:
            job = self._visible(session, principal, job_id)
            rows = session.scalars(
                select(JobStep)
                .where(JobStep.job_id == job_id, JobStep.step > after)
                .order_by(JobStep.step)
                .limit(limit)
            ).all()
            return job, list(rows)

    def logs(
        self,
        principal: Principal,
        job_id: str,
        *,
        rank: int | None = None,
        after: int = 0,
        limit: int = 1000,
    ) -> tuple[Job, list[JobLogLine], bool]:
        """Lines after id `after` (oldest first), and whether nothing more can come: the
        job has ended and none of its ranks still runs."""
        with self.registry.read() as session:
            job = self._visible(session, principal, job_id)
            where = [JobLogLine.job_id == job_id, JobLogLine.id > after]
            if rank is not None:
                where.append(JobLogLine.rank == rank)
            lines = session.scalars(
                select(JobLogLine).where(*where).order_by(JobLogLine.id).limit(limit)
            ).all()
            done = job.state.terminal and not self._ranks_still_running(session, job)
            return job, list(lines), done

    def _ranks_still_running(self, session: Session, job: Job) -> bool:
        if job.finished_at is not None:
            grace = self.settings.stop_grace_s
            if (utcnow() - job.finished_at).total_seconds() > grace:
                return False  # an agent that never answered: stop waiting for its lines
        live = session.scalar(
            select(func.count())
            .select_from(Task)
            .where(Task.job_id == job.id, Task.state.in_(("starting", "running")))
        )
        return bool(live)

    # ------------------------------------------------------------------ submitting

    def capacity(self) -> tuple[Topology | None, str]:
        """The live topology (every GPU counted free) and its fingerprint, at most
        SNAPSHOT_S old, or newer than the last change of `capacity_version` (agents of
        this process came or went).

        One thread rebuilds an expired snapshot while the others keep answering from the
        previous one (at most SNAPSHOT_S older): under load, every submission used to
        wait for the rebuild. Only a changed version (or no snapshot yet) makes them wait.
        """
        version = self.capacity_version()
        taken, topology, fingerprint, seen = self._snapshot
        fresh = time.monotonic() - taken < SNAPSHOT_S
        if seen == version and (fresh or not self._snapshot_lock.acquire(blocking=False)):
            return topology, fingerprint
        if not (seen == version and not fresh):  # the lock is not ours yet: wait for it
            self._snapshot_lock.acquire()
        try:
            taken, topology, fingerprint, seen = self._snapshot
            if seen == version and time.monotonic() - taken < SNAPSHOT_S:
                return topology, fingerprint  # rebuilt meanwhile by another thread
            with self.registry.read() as session:
                try:
                    topology, _ = build_topology(session)
                    fingerprint = topology_fingerprint(topology)
                except EmptyRegistry:
                    topology, fingerprint = None, ""
            self._snapshot = (time.monotonic(), topology, fingerprint, version)
            return topology, fingerprint
        finally:
            self._snapshot_lock.release()

    def submit(
        self,
        principal: Principal,
        spec: JobSpec,
        *,
        idempotency_key: str | None = None,
        quote: QuoteChoice | None = None,
    ) -> tuple[JobView, bool]:
        """Queue a job. Returns it and whether it was made now (False: the same
        Idempotency-Key was used before with the same body, and that job is returned).

        The hot path is one write transaction of three statements — the tenant's quota
        and the Idempotency-Key looked up together, the job, its event — plus the
        never-fit check answered from a cache. The tenant's row is locked only when it
        has a quota: that is what makes two racing submissions count each other; with no
        quota there is nothing to count, and a racing reuse of an Idempotency-Key is
        caught by the (tenant, key) unique constraint.
        """
        spec_json = spec.model_dump(mode="json")
        body: dict[str, object] = {"spec": spec_json}
        if quote is not None:
            body["quote"] = [quote.quote_id, quote.candidate]
        digest = request_hash(body)
        try:
            plan: Plan | None = None
            if quote is not None:
                spec, plan = self._quoted(principal, spec, quote)
                spec_json = spec.model_dump(mode="json")
            topology, fingerprint = self.capacity()
            if topology is not None:
                missing = self._feasible.shortfall(topology, fingerprint, spec)
                if missing is not None:
                    raise NeverFits(f"the job can never fit: {missing}")
        except (InvalidRequest, NeverFits):
            # A retry of a request that was accepted returns its job, even if the quote
            # has expired or the network shrank since.
            if idempotency_key is not None:
                existing = self._by_key(principal, idempotency_key, digest)
                if existing is not None:
                    return existing, False
            raise
        gpus = gpus_of(spec)
        now = utcnow()
        job = Job(
            id=f"job-{uuid.uuid4().hex[:12]}",
            name=spec.name,
            state=JobState.PENDING,
            state_reason="queued",
            spec=spec_json,
            plan=plan.model_dump(mode="json") if plan is not None else None,
            tenant_id=principal.tenant_id,
            priority=spec.priority,
            gpus=gpus,
            idempotency_key=idempotency_key,
            request_hash=digest,
            quote_id=quote.quote_id if quote is not None else None,
            quote_candidate=quote.candidate if quote is not None else None,
            rendezvous_host="",
            rendezvous_port=None,
            failure=None,
            epoch=0,
            checkpoint=None,
            restarts=0,
            losses=0,
            not_before=None,
            created_at=now,
            updated_at=now,
            scheduled_at=None,
            started_at=None,
            finished_at=None,
        )
        submitted = (
            f"job {job.id} ({spec.name}) submitted by ",
            f": {gpus} GPUs, priority {spec.priority}",
        )
        try:
            if self.registry.dialect == "postgresql":
                name = self._insert_at_once(job, principal, idempotency_key, submitted)
                if name is not None:
                    self.submitted()
                    return JobView(job, name, Progress.empty(spec)), True
            with self.registry.write() as session:
                tenant = self._tenant_for_submit(session, principal, idempotency_key)
                if tenant.existing is not None and idempotency_key is not None:
                    first = session.get(Job, tenant.existing)
                    assert first is not None
                    if first.request_hash != digest:
                        raise Conflict(
                            f"Idempotency-Key: {idempotency_key[:64]!r} was used for job "
                            f"{first.id} with another body"
                        )
                    return self._view(session, first), False
                if tenant.gpu_quota is not None:
                    held = session.scalar(
                        select(func.coalesce(func.sum(Job.gpus), 0)).where(
                            Job.tenant_id == principal.tenant_id, Job.state.in_(states.UNFINISHED)
                        )
                    )
                    if int(held or 0) + gpus > tenant.gpu_quota:
                        raise QuotaExceeded(
                            f"quota: tenant {tenant.name!r} may hold {tenant.gpu_quota} GPUs; "
                            f"its unfinished jobs ask for {held}, this one for {gpus}"
                        )
                # Core inserts on the session's connection: the ORM's unit of work (and
                # its bulk-insert path) cost more than the two statements themselves.
                connection = session.connection()
                connection.execute(_INSERT_JOB, _columns(job))
                connection.execute(
                    _INSERT_EVENT,
                    {
                        "at": now,
                        "kind": EventKind.JOB_SUBMITTED.value,
                        "site": None,
                        "agent_id": None,
                        "job_id": job.id,
                        "message": submitted[0] + tenant.name + submitted[1],
                        "data": {"tenant": tenant.name, "gpus": gpus, "priority": spec.priority},
                    },
                )
                view = JobView(job, tenant.name, Progress.empty(spec))
        except IntegrityError:
            # The same Idempotency-Key raced in from another request: return that job.
            if idempotency_key is not None:
                existing = self._by_key(principal, idempotency_key, digest)
                if existing is not None:
                    return existing, False
            raise
        self.submitted()
        return view, True

    def _insert_at_once(
        self, job: Job, principal: Principal, key: str | None, message: tuple[str, str]
    ) -> str | None:
        """PostgreSQL: the job and its event inserted by one statement, in autocommit —
        one round trip instead of five (BEGIN, the tenant and key, two inserts, COMMIT).
        It inserts only when the tenant has no quota and the Idempotency-Key is unused,
        and returns the tenant's name then; None when it inserted nothing, for the
        transaction that handles those cases. Unauthorized if the tenant is gone."""
        params = {f"j_{k}": v for k, v in _columns(job).items()}
        params.update(
            tenant_id=principal.tenant_id,
            key=key,
            e_at=job.created_at,
            e_kind=EventKind.JOB_SUBMITTED.value,
            e_before=message[0],
            e_after=message[1],
            e_gpus=job.gpus,
            e_priority=job.priority,
        )
        with self.registry.statements() as connection:
            row = connection.execute(_INSERT_AT_ONCE, params).first()
        if row is None:
            raise Unauthorized(f"tenant {principal.tenant!r} no longer exists")
        return str(row[0]) if row[1] else None

    def _tenant_for_submit(
        self, session: Session, principal: Principal, key: str | None
    ) -> _TenantRow:
        """The tenant's name and quota and the job that already has this Idempotency-Key,
        in one statement; again under the row's lock if the tenant has a quota."""
        params = {"tenant_id": principal.tenant_id, "key": key}
        row = session.execute(_TENANT if key is None else _TENANT_AND_KEY, params).first()
        if row is None:
            raise Unauthorized(f"tenant {principal.tenant!r} no longer exists")
        name, quota = row[0], row[1]
        existing = row[2] if key is not None else None
        if quota is not None and existing is None:
            quota = session.scalar(_TENANT_QUOTA_LOCKED, params)
            if key is not None:  # a racing request with this key may have committed first
                existing = session.scalar(_JOB_BY_KEY, params)
        return _TenantRow(name, quota, existing)

    def _by_key(self, principal: Principal, key: str, digest: str) -> JobView | None:
        with self.registry.read() as session:
            job = session.scalar(
                select(Job).where(Job.tenant_id == principal.tenant_id, Job.idempotency_key == key)
            )
            if job is None:
                return None
            if job.request_hash != digest:
                raise Conflict(
                    f"Idempotency-Key: {key[:64]!r} was used for job {job.id} with another body"
                )
            return self._view(session, job)

    def _quoted(
        self, principal: Principal, spec: JobSpec, choice: QuoteChoice
    ) -> tuple[JobSpec, Plan]:
        with self.registry.read() as session:
            quote = session.get(Quote, choice.quote_id) if _could_be_id(choice.quote_id) else None
            if quote is None or not (principal.admin or quote.tenant_id == principal.tenant_id):
                raise InvalidRequest(f"quote_id: {choice.quote_id[:64]!r}: no such quote")
            if quote.expires_at <= utcnow():
                raise InvalidRequest(
                    f"quote_id: quote {quote.id} expired at {quote.expires_at:%Y-%m-%d %H:%M:%S}Z"
                )
            if not 0 <= choice.candidate < len(quote.candidates):
                raise InvalidRequest(
                    f"candidate: quote {quote.id} has candidates 0–{len(quote.candidates) - 1}"
                )
            quoted = JobSpec.model_validate(quote.spec)
        if _shape(quoted) != _shape(spec):
            raise InvalidRequest(
                f"quote_id: quote {quote.id} was made for another job "
                "(only name and priority may differ)"
            )
        plan = Plan.model_validate(quote.candidates[choice.candidate]["plan"])
        fixed = spec.model_copy(update={"parallel": plan.parallel, "gpus": None})
        return JobSpec.model_validate(fixed.model_dump()), plan

    # ------------------------------------------------------------------ cancelling

    def cancel(self, principal: Principal, job_id: str, reason: str = "") -> JobView:
        """End a job: CANCELLED at once; the loop stops its workers and frees its GPUs."""
        with self.registry.write() as session:
            job = self._visible(session, principal, job_id)
            session.refresh(job, with_for_update=True)
            if job.state.terminal:
                raise Conflict(f"job {job.id} already ended: {job.state.value}")
            why = reason or f"cancelled by {principal.tenant}"
            states.transition(session, job, JobState.CANCELLED, why)
            view = self._view(session, job)
        self.wake()
        return view


# The submission's statements, built once: building a statement and its cache key on
# every request showed in the profile beside running it.
_KEY_TAKEN = select(Job.id).where(
    Job.tenant_id == bindparam("tenant_id"), Job.idempotency_key == bindparam("key")
)
_TENANT = select(Tenant.name, Tenant.gpu_quota).where(Tenant.id == bindparam("tenant_id"))
_TENANT_AND_KEY = _TENANT.add_columns(_KEY_TAKEN.scalar_subquery())
_TENANT_QUOTA_LOCKED = (
    select(Tenant.gpu_quota).where(Tenant.id == bindparam("tenant_id")).with_for_update()
)
_JOB_BY_KEY = _KEY_TAKEN
_INSERT_JOB = insert(Job)
_INSERT_EVENT = insert(Event)


def _insert_at_once_statement() -> Select[Any]:
    """WITH t (the tenant's name and quota, the job that has the key), j (the job, if no
    quota and no such job), e (its event) SELECT t.name, whether j inserted. Each value
    is cast to its column's type: PostgreSQL cannot infer a parameter's type in a SELECT
    list."""
    jobs, events, tenants = Job.__table__, Event.__table__, Tenant.__table__

    def param(name: str, column: ColumnElement[Any]) -> ColumnElement[Any]:
        return cast(bindparam(name, type_=column.type), column.type)

    t = (
        select(tenants.c.name, tenants.c.gpu_quota, _KEY_TAKEN.scalar_subquery().label("job"))
        .where(tenants.c.id == bindparam("tenant_id"))
        .cte("t")
    )
    values = (
        select(*(param(f"j_{c.key}", c) for c in jobs.columns))
        .select_from(t)
        .where(t.c.gpu_quota.is_(None), t.c.job.is_(None))
    )
    j = insert(Job).from_select([c.key for c in jobs.columns], values).returning(jobs.c.id)
    made = j.cte("j")
    data = func.json_build_object(
        cast(literal("tenant"), Text),
        t.c.name,
        cast(literal("gpus"), Text),
        cast(bindparam("e_gpus"), Integer),
        cast(literal("priority"), Text),
        cast(bindparam("e_priority"), Integer),
    )
    event = select(
        param("e_at", events.c.at),
        param("e_kind", events.c.kind),
        made.c.id,
        cast(bindparam("e_before"), Text) + t.c.name + cast(bindparam("e_after"), Text),
        cast(data, events.c.data.type),
    ).select_from(made.join(t, true()))
    columns = ["at", "kind", "job_id", "message", "data"]
    e = insert(Event).from_select(columns, event).cte("e")
    return select(t.c.name, exists(select(made.c.id))).add_cte(e)


_INSERT_AT_ONCE = _insert_at_once_statement()


@dataclass(frozen=True)
class _TenantRow:
    name: str
    gpu_quota: int | None
    existing: str | None  # the job already made with this Idempotency-Key


def _could_be_id(value: str) -> bool:
    return len(value) <= 64 and "\x00" not in value


def _columns(job: Job) -> dict[str, object]:
    return {c.key: getattr(job, c.key) for c in Job.__table__.columns}


def _shape(spec: JobSpec) -> str:
    return json.dumps(spec.model_dump(mode="json", exclude={"name", "priority"}), sort_keys=True)


__all__: Sequence[str] = ["JobService", "JobView", "QuoteChoice", "gpus_of"]
