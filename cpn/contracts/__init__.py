"""The contracts cpn exchanges with the outside world: topology, job, plan, reservations.

These are the file formats documented in docs/contracts.md. They are shared by every
layer (scheduler, control plane, runtime, REST API), so they depend on nothing else in cpn.
"""

from cpn.contracts.job import (
    CompressionSpec,
    ConstraintsSpec,
    Dtype,
    JobSpec,
    ModelSpec,
    OnWorkerError,
    OuterValues,
    ParallelSpec,
    RecoverySpec,
    TrainSpec,
    WanCompression,
)
from cpn.contracts.loading import dump_yaml, load_job, load_reservations, load_topology
from cpn.contracts.plan import (
    Alternative,
    Breakdown,
    BytesPerIteration,
    Plan,
    RankInfo,
    ShardPlacement,
    SolverReport,
)
from cpn.contracts.reservations import Reservations
from cpn.contracts.topology import (
    GpuSpec,
    LinkSpec,
    NodeSpec,
    RdmaNicSpec,
    RdmaTransport,
    SiteSpec,
    Topology,
    WanTransport,
    link_key,
)

__all__ = [
    "Alternative",
    "Breakdown",
    "BytesPerIteration",
    "CompressionSpec",
    "ConstraintsSpec",
    "Dtype",
    "GpuSpec",
    "JobSpec",
    "LinkSpec",
    "ModelSpec",
    "NodeSpec",
    "OnWorkerError",
    "OuterValues",
    "ParallelSpec",
    "Plan",
    "RankInfo",
    "RdmaNicSpec",
    "RdmaTransport",
    "RecoverySpec",
    "Reservations",
    "ShardPlacement",
    "SiteSpec",
    "SolverReport",
    "Topology",
    "TrainSpec",
    "WanCompression",
    "WanTransport",
    "dump_yaml",
    "link_key",
    "load_job",
    "load_reservations",
    "load_topology",
]
