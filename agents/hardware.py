"""What this node has and whether it still has it: discovery at start, health after."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from agents.config import AgentConfig
from agents.convert import node_message
from agents.discovery import GpuDiscovery, discover_gpus, discover_rdma
from proto.cpn.v1 import agent_pb2 as pb

log = logging.getLogger("cpn.agent")


@dataclass
class Hardware:
    config: AgentConfig
    gpus: GpuDiscovery = field(default_factory=lambda: GpuDiscovery([], "none"))
    _active_ports: set[tuple[str, int]] = field(default_factory=set)

    @property
    def real_gpus(self) -> bool:
        """GPUs a worker can use (not the virtual slots of a CPU-only host)."""
        return self.gpus.source not in ("virtual", "none")

    def discover(self) -> pb.Inventory:
        self.gpus = discover_gpus(self.config.virtual)
        nics = discover_rdma(self.config.sysfs_root)
        self._active_ports = {(n.device, n.port) for n in nics if n.state == "active"}
        log.info(
            "discovered %d GPUs (%s) and %d RDMA ports on node %s",
            len(self.gpus.gpus),
            self.gpus.source,
            len(nics),
            self.config.node_name,
        )
        node = node_message(
            self.config.node_name, self.gpus.gpus, nics, self.config.intra_node_gbps
        )
        return pb.Inventory(nodes=[node])

    def check_health(self) -> tuple[pb.Health.ValueType, str]:
        """(health, why) from a fresh look at the hardware found at start."""
        if self.real_gpus:
            found = discover_gpus(self.config.virtual)
            if found.source != self.gpus.source or len(found.gpus) < len(self.gpus.gpus):
                return pb.HEALTH_FAILING, (
                    f"{len(found.gpus)} GPUs visible ({found.source}), "
                    f"{len(self.gpus.gpus)} at start ({self.gpus.source})"
                )
        active = {
            (n.device, n.port) for n in discover_rdma(self.config.sysfs_root) if n.state == "active"
        }
        lost = sorted(self._active_ports - active)
        if lost:
            ports = ", ".join(f"{device} port {port}" for device, port in lost)
            return pb.HEALTH_DEGRADED, f"RDMA {ports} no longer active"
        return pb.HEALTH_OK, ""
