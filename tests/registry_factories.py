"""Registering agents straight into a registry, for tests of what comes after."""

from __future__ import annotations

import uuid
from datetime import timedelta

from cpn.registry import (
    AgentRegistration,
    GpuInfo,
    NicInfo,
    NodeInfo,
    Registered,
    Registry,
    SiteSettings,
    register_agent,
)
from cpn.registry.models import utcnow


def node(
    name: str,
    gpus: int = 4,
    model: str = "A100-80G",
    memory_gb: float = 80.0,
    nics: tuple[NicInfo, ...] = (),
) -> NodeInfo:
    return NodeInfo(
        name=name,
        gpus=tuple(GpuInfo(index=i, model=model, memory_gb=memory_gb) for i in range(gpus)),
        nics=nics,
    )


def register(
    reg: Registry,
    site: str,
    agent_id: str | None = None,
    nodes: tuple[NodeInfo, ...] | None = None,
    *,
    ttl: timedelta = timedelta(minutes=5),
    settings: SiteSettings | None = None,
    probe_address: str = "",
) -> Registered:
    with reg.write() as session:
        return register_agent(
            session,
            AgentRegistration(
                site=site,
                agent_id=agent_id or f"{site}-agent",
                version="test",
                probe_address=probe_address,
                nodes=nodes if nodes is not None else (node(f"{site}-n0"),),
            ),
            lease_id=str(uuid.uuid4()),
            ttl_ms=int(ttl.total_seconds() * 1000),
            now=utcnow(),
            site_settings=settings,
        )
