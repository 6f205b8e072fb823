"""Leases in the database: batched renewals, marking agents lost, reloading after a restart.

The control server keeps hot lease state in memory and writes renewals here in batches
(`apply_heartbeats`), so the database's `expires_at` may lag the truth by one flush: it is
then *earlier* than the real expiry, never later, so a reader that checks expiry against
the clock (see `Agent.alive_at`) can never see a lease alive after it really expired.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, Table, bindparam, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from cpn.registry.events import EventKind, record_event
from cpn.registry.models import Agent, AgentStatus, Gpu, GpuStatus, Lease, Node, Site, WanLink


@dataclass(frozen=True)
class GpuUsage:
    gpu_id: int
    utilisation: float
    memory_used_gb: float


@dataclass(frozen=True)
class LinkSample:
    peer_site: str
    bandwidth_gbps: float
    rtt_ms: float
    measured_at: datetime


@dataclass(frozen=True)
class HeartbeatRecord:
    """The latest heartbeat of one agent since the previous flush."""

    agent_pk: int
    lease_pk: int
    site_id: int
    agent_id: str
    at: datetime
    expires_at: datetime
    health: str
    gpus: tuple[GpuUsage, ...] = ()
    links: tuple[LinkSample, ...] = ()


# Core executemany statements (prepared once): the ORM's bulk update does per-row Python
# work that, at thousands of heartbeats a second, costs more than the database does.
_LEASES = cast(Table, Lease.__table__)
_AGENTS = cast(Table, Agent.__table__)
_GPUS = cast(Table, Gpu.__table__)
_RENEW_LEASE = (
    update(_LEASES)
    .where(_LEASES.c.id == bindparam("b_id"))
    .values(renewed_at=bindparam("b_at"), expires_at=bindparam("b_expires"))
)
_TOUCH_AGENT = (
    update(_AGENTS)
    .where(_AGENTS.c.id == bindparam("b_id"))
    .values(last_heartbeat_at=bindparam("b_at"), health=bindparam("b_health"))
)
_GPU_USAGE = (
    update(_GPUS)
    .where(_GPUS.c.id == bindparam("b_id"))
    .values(utilisation=bindparam("b_util"), memory_used_gb=bindparam("b_mem"))
)


def apply_heartbeats(session: Session, records: Sequence[HeartbeatRecord]) -> None:
    """Write a batch of heartbeats: a few executemany statements, whatever the batch size.

    `records[i].gpus` should hold only usage that changed since the last write (the control
    server filters); leases and agents are always written.
    """
    if not records:
        return
    session.execute(
        _RENEW_LEASE,
        [{"b_id": r.lease_pk, "b_at": r.at, "b_expires": r.expires_at} for r in records],
    )
    session.execute(
        _TOUCH_AGENT,
        [{"b_id": r.agent_pk, "b_at": r.at, "b_health": r.health} for r in records],
    )
    usage = [
        {"b_id": g.gpu_id, "b_util": g.utilisation, "b_mem": g.memory_used_gb}
        for r in records
        for g in r.gpus
    ]
    if usage:
        session.execute(_GPU_USAGE, usage)
    links = [(r, link) for r in records for link in r.links]
    if links:
        site_ids = {name: id_ for name, id_ in session.execute(select(Site.name, Site.id))}
        rows = [
            {
                "site_id": r.site_id,
                "peer_site_id": site_ids[link.peer_site],
                "bandwidth_gbps": link.bandwidth_gbps,
                "rtt_ms": link.rtt_ms,
                "measured_at": link.measured_at,
                "reported_by": r.agent_id,
            }
            for r, link in links
            if link.peer_site in site_ids and site_ids[link.peer_site] != r.site_id
        ]
        if rows:
            _upsert_links(session, rows)


def _upsert_links(session: Session, rows: list[dict[str, object]]) -> None:
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    stmt = insert(WanLink)
    stmt = stmt.on_conflict_do_update(
        index_elements=[WanLink.site_id, WanLink.peer_site_id],
        set_={
            "bandwidth_gbps": stmt.excluded.bandwidth_gbps,
            "rtt_ms": stmt.excluded.rtt_ms,
            "measured_at": stmt.excluded.measured_at,
            "reported_by": stmt.excluded.reported_by,
        },
    )
    session.execute(stmt, rows)


def is_current_lease(session: Session, agent_pk: int, lease_id: str) -> bool:
    """Whether `lease_id` is the agent's lease now (not one a registration replaced)."""
    agent = session.get(Agent, agent_pk)
    return agent is not None and agent.lease is not None and agent.lease.lease_id == lease_id


def mark_lost(session: Session, agent_pk: int, lease_id: str, now: datetime, reason: str) -> int:
    """Declare an agent lost: its lease revoked, its GPUs lost, an event. Returns GPUs lost.

    Only if `lease_id` is still the agent's lease: an agent that registered again (new
    lease) while the reaper was deciding about its old one stays alive.
    """
    agent = session.get(Agent, agent_pk)
    if agent is None or agent.status == AgentStatus.LOST:
        return 0
    if not is_current_lease(session, agent_pk, lease_id):
        return 0
    agent.status = AgentStatus.LOST
    agent.lost_at = now
    if agent.lease is not None:
        agent.lease.revoked_at = now
    node_ids = select(Node.id).where(Node.agent_pk == agent_pk)
    result = session.execute(
        update(Gpu)
        .where(Gpu.node_id.in_(node_ids), Gpu.status != GpuStatus.LOST)
        .values(status=GpuStatus.LOST)
    )
    lost = cast("CursorResult[Any]", result).rowcount
    record_event(
        session,
        EventKind.AGENT_LOST,
        f"agent {agent.agent_id} lost ({reason}); {lost} GPUs marked lost",
        site=agent.site.name,
        agent_id=agent.agent_id,
        data={"gpus_lost": lost, "reason": reason},
        at=now,
    )
    return int(lost)


@dataclass(frozen=True)
class StoredLease:
    agent_pk: int
    site: str
    agent_id: str
    lease_id: str
    expires_at: datetime


def live_leases(session: Session) -> list[StoredLease]:
    """Leases of agents the database still calls alive (expired or not): after a restart
    the control server reaps the ones whose agents do not come back."""
    rows = session.execute(
        select(Agent.id, Site.name, Agent.agent_id, Lease.lease_id, Lease.expires_at)
        .join(Site, Agent.site_id == Site.id)
        .join(Lease, Lease.agent_pk == Agent.id)
        .where(Agent.status == AgentStatus.ALIVE, Lease.revoked_at.is_(None))
    )
    return [StoredLease(*row) for row in rows]
