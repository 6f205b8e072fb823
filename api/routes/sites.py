"""`GET /v1/sites`: every site with its agents (and whether they are alive), nodes, GPUs,
RDMA NICs and the WAN links its agents measured."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from api.deps import SessionDep
from api.schemas import (
    AgentPublic,
    GpuPublic,
    LinkPublic,
    NodePublic,
    RdmaNicPublic,
    SitePublic,
)
from cpn.registry.models import Agent, Gpu, Node, Site, WanLink, utcnow

router = APIRouter(prefix="/v1/sites", tags=["sites"])


@router.get("", response_model=list[SitePublic])
def list_sites(session: SessionDep) -> list[SitePublic]:
    now = utcnow()
    sites = session.scalars(
        select(Site)
        .order_by(Site.name)
        .options(
            selectinload(Site.agents).selectinload(Agent.lease),
            selectinload(Site.nodes).selectinload(Node.gpus).selectinload(Gpu.allocation),
            selectinload(Site.nodes).selectinload(Node.rdma_nics),
            selectinload(Site.nodes).selectinload(Node.agent),
            selectinload(Site.links).selectinload(WanLink.peer_site),
        )
    ).all()
    return [
        SitePublic(
            name=site.name,
            gpu_price_per_hour=site.gpu_price_per_hour,
            intra_site_gbps=site.intra_site_gbps,
            agents=[
                AgentPublic(
                    agent_id=a.agent_id,
                    version=a.version,
                    alive=a.alive_at(now),
                    status="alive" if a.alive_at(now) else "lost",
                    health=a.health,
                    registrations=a.registrations,
                    registered_at=a.registered_at,
                    last_heartbeat_at=a.last_heartbeat_at,
                    lease_expires_at=a.lease.expires_at if a.lease else None,
                    lost_at=a.lost_at,
                    probe_address=a.probe_address,
                )
                for a in site.agents
            ],
            nodes=[
                NodePublic(
                    name=n.name,
                    agent_id=n.agent.agent_id,
                    intra_node_gbps=n.intra_node_gbps,
                    gpus=[
                        GpuPublic(
                            index=g.index,
                            model=g.model,
                            memory_gb=g.memory_gb,
                            tflops=g.tflops,
                            uuid=g.uuid,
                            source=g.source,
                            status=g.status.value,
                            allocated_to=g.allocation.job_id if g.allocation else None,
                            utilisation=g.utilisation,
                            memory_used_gb=g.memory_used_gb,
                        )
                        for g in n.gpus
                    ],
                    rdma_nics=[
                        RdmaNicPublic(
                            device=c.device,
                            port=c.port,
                            transport=c.transport,
                            roce_version=c.roce_version,
                            rate_gbps=c.rate_gbps,
                            state=c.state,
                        )
                        for c in n.rdma_nics
                    ],
                )
                for n in site.nodes
            ],
            links=[
                LinkPublic(
                    peer=link.peer_site.name,
                    bandwidth_gbps=link.bandwidth_gbps,
                    rtt_ms=link.rtt_ms,
                    measured_at=link.measured_at,
                    reported_by=link.reported_by,
                )
                for link in site.links
            ],
        )
        for site in sites
    ]
