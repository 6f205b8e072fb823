"""Registering an agent: its site, its nodes with their GPUs and RDMA NICs, and its lease.

The control server validates the request first (every field named on error); this module
turns a valid registration into rows, in one transaction. Registering again with the same
(site, agent id) — after the agent or the control plane restarted — updates the same rows,
so the agent keeps its identity and GPUs that jobs hold stay allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from cpn.errors import CpnError
from cpn.registry.events import EventKind, record_event
from cpn.registry.gpu_specs import peak_tflops
from cpn.registry.models import Agent, AgentStatus, Gpu, GpuStatus, Lease, Node, RdmaNic, Site


@dataclass(frozen=True)
class GpuInfo:
    index: int
    model: str
    memory_gb: float
    tflops: float = 0.0  # 0: unknown, filled from the model name
    uuid: str = ""
    source: str = "virtual"  # nvml | nvidia-smi | torch-cuda | virtual


@dataclass(frozen=True)
class NicInfo:
    device: str
    port: int
    transport: str  # infiniband | roce | iwarp
    rate_gbps: float
    state: str  # down | init | armed | active | active_defer
    roce_version: int = 0


@dataclass(frozen=True)
class NodeInfo:
    name: str
    gpus: tuple[GpuInfo, ...] = ()
    nics: tuple[NicInfo, ...] = ()
    intra_node_gbps: float | None = None


@dataclass(frozen=True)
class AgentRegistration:
    site: str
    agent_id: str
    version: str
    probe_address: str
    nodes: tuple[NodeInfo, ...]
    #: (job, epoch) of every launch the agent process follows; None: not listed (an
    #: agent that registers again without restarting).
    launches: frozenset[tuple[str, int]] | None = None


@dataclass(frozen=True)
class SiteSettings:
    """What discovery cannot know about a site; set by the operator (site tokens file)."""

    gpu_price_per_hour: float = 0.0
    intra_site_gbps: float | None = None


@dataclass(frozen=True)
class Registered:
    """What the control server keeps in memory about a registered agent's lease."""

    agent_pk: int
    site_id: int
    lease_pk: int
    lease_id: str
    expires_at: datetime
    registrations: int
    gpu_ids: dict[tuple[str, int], int] = field(default_factory=dict)  # (node, index) → id


class NodeOwnedError(CpnError):
    """A node is reported by a second live agent of the same site."""

    def __init__(self, index: int, node: str, owner: str) -> None:
        super().__init__(f"node {node!r} is reported by live agent {owner!r} of this site")
        self.field = f"inventory.nodes[{index}].name"


def get_or_create_site(session: Session, name: str, settings: SiteSettings | None) -> Site:
    site = session.scalar(select(Site).where(Site.name == name))
    if site is None:
        site = Site(name=name)
        session.add(site)
    if settings is not None:
        site.gpu_price_per_hour = settings.gpu_price_per_hour
        site.intra_site_gbps = settings.intra_site_gbps
    session.flush()
    return site


