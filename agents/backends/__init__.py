"""Site backends: the engines an agent runs its shards through (`cpn agent --backend`).

`local` (child processes on the agent's node), `slurm` (batch jobs through the Slurm
CLI), `kubernetes` (Indexed Jobs through the official client). See `base.py` for the
interface and the states."""

from agents.backends.base import (
    FINAL,
    BackendError,
    Capacity,
    Handle,
    LaunchSpec,
    NodeCapacity,
    NodeShare,
    SiteBackend,
    State,
    Status,
)

BACKENDS = ("local", "slurm", "kubernetes")

__all__ = [
    "BACKENDS",
    "FINAL",
    "BackendError",
    "Capacity",
    "Handle",
    "LaunchSpec",
    "NodeCapacity",
    "NodeShare",
    "SiteBackend",
    "State",
    "Status",
]
