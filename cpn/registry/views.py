"""Read views of the registry for people and the service layer: site summaries, and pages
of a site's agents and nodes.

Each view runs a fixed number of queries whatever the registry holds (counts are
aggregated by the database; a page's GPUs and NICs come in one query each), and every
list that grows with the registry is a page: at most `limit` items after a key, in key
order (keyset pagination: a page costs the same wherever it starts, and rows added
meanwhile never shift the next page). `bench/registry_reads.py` measures them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Generic, TypeVar

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session, aliased

from cpn.registry.models import (
    Agent,
    Allocation,
    Gpu,
    GpuStatus,
    Lease,
    Node,
    RdmaNic,
    Site,
    WanLink,
)
from cpn.registry.topology import agent_alive

T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    #: The key to pass as `after` for the next page; None on the last page.
    next_after: str | None


@dataclass(frozen=True)
class LinkView:
    peer: str
    bandwidth_gbps: float
    rtt_ms: float
    measured_at: datetime
    reported_by: str


@dataclass
class SiteView:
    name: str
    gpu_price_per_hour: float
    intra_site_gbps: float | None
    agents_total: int = 0
    agents_alive: int = 0
    nodes_total: int = 0
    gpus_total: int = 0
    gpus_free: int = 0
    gpus_allocated: int = 0
    gpus_lost: int = 0
    links: list[LinkView] = field(default_factory=list)


@dataclass(frozen=True)
class AgentView:
    agent_id: str
    version: str
    alive: bool
    status: str
    health: str
    registrations: int
    registered_at: datetime
    last_heartbeat_at: datetime | None
    lease_expires_at: datetime | None
    lost_at: datetime | None
    probe_address: str


@dataclass(frozen=True)
class GpuView:
    index: int
    model: str
    memory_gb: float
    tflops: float
    uuid: str
    source: str
    status: str
    allocated_to: str | None
    utilisation: float | None
    memory_used_gb: float | None


@dataclass(frozen=True)
class NicView:
    device: str
    port: int
    transport: str
    roce_version: int
    rate_gbps: float
    state: str


@dataclass
class NodeView:
    name: str
    agent_id: str
    alive: bool
    intra_node_gbps: float | None
    gpus: list[GpuView] = field(default_factory=list)
    rdma_nics: list[NicView] = field(default_factory=list)


def site_id(session: Session, name: str) -> int | None:
    return session.scalar(select(Site.id).where(Site.name == name))


def sites(session: Session, now: datetime, *, limit: int, after: str | None) -> Page[SiteView]:
    """Sites in name order with their counts and measured links (five queries)."""
    query = select(Site.id, Site.name, Site.gpu_price_per_hour, Site.intra_site_gbps)
    if after is not None:
        query = query.where(Site.name > after)
    rows = session.execute(query.order_by(Site.name).limit(limit + 1)).all()
    views = {r[0]: SiteView(r[1], r[2], r[3]) for r in rows[:limit]}
    if not views:
        return Page([], None)
    ids = list(views)
    alive = agent_alive(now)
    for sid, total, live in session.execute(
        select(Agent.site_id, func.count(), func.sum(case((alive, 1), else_=0)))
        .outerjoin(Lease, Lease.agent_pk == Agent.id)
        .where(Agent.site_id.in_(ids))
        .group_by(Agent.site_id)
    ):
        views[sid].agents_total, views[sid].agents_alive = total, int(live or 0)
    for sid, total in session.execute(
        select(Node.site_id, func.count()).where(Node.site_id.in_(ids)).group_by(Node.site_id)
    ):
        views[sid].nodes_total = total
    allocated = Allocation.id.is_not(None)
    free = (~allocated) & (Gpu.status == GpuStatus.AVAILABLE) & alive
    for sid, total, held, usable in session.execute(
        select(
            Node.site_id,
            func.count(Gpu.id),
            func.sum(case((allocated, 1), else_=0)),
            func.sum(case((free, 1), else_=0)),
        )
        .join(Node, Gpu.node_id == Node.id)
        .join(Agent, Node.agent_pk == Agent.id)
        .outerjoin(Lease, Lease.agent_pk == Agent.id)
        .outerjoin(Allocation, Allocation.gpu_id == Gpu.id)
        .where(Node.site_id.in_(ids))
        .group_by(Node.site_id)
    ):
        view = views[sid]
        view.gpus_total, view.gpus_allocated, view.gpus_free = total, int(held), int(usable)
        view.gpus_lost = total - view.gpus_allocated - view.gpus_free
    peer = aliased(Site)
    for sid, name, bandwidth, rtt, at, by in session.execute(
        select(
            WanLink.site_id,
            peer.name,
            WanLink.bandwidth_gbps,
            WanLink.rtt_ms,
            WanLink.measured_at,
            WanLink.reported_by,
        )
        .join(peer, WanLink.peer_site_id == peer.id)
        .where(WanLink.site_id.in_(ids))
        .order_by(WanLink.site_id, peer.name)
    ):
        views[sid].links.append(LinkView(name, bandwidth, rtt, at, by))
    items = list(views.values())
    return Page(items, items[-1].name if len(rows) > limit else None)


def agents(
    session: Session, site: int, now: datetime, *, limit: int, after: str | None
) -> Page[AgentView]:
    """A site's agents in agent-id order (one query)."""
    alive = agent_alive(now)
    query = (
        select(
            Agent.agent_id,
            Agent.version,
            alive,
            Agent.health,
            Agent.registrations,
            Agent.registered_at,
            Agent.last_heartbeat_at,
            Lease.expires_at,
            Agent.lost_at,
            Agent.probe_address,
        )
        .outerjoin(Lease, Lease.agent_pk == Agent.id)
        .where(Agent.site_id == site)
    )
    if after is not None:
        query = query.where(Agent.agent_id > after)
    # One row more than asked for: it only says whether another page exists.
    rows = session.execute(query.order_by(Agent.agent_id).limit(limit + 1)).all()
    items = [
        AgentView(
            agent_id=r[0],
            version=r[1],
            alive=bool(r[2]),
            status="alive" if r[2] else "lost",
            health=r[3],
            registrations=r[4],
            registered_at=r[5],
            last_heartbeat_at=r[6],
            lease_expires_at=r[7],
            lost_at=r[8],
            probe_address=r[9],
        )
        for r in rows[:limit]
    ]
    return Page(items, items[-1].agent_id if len(rows) > limit else None)


