"""The scheduler's view of the registry: a `Topology` of what live agents report and the
`Reservations` of what jobs already hold, so that `cpn.scheduler.plan_job(topology, job,
reservations)` places jobs on real, reported capacity.

Where the numbers come from (docs/control-plane.md repeats this for operators):

- sites: those with at least one live agent (lease not expired) reporting a node with GPUs;
- nodes: one `NodeSpec` (count 1) per reported node; its GPU model, memory and speed are
  those of GPU 0 with the smallest memory and speed of any GPU in the node (a node's GPUs
  are normally identical; if not, the scheduler must not over-promise); a node without
  an intra-node figure gets `DEFAULT_INTRA_NODE_GBPS` (PCIe 4.0 x16);
- `gpu_price_per_hour`: the operator's site settings (site tokens file), else 0;
- `intra_site_gbps`: the operator's setting, else the smallest per-node sum of active
  RDMA port rates in the site, else `DEFAULT_INTRA_SITE_GBPS`;
- links: measured by the agents, one per pair of sites in the topology; when both
  directions were measured the link gets the smaller bandwidth and the larger RTT (a
  conservative figure); `latency_ms` is half the RTT; transport `tcp`, price 0;
- reservations: every allocated GPU, plus every GPU lost while the rest of its node is
  live, and the WAN bandwidth jobs reserved on links of this topology.

Built in a fixed number of queries whatever the registry's size (the GPU figures are
aggregated by the database, per node): at 10,000 agents loading every row as an ORM object
took seconds. `bench/registry_reads.py` measures it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select
from sqlalchemy.orm import Session, aliased

from cpn.contracts import (
    GpuSpec,
    LinkSpec,
    NodeSpec,
    Reservations,
    SiteSpec,
    Topology,
    WanTransport,
    link_key,
)
from cpn.errors import InfeasibleError
from cpn.registry.models import (
    Agent,
    AgentStatus,
    Allocation,
    Gpu,
    GpuStatus,
    Lease,
    LinkReservation,
    Node,
    RdmaNic,
    Site,
    WanLink,
    utcnow,
)

DEFAULT_INTRA_NODE_GBPS = 256.0
DEFAULT_INTRA_SITE_GBPS = 100.0


class EmptyRegistry(InfeasibleError):
    """No live site reports any GPU."""


def agent_alive(now: datetime) -> ColumnElement[bool]:
    """`Agent.alive_at(now)` as SQL, for queries joined to Agent and its Lease."""
    return and_(
        Agent.status == AgentStatus.ALIVE,
        Lease.revoked_at.is_(None),
        Lease.expires_at > now,
    )


@dataclass(frozen=True)
class _LiveNode:
    site_id: int
    site: str
    price: float
    intra_site_gbps: float | None
    node_id: int
    node: str
    intra_node_gbps: float | None
    spec: GpuSpec


def _live_nodes(session: Session, now: datetime) -> list[_LiveNode]:
    """Every node with GPUs on a live agent, with its GPUs summarised (one query)."""
    stats = (
        select(
            Gpu.node_id.label("node_id"),
            func.count().label("count"),
            func.min(Gpu.memory_gb).label("memory_gb"),
            func.min(Gpu.tflops).label("tflops"),
            func.min(Gpu.index).label("first"),
        )
        .group_by(Gpu.node_id)
        .subquery()
    )
    first = aliased(Gpu)
    rows = session.execute(
        select(
            Site.id,
            Site.name,
            Site.gpu_price_per_hour,
            Site.intra_site_gbps,
            Node.id,
            Node.name,
            Node.intra_node_gbps,
            first.model,
            stats.c.count,
            stats.c.memory_gb,
            stats.c.tflops,
        )
        .join(Node, Node.site_id == Site.id)
        .join(Agent, Node.agent_pk == Agent.id)
        .join(Lease, Lease.agent_pk == Agent.id)
        .join(stats, stats.c.node_id == Node.id)
        .join(first, and_(first.node_id == Node.id, first.index == stats.c.first))
        .where(agent_alive(now))
        .order_by(Site.name, Node.name)
    )
    return [
        _LiveNode(
            site_id,
            site,
            price,
            intra_site,
            node_id,
            node,
            intra_node,
            GpuSpec(model=model, count=count, memory_gb=memory, tflops=tflops),
        )
        for (
            site_id,
            site,
            price,
            intra_site,
            node_id,
            node,
            intra_node,
            model,
            count,
            memory,
            tflops,
        ) in rows
    ]


def _taken(session: Session, now: datetime) -> dict[str, dict[str, list[int]]]:
    """GPUs of live nodes that a job holds or that are lost (one query)."""
    rows = session.execute(
        select(Site.name, Node.name, Gpu.index)
        .join(Node, Gpu.node_id == Node.id)
        .join(Site, Node.site_id == Site.id)
        .join(Agent, Node.agent_pk == Agent.id)
        .join(Lease, Lease.agent_pk == Agent.id)
        .outerjoin(Allocation, Allocation.gpu_id == Gpu.id)
        .where(agent_alive(now), or_(Allocation.id.is_not(None), Gpu.status != GpuStatus.AVAILABLE))
        .order_by(Site.name, Node.name, Gpu.index)
    )
    held: dict[str, dict[str, list[int]]] = defaultdict(dict)
    for site, node, index in rows:
        held[site].setdefault(node, []).append(index)
    return dict(held)


def _active_rdma_gbps(session: Session) -> dict[int, float]:
    """Per node, the summed rate of its active RDMA ports (one query)."""
    rows = session.execute(
        select(RdmaNic.node_id, func.sum(RdmaNic.rate_gbps))
        .where(RdmaNic.state == "active")
        .group_by(RdmaNic.node_id)
    )
    return {node_id: float(total) for node_id, total in rows}


def build_topology(
    session: Session, *, now: datetime | None = None, max_link_age: timedelta | None = None
) -> tuple[Topology, Reservations]:
    now = now or utcnow()
    live = _live_nodes(session, now)
    if not live:
        raise EmptyRegistry("no live site reports any GPU")
    rdma = _active_rdma_gbps(session)
    by_site: dict[int, list[_LiveNode]] = defaultdict(list)
    for n in live:
        by_site[n.site_id].append(n)
    specs = []
    for nodes in by_site.values():  # in site-name order: `live` is sorted
        head = nodes[0]
        specs.append(
            SiteSpec(
                name=head.site,
                gpu_price_per_hour=head.price,
                intra_site_gbps=head.intra_site_gbps
                or _intra_site_from_nics([rdma.get(n.node_id, 0.0) for n in nodes]),
                nodes=[
                    NodeSpec(
                        name=n.node,
                        count=1,
                        gpu=n.spec,
                        intra_node_gbps=n.intra_node_gbps or DEFAULT_INTRA_NODE_GBPS,
                    )
                    for n in nodes
                ],
            )
        )
    names = {site_id: nodes[0].site for site_id, nodes in by_site.items()}
    links = _links(session, names, now, max_link_age)
    keys = {link.key for link in links}
    wan: dict[str, float] = defaultdict(float)
    for key, gbps in session.execute(select(LinkReservation.link_key, LinkReservation.gbps)):
        if key in keys:
            wan[key] += gbps
    return Topology(sites=specs, links=links), Reservations(
        gpus=_taken(session, now), wan_gbps=dict(wan)
    )


def _intra_site_from_nics(per_node: list[float]) -> float:
    """The slowest node's active RDMA, if every live node has some; else the default."""
    usable = [r for r in per_node if r > 0]
    return min(usable) if usable and len(usable) == len(per_node) else DEFAULT_INTRA_SITE_GBPS


