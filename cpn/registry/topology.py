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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

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
    Gpu,
    GpuStatus,
    LinkReservation,
    Node,
    Site,
    WanLink,
    utcnow,
)

DEFAULT_INTRA_NODE_GBPS = 256.0
DEFAULT_INTRA_SITE_GBPS = 100.0


class EmptyRegistry(InfeasibleError):
    """No live site reports any GPU."""


def build_topology(
    session: Session, *, now: datetime | None = None, max_link_age: timedelta | None = None
) -> tuple[Topology, Reservations]:
    now = now or utcnow()
    sites = session.scalars(
        select(Site)
        .order_by(Site.name)
        .options(
            selectinload(Site.nodes).selectinload(Node.gpus).selectinload(Gpu.allocation),
            selectinload(Site.nodes).selectinload(Node.rdma_nics),
            selectinload(Site.nodes).selectinload(Node.agent).selectinload(Agent.lease),
            selectinload(Site.links).selectinload(WanLink.peer_site),
        )
    ).all()
    specs: list[SiteSpec] = []
    held: dict[str, dict[str, list[int]]] = defaultdict(dict)
    for site in sites:
        nodes: list[NodeSpec] = []
        for node in site.nodes:
            if not node.gpus or not node.agent.alive_at(now):
                continue
            nodes.append(_node_spec(node))
            taken = [
                g.index
                for g in node.gpus
                if g.allocation is not None or g.status != GpuStatus.AVAILABLE
            ]
            if taken:
                held[site.name][node.name] = taken
        if not nodes:
            continue
        specs.append(
            SiteSpec(
                name=site.name,
                gpu_price_per_hour=site.gpu_price_per_hour,
                intra_site_gbps=site.intra_site_gbps or _intra_site_from_nics(site, now),
                nodes=nodes,
            )
        )
    if not specs:
        raise EmptyRegistry("no live site reports any GPU")
    names = {s.name for s in specs}
    links = _links(sites, names, now, max_link_age)
    keys = {link.key for link in links}
    wan: dict[str, float] = defaultdict(float)
    for res in session.scalars(select(LinkReservation)):
        if res.link_key in keys:
            wan[res.link_key] += res.gbps
    topology = Topology(sites=specs, links=links)
    return topology, Reservations(gpus=dict(held), wan_gbps=dict(wan))


def _node_spec(node: Node) -> NodeSpec:
    first = node.gpus[0]
    return NodeSpec(
        name=node.name,
        count=1,
        gpu=GpuSpec(
            model=first.model,
            count=len(node.gpus),
            memory_gb=min(g.memory_gb for g in node.gpus),
            tflops=min(g.tflops for g in node.gpus),
        ),
        intra_node_gbps=node.intra_node_gbps or DEFAULT_INTRA_NODE_GBPS,
    )


def _intra_site_from_nics(site: Site, now: datetime) -> float:
    per_node = [
        sum(n.rate_gbps for n in node.rdma_nics if n.state == "active")
        for node in site.nodes
        if node.gpus and node.agent.alive_at(now)
    ]
    usable = [r for r in per_node if r > 0]
    return min(usable) if usable and len(usable) == len(per_node) else DEFAULT_INTRA_SITE_GBPS


def _links(
    sites: Sequence[Site], names: set[str], now: datetime, max_age: timedelta | None
) -> list[LinkSpec]:
    measured: dict[str, list[tuple[float, float]]] = defaultdict(list)
    ends: dict[str, tuple[str, str]] = {}
    for site in sites:
        for m in site.links:
            peer = m.peer_site.name
            if site.name not in names or peer not in names:
                continue
            if max_age is not None and now - m.measured_at > max_age:
                continue
            key = link_key(site.name, peer)
            measured[key].append((m.bandwidth_gbps, m.rtt_ms))
            lo, hi = sorted((site.name, peer))
            ends[key] = (lo, hi)
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
