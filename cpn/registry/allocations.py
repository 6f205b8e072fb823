"""Handing GPUs and WAN bandwidth to jobs, transactionally.

Two schedulers (threads, processes, hosts) may race for the same GPU. The guarantee does
not rest on them being careful: `allocations.gpu_id` is UNIQUE, so the database accepts
exactly one of two inserts for a GPU and the other transaction fails with
`AllocationConflict`, leaving nothing half-written. On PostgreSQL the free-GPU search also
locks the rows it picks (`FOR UPDATE SKIP LOCKED`) so that racing allocators mostly pick
different GPUs instead of colliding; on SQLite write transactions are serialised by
`BEGIN IMMEDIATE` (see db.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from cpn.contracts import link_key
from cpn.errors import CpnError
from cpn.registry.events import EventKind, record_event
from cpn.registry.models import (
    Agent,
    AgentStatus,
    Allocation,
    Gpu,
    GpuStatus,
    Job,
    Lease,
    LinkReservation,
    Node,
    Site,
    utcnow,
)


class AllocationConflict(CpnError):
    """A GPU asked for is held by another job, lost, or unknown. Nothing was allocated."""


class NoCapacity(CpnError):
    """Fewer free GPUs than asked for. Nothing was allocated."""


def create_job(session: Session, job_id: str, name: str, spec: dict[str, Any] | None = None) -> Job:
    job = Job(id=job_id, name=name, spec=spec or {})
    session.add(job)
    session.flush()
    return job


def _usable(now: datetime) -> Any:
    """GPUs a job may be given: available, on a live agent whose lease has not expired."""
    return (
        (Gpu.status == GpuStatus.AVAILABLE)
        & (Agent.status == AgentStatus.ALIVE)
        & Lease.revoked_at.is_(None)
        & (Lease.expires_at > now)
    )


def _gpu_query() -> Any:
    return (
        select(Gpu, Site.name, Node.name)
        .join(Node, Gpu.node_id == Node.id)
        .join(Site, Node.site_id == Site.id)
        .join(Agent, Node.agent_pk == Agent.id)
        .join(Lease, Lease.agent_pk == Agent.id)
    )


def _insert(session: Session, job_id: str, gpus: Sequence[tuple[Gpu, str, str]]) -> None:
    now = utcnow()
    for gpu, _site, _node in gpus:
        session.add(Allocation(job_id=job_id, gpu_id=gpu.id, allocated_at=now))
    try:
        session.flush()
    except IntegrityError:
        raise AllocationConflict(
            f"job {job_id}: another allocation took one of these GPUs first; nothing allocated"
        ) from None
    record_event(
        session,
        EventKind.ALLOCATED,
        f"job {job_id}: {len(gpus)} GPUs allocated",
        job_id=job_id,
        data={"gpus": [f"{site}/{node}/{gpu.index}" for gpu, site, node in gpus]},
        at=now,
    )


def allocate_gpus(
    session: Session, job_id: str, wanted: Mapping[str, Mapping[str, Sequence[int]]]
) -> int:
    """Allocate exactly these GPUs (site → node → indices) to a job, or none of them."""
    now = utcnow()
    picked: list[tuple[Gpu, str, str]] = []
    for site, nodes in wanted.items():
        for node, indices in nodes.items():
            rows = session.execute(
                _gpu_query()
                .where(Site.name == site, Node.name == node, Gpu.index.in_(list(indices)))
                .with_for_update(of=Gpu)
            )
            found = {gpu.index: (gpu, s, n) for gpu, s, n in rows}
            for index in indices:
                if index not in found:
                    raise AllocationConflict(f"job {job_id}: no GPU {site}/{node}/{index}")
                gpu = found[index][0]
                if gpu.allocation is not None:
                    raise AllocationConflict(
                        f"job {job_id}: GPU {site}/{node}/{index} is held by job "
                        f"{gpu.allocation.job_id}"
                    )
                if gpu.status != GpuStatus.AVAILABLE or not gpu.node.agent.alive_at(now):
                    raise AllocationConflict(f"job {job_id}: GPU {site}/{node}/{index} is lost")
                picked.append(found[index])
    _insert(session, job_id, picked)
    return len(picked)


def allocate_free(
    session: Session, job_id: str, count: int, *, site: str | None = None
) -> list[tuple[str, str, int]]:
    """Allocate any `count` free GPUs (optionally at one site); all or none."""
    now = utcnow()
    query = (
        _gpu_query()
        .outerjoin(Allocation, Allocation.gpu_id == Gpu.id)
        .where(_usable(now), Allocation.id.is_(None))
        .order_by(Site.name, Node.name, Gpu.index)
        .limit(count)
    )
    if site is not None:
        query = query.where(Site.name == site)
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update(of=Gpu, skip_locked=True)
    picked = list(session.execute(query))
    if len(picked) < count:
        raise NoCapacity(f"job {job_id}: asked for {count} GPUs, {len(picked)} free")
    _insert(session, job_id, picked)
    return [(s, n, gpu.index) for gpu, s, n in picked]


def reserve_link(session: Session, job_id: str, a: str, b: str, gbps: float) -> None:
    session.add(LinkReservation(job_id=job_id, link_key=link_key(a, b), gbps=gbps))
    session.flush()


def release(session: Session, job_id: str) -> int:
    """Give back everything a job holds. Returns the number of GPUs released."""
    result = session.execute(delete(Allocation).where(Allocation.job_id == job_id))
    released = cast("CursorResult[Any]", result).rowcount
    session.execute(delete(LinkReservation).where(LinkReservation.job_id == job_id))
    record_event(
        session, EventKind.RELEASED, f"job {job_id}: {released} GPUs released", job_id=job_id
    )
    return int(released)