def _links(
    session: Session, names: dict[int, str], now: datetime, max_age: timedelta | None
) -> list[LinkSpec]:
    measured: dict[str, list[tuple[float, float]]] = defaultdict(list)
    ends: dict[str, tuple[str, str]] = {}
    query: Any = select(
        WanLink.site_id, WanLink.peer_site_id, WanLink.bandwidth_gbps, WanLink.rtt_ms
    )
    if max_age is not None:
        query = query.where(WanLink.measured_at >= now - max_age)
    # Filtered here rather than with IN (...): thousands of sites would be thousands of
    # bound parameters, beyond SQLite's limit.
    for site_id, peer_id, bandwidth, rtt in session.execute(query):
        if site_id not in names or peer_id not in names:
            continue
        a, b = names[site_id], names[peer_id]
        key = link_key(a, b)
        measured[key].append((bandwidth, rtt))
        ends[key] = (min(a, b), max(a, b))
    links = []
    for key in sorted(measured):
        samples = measured[key]
        bandwidth = min(b for b, _ in samples)
        rtt = max(r for _, r in samples)
        if bandwidth <= 0:
            continue
        a, b = ends[key]
        links.append(
            LinkSpec(
                a=a,
                b=b,
                bandwidth_gbps=bandwidth,
                latency_ms=rtt / 2,
                transport=WanTransport.TCP,
            )
        )
    return links
