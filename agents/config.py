"""The agent's settings, as `cpn agent` assembles them from its flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agents.discovery.gpus import VirtualGpus
from agents.discovery.rdma import DEFAULT_SYSFS_ROOT

#: The runtime's worker (cpn/train), reporting its steps through `--metrics`.
DEFAULT_WORKER_COMMAND = (
    "{python} -m cpn worker --plan {plan} --job {job} --rank {rank} --metrics {metrics}"
)


@dataclass(frozen=True)
class AgentConfig:
    site: str
    control: str  # host:port of the control plane's gRPC service
    token: str
    agent_id: str
    node_name: str
    virtual: VirtualGpus = field(default_factory=VirtualGpus)
    intra_node_gbps: float = 0.0
    sysfs_root: Path = DEFAULT_SYSFS_ROOT
    probe_host: str = "0.0.0.0"
    probe_port: int = 0
    advertise_host: str | None = None  # None: the address that routes to the control plane
    probe_interval_s: float = 30.0
    probe_bytes: int = 4 * 1024 * 1024
    worker_command: str = DEFAULT_WORKER_COMMAND
    work_dir: Path = Path("cpn-agent-work")
    stop_grace_s: float = 10.0
    max_backoff_s: float = 30.0
    tls_ca: Path | None = None  # PEM roots to verify the control plane: TLS when set
