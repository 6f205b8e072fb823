"""The agent's settings, as `cpn agent` assembles them from its flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agents.backends.slurm import SlurmOptions
from agents.discovery.gpus import VirtualGpus
from agents.discovery.rdma import DEFAULT_SYSFS_ROOT

#: Placeholders a custom worker command may use (`cpn launch --command`).
WORKER_PLACEHOLDERS = ("python", "plan", "job", "metrics")


@dataclass(frozen=True)
class KubernetesSettings:
    """`--k8s-*`: what a Kubernetes site's admin gave cpn (agents/backends/kubernetes.py)."""

    namespace: str
    image: str
    service_account: str | None = None
    work_claim: str | None = None


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
    #: None: the runtime's `cpn worker`; else a command with WORKER_PLACEHOLDERS in it.
    worker_command: str | None = None
    work_dir: Path = Path("cpn-agent-work")
    stop_grace_s: float = 10.0
    max_backoff_s: float = 30.0
    tls_ca: Path | None = None  # PEM roots to verify the control plane: TLS when set
    #: The site's engine: local (child processes on this node) or slurm (the whole site).
    backend: str = "local"
    slurm: SlurmOptions | None = None  # with backend "slurm": partition, account, ...
    #: With backend "kubernetes": namespace, image, service account, work volume claim.
    kubernetes: KubernetesSettings | None = None
    #: The longest a launch may run on a site engine (Slurm's --time).
    time_limit_s: int = 24 * 3600