def register_agent(
    session: Session,
    reg: AgentRegistration,
    *,
    lease_id: str,
    ttl_ms: int,
    now: datetime,
    site_settings: SiteSettings | None = None,
) -> Registered:
    site = get_or_create_site(session, reg.site, site_settings)
    agent = session.scalar(
        select(Agent)
        .where(Agent.site_id == site.id, Agent.agent_id == reg.agent_id)
        .options(selectinload(Agent.lease))
    )
    if agent is None:
        agent = Agent(site_id=site.id, agent_id=reg.agent_id, registrations=0)
        session.add(agent)
    agent.version = reg.version
    agent.probe_address = reg.probe_address
    agent.status = AgentStatus.ALIVE
    agent.health = "ok"
    agent.lost_at = None
    agent.registered_at = now
    agent.last_heartbeat_at = now
    agent.registrations = (agent.registrations or 0) + 1
    session.flush()

    existing = {
        n.name: n
        for n in session.scalars(
            select(Node)
            # Only the nodes this registration can touch: the ones it names and the ones the
            # agent had. Loading the whole site would make N registrations cost O(N²).
            .where(
                Node.site_id == site.id,
                Node.name.in_([n.name for n in reg.nodes]) | (Node.agent_pk == agent.id),
            )
            .options(
                selectinload(Node.gpus).selectinload(Gpu.allocation),
                selectinload(Node.rdma_nics),
                selectinload(Node.agent).selectinload(Agent.lease),
            )
        )
    }
    reported = {n.name for n in reg.nodes}
    for i, info in enumerate(reg.nodes):
        node = existing.get(info.name)
        if node is not None and node.agent_pk != agent.id and node.agent.alive_at(now):
            raise NodeOwnedError(i, info.name, node.agent.agent_id)
        if node is None:
            node = Node(site_id=site.id, name=info.name)
            session.add(node)
        node.agent_pk = agent.id
        node.intra_node_gbps = info.intra_node_gbps
        _sync_gpus(node, info)
        _sync_nics(node, info)
    # Nodes this agent reported before but not now: gone, unless a job holds their GPUs.
    for name, node in existing.items():
        if node.agent_pk != agent.id or name in reported:
            continue
        if any(g.allocation is not None for g in node.gpus):
            for gpu in node.gpus:
                gpu.status = GpuStatus.LOST
        else:
            session.delete(node)
        record_event(
            session,
            EventKind.NODE_REMOVED,
            f"node {name} no longer reported by agent {reg.agent_id}",
            site=reg.site,
            agent_id=reg.agent_id,
            at=now,
        )

    expires = now + timedelta(milliseconds=ttl_ms)
    lease = agent.lease
    if lease is None:
        lease = Lease(agent_pk=agent.id, lease_id=lease_id, ttl_ms=ttl_ms, expires_at=expires)
        session.add(lease)
    lease.lease_id = lease_id
    lease.ttl_ms = ttl_ms
    lease.granted_at = now
    lease.renewed_at = now
    lease.expires_at = expires
    lease.revoked_at = None
    session.flush()

    gpu_count = sum(len(n.gpus) for n in reg.nodes)
    record_event(
        session,
        EventKind.AGENT_REGISTERED,
        f"agent {reg.agent_id} registered ({len(reg.nodes)} nodes, {gpu_count} GPUs"
        f", registration {agent.registrations})",
        site=reg.site,
        agent_id=reg.agent_id,
        data={"nodes": len(reg.nodes), "gpus": gpu_count, "registrations": agent.registrations},
        at=now,
    )
    gpu_ids = {
        (node.name, gpu.index): gpu.id
        for node in session.scalars(
            select(Node).where(Node.agent_pk == agent.id).options(selectinload(Node.gpus))
        )
        for gpu in node.gpus
    }
    return Registered(
        agent_pk=agent.id,
        site_id=site.id,
        lease_pk=lease.id,
        lease_id=lease_id,
        expires_at=expires,
        registrations=agent.registrations,
        gpu_ids=gpu_ids,
    )


def _sync_gpus(node: Node, info: NodeInfo) -> None:
    by_index = {g.index: g for g in node.gpus}
    for g in info.gpus:
        gpu = by_index.pop(g.index, None)
        if gpu is None:
            gpu = Gpu(index=g.index)
            node.gpus.append(gpu)
        gpu.model = g.model
        gpu.memory_gb = g.memory_gb
        gpu.tflops = g.tflops if g.tflops > 0 else peak_tflops(g.model)
        gpu.uuid = g.uuid
        gpu.source = g.source
        gpu.status = GpuStatus.AVAILABLE
    for gone in by_index.values():
        if gone.allocation is not None:
            gone.status = GpuStatus.LOST  # a job holds it: keep the row so the job sees why
        else:
            node.gpus.remove(gone)


def _sync_nics(node: Node, info: NodeInfo) -> None:
    # Update in place by (device, port): replacing the list would insert the new rows
    # before deleting the old ones and trip the unique constraint.
    by_port = {(n.device, n.port): n for n in node.rdma_nics}
    for n in info.nics:
        nic = by_port.pop((n.device, n.port), None)
        if nic is None:
            nic = RdmaNic(device=n.device, port=n.port)
            node.rdma_nics.append(nic)
        nic.transport = n.transport
        nic.roce_version = n.roce_version
        nic.rate_gbps = n.rate_gbps
        nic.state = n.state
    for gone in by_port.values():
        node.rdma_nics.remove(gone)
