"""Response schemas: what the API shows of the registry's rows (`*Public`)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class GpuPublic(BaseModel):
    index: int
    model: str
    memory_gb: float
    tflops: float
    uuid: str
    source: str = Field(description="nvml | nvidia-smi | torch-cuda | virtual")
    status: str = Field(description="available | lost")
    allocated_to: str | None = Field(description="the job holding it, if any")
    utilisation: float | None
    memory_used_gb: float | None


class RdmaNicPublic(BaseModel):
    device: str
    port: int
    transport: str = Field(description="infiniband | roce | iwarp")
    roce_version: int
    rate_gbps: float
    state: str


class NodePublic(BaseModel):
    name: str
    agent_id: str
    intra_node_gbps: float | None
    gpus: list[GpuPublic]
    rdma_nics: list[RdmaNicPublic]


class AgentPublic(BaseModel):
    agent_id: str
    version: str
    alive: bool = Field(description="lease renewed in time; checked against the clock")
    status: str = Field(description="alive | lost (lost: its lease expired)")
    health: str
    registrations: int
    registered_at: datetime
    last_heartbeat_at: datetime | None
    lease_expires_at: datetime | None
    lost_at: datetime | None
    probe_address: str


class LinkPublic(BaseModel):
    peer: str = Field(description="the other site")
    bandwidth_gbps: float
    rtt_ms: float
    measured_at: datetime
    reported_by: str


class SitePublic(BaseModel):
    name: str
    gpu_price_per_hour: float
    intra_site_gbps: float | None
    agents: list[AgentPublic]
    nodes: list[NodePublic]
    links: list[LinkPublic] = Field(description="WAN as measured from this site")
