"""Response schemas: what the API shows of the registry's rows (`*Public`).

Numbers carry the bounds the registry guarantees for what it stores (counts and indices
are never negative; the limits in `cpn.contracts.limits` apply on the way in), so the
OpenAPI document tells clients what to expect.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from cpn.contracts.limits import AGENT_ID_MAX, INT32_MAX, LABEL_MAX, NAME_MAX


class GpuPublic(BaseModel):
    index: int = Field(ge=0, le=INT32_MAX)
    model: str = Field(max_length=LABEL_MAX)
    memory_gb: float = Field(description="GiB")
    tflops: float = Field(description="peak dense TFLOP/s")
    uuid: str
    source: str = Field(description="nvml | nvidia-smi | torch-cuda | virtual")
    status: str = Field(description="available | lost")
    allocated_to: str | None = Field(description="the job holding it, if any")
    utilisation: float | None = Field(description="0..1, from the latest heartbeats")
    memory_used_gb: float | None


class RdmaNicPublic(BaseModel):
    device: str
    port: int = Field(ge=0, le=INT32_MAX)
    transport: str = Field(description="infiniband | roce | iwarp")
    roce_version: int = Field(ge=0)
    rate_gbps: float
    state: str


class NodePublic(BaseModel):
    name: str = Field(max_length=NAME_MAX)
    agent_id: str = Field(max_length=AGENT_ID_MAX, description="the agent reporting it")
    alive: bool = Field(description="its agent's lease is live; checked against the clock")
    intra_node_gbps: float | None
    gpus: list[GpuPublic]
    rdma_nics: list[RdmaNicPublic]


class AgentPublic(BaseModel):
    agent_id: str = Field(max_length=AGENT_ID_MAX)
    version: str
    alive: bool = Field(description="lease renewed in time; checked against the clock")
    status: str = Field(description="alive | lost (lost: its lease expired)")
    health: str
    registrations: int = Field(ge=0)
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
    """A site in summary; its agents and nodes are pages of their own
    (`/v1/sites/{site}/agents`, `/v1/sites/{site}/nodes`)."""

    name: str = Field(max_length=NAME_MAX)
    gpu_price_per_hour: float
    intra_site_gbps: float | None
    agents_total: int = Field(ge=0)
    agents_alive: int = Field(ge=0, description="agents whose lease is live")
    nodes_total: int = Field(ge=0)
    gpus_total: int = Field(ge=0, description="= free + allocated + lost")
    gpus_free: int = Field(ge=0, description="available, on a live agent, held by no job")
    gpus_allocated: int = Field(ge=0, description="held by a job")
    gpus_lost: int = Field(ge=0, description="held by no job and lost, or on a lost agent")
    links: list[LinkPublic] = Field(description="WAN as measured from this site")
