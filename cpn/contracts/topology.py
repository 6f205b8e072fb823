"""Topology: sites, their nodes and GPUs, and the WAN links between sites.

The YAML form is documented in docs/contracts.md. All bandwidths are in gigabits per
second, latencies in milliseconds, memory in GiB. A pair of sites without a direct link
talks over the best path through other sites (see `cpn.network`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cpn.contracts.limits import (
    MAX_GPU_MEMORY_GB,
    MAX_GPUS_PER_NODE,
    MAX_NICS_PER_NODE,
    MAX_TFLOPS,
    MIN_GPU_MEMORY_GB,
    MIN_TFLOPS,
    Gbps,
    Label,
    Milliseconds,
    Name,
    Price,
)


class RdmaTransport(StrEnum):
    """RDMA flavours a NIC can speak inside a site."""

    INFINIBAND = "infiniband"
    ROCE = "roce"
    IWARP = "iwarp"


class WanTransport(StrEnum):
    """How bytes travel on a WAN link. iWARP runs over TCP/IP and suits long links."""

    TCP = "tcp"
    IWARP = "iwarp"
    ROCE = "roce"


class _Strict(BaseModel):
    # Unknown keys are errors: a typo such as `bandwith_gbps` must not be silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuSpec(_Strict):
    model: Label
    count: int = Field(ge=1, le=MAX_GPUS_PER_NODE, description="GPUs in one node")
    memory_gb: float = Field(
        ge=MIN_GPU_MEMORY_GB,
        le=MAX_GPU_MEMORY_GB,
        allow_inf_nan=False,
        description="memory of one GPU, GiB",
    )
    tflops: float = Field(
        ge=MIN_TFLOPS,
        le=MAX_TFLOPS,
        allow_inf_nan=False,
        description="peak dense TFLOP/s of one GPU in the job's dtype",
    )


class RdmaNicSpec(_Strict):
    device: Label
    transport: RdmaTransport
    rate_gbps: Gbps


class NodeSpec(_Strict):
    name: Name
    count: int = Field(default=1, ge=1, le=100_000, description="identical nodes")
    gpu: GpuSpec
    intra_node_gbps: Gbps = Field(description="GPU-to-GPU bandwidth inside a node")
    rdma: list[RdmaNicSpec] = Field(default_factory=list, max_length=MAX_NICS_PER_NODE)

    def instance_names(self) -> list[str]:
        """Names of the concrete nodes this entry stands for (`name-0`, `name-1`, ...)."""
        if self.count == 1:
            return [self.name]
        return [f"{self.name}-{i}" for i in range(self.count)]


class SiteSpec(_Strict):
    name: Name
    gpu_price_per_hour: Price = Field(default=0.0, description="price of one GPU-hour")
    intra_site_gbps: Gbps = Field(description="bandwidth between nodes of the site")
    nodes: list[NodeSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_node_names(self) -> SiteSpec:
        seen: set[str] = set()
        for node in self.nodes:
            for name in node.instance_names():
                if name in seen:
                    raise ValueError(f"duplicate node name {name!r} in site {self.name!r}")
                seen.add(name)
        return self

    def node_instances(self) -> Iterator[tuple[str, NodeSpec]]:
        """Every concrete node of the site, in file order, with the entry describing it."""
        for node in self.nodes:
            for name in node.instance_names():
                yield name, node

    @property
    def gpu_count(self) -> int:
        return sum(node.count * node.gpu.count for node in self.nodes)


class LinkSpec(_Strict):
    a: Name
    b: Name
    bandwidth_gbps: Gbps
    latency_ms: Milliseconds
    transport: WanTransport
    price_per_gb: Price = Field(default=0.0, description="egress price per GB crossing")

    @property
    def key(self) -> str:
        return link_key(self.a, self.b)


def link_key(a: str, b: str) -> str:
    """The key of an undirected link in plan JSON: the two site names, sorted, joined by |."""
    lo, hi = sorted((a, b))
    return f"{lo}|{hi}"


@dataclass(frozen=True)
class NodeInstance:
    """One concrete node: where it is and what it has."""

    site: str
    name: str
    spec: NodeSpec


class Topology(_Strict):
    sites: list[SiteSpec] = Field(min_length=1)
    links: list[LinkSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> Topology:
        names = [site.name for site in self.sites]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate site name {dupes[0]!r}")
        known = set(names)
        pairs: set[str] = set()
        for i, link in enumerate(self.links):
            for end in ("a", "b"):
                site = getattr(link, end)
                if site not in known:
                    raise ValueError(f"links[{i}].{end}: unknown site {site!r}")
            if link.a == link.b:
                raise ValueError(f"links[{i}]: a link joins two different sites, got {link.a!r}")
            if link.key in pairs:
                raise ValueError(f"links[{i}]: second link between {link.a!r} and {link.b!r}")
            pairs.add(link.key)
        return self

    def site(self, name: str) -> SiteSpec:
        for site in self.sites:
            if site.name == name:
                return site
        raise KeyError(name)

    @property
    def site_names(self) -> list[str]:
        return [site.name for site in self.sites]

    def nodes(self) -> Iterator[NodeInstance]:
        for site in self.sites:
            for name, spec in site.node_instances():
                yield NodeInstance(site.name, name, spec)

    @property
    def gpu_count(self) -> int:
        return sum(site.gpu_count for site in self.sites)