def nodes(
    session: Session, site: int, now: datetime, *, limit: int, after: str | None
) -> Page[NodeView]:
    """A site's nodes in name order, each with its GPUs and RDMA ports (three queries)."""
    query = (
        select(Node.id, Node.name, Agent.agent_id, agent_alive(now), Node.intra_node_gbps)
        .join(Agent, Node.agent_pk == Agent.id)
        .outerjoin(Lease, Lease.agent_pk == Agent.id)
        .where(Node.site_id == site)
    )
    if after is not None:
        query = query.where(Node.name > after)
    rows = session.execute(query.order_by(Node.name).limit(limit + 1)).all()
    views = {r[0]: NodeView(r[1], r[2], bool(r[3]), r[4]) for r in rows[:limit]}
    if views:
        ids = list(views)
        for node_id, *gpu in session.execute(
            select(
                Gpu.node_id,
                Gpu.index,
                Gpu.model,
                Gpu.memory_gb,
                Gpu.tflops,
                Gpu.uuid,
                Gpu.source,
                Gpu.status,
                Allocation.job_id,
                Gpu.utilisation,
                Gpu.memory_used_gb,
            )
            .outerjoin(Allocation, Allocation.gpu_id == Gpu.id)
            .where(Gpu.node_id.in_(ids))
            .order_by(Gpu.node_id, Gpu.index)
        ):
            index, model, memory, tflops, uuid, source, status, job, util, used = gpu
            views[node_id].gpus.append(
                GpuView(index, model, memory, tflops, uuid, source, str(status.value), job,
                        util, used)
            )  # fmt: skip
        for node_id, device, port, transport, roce, rate, state in session.execute(
            select(
                RdmaNic.node_id,
                RdmaNic.device,
                RdmaNic.port,
                RdmaNic.transport,
                RdmaNic.roce_version,
                RdmaNic.rate_gbps,
                RdmaNic.state,
            )
            .where(RdmaNic.node_id.in_(ids))
            .order_by(RdmaNic.node_id, RdmaNic.device, RdmaNic.port)
        ):
            views[node_id].rdma_nics.append(NicView(device, port, transport, roce, rate, state))
    items = list(views.values())
    return Page(items, items[-1].name if len(rows) > limit else None)


__all__ = [
    "AgentView",
    "GpuView",
    "LinkView",
    "NicView",
    "NodeView",
    "Page",
    "SiteView",
    "agents",
    "nodes",
    "site_id",
    "sites",
]
