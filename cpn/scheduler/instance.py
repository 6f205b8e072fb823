"""What a placement problem looks like to the scheduler, before any solver runs.

Nodes of a site that look the same to the job (GPU model, memory, speed, NVLink) form a
*group*. A node with `free` GPUs hosts ⌊free / tp⌋ shards (a tensor-parallel group never
spans nodes), so a group offers the sum of that over its nodes as *slots*, and any count
of shards up to that number can be packed onto its nodes. This is what lets the solver
work with integer counts per (stage, group) instead of one decision per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cpn.contracts.job import JobSpec
from cpn.contracts.reservations import Reservations
from cpn.contracts.topology import NodeSpec, Topology
from cpn.costmodel import GIB, Workload
from cpn.errors import InfeasibleError, InputError
from cpn.network import SiteGraph


@dataclass
class FreeNode:
    name: str
    free_gpus: list[int]  # indices not held by other jobs, ascending


@dataclass
class NodeGroup:
    """Interchangeable nodes of one site."""

    index: int
    site: str
    spec: NodeSpec
    nodes: list[FreeNode]
    slots: int  # shards this group can host: sum over nodes of ⌊free / tp⌋


@dataclass
class Instance:
    workload: Workload
    topology: Topology
    graph: SiteGraph
    reservations: Reservations
    sites: list[str]  # candidate sites, in topology order
    groups: list[NodeGroup]
    fits: list[list[bool]]  # fits[stage][group]: the stage's memory fits the group's GPUs
    compute: list[list[float]]  # compute[stage][group]: seconds per micro-batch
    site_index: dict[str, int] = field(default_factory=dict)
    #: Derived tables that several phases need (e.g. `time_flows.hop_coefficients`),
    #: computed once per instance.
    cache: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.site_index = {s: i for i, s in enumerate(self.sites)}

    @property
    def dp(self) -> int:
        return self.workload.dp

    @property
    def pp(self) -> int:
        return self.workload.pp

    def groups_of(self, site: str) -> list[NodeGroup]:
        return [g for g in self.groups if g.site == site]

    def site_slots(self, site: str, stage: int | None = None) -> int:
        return sum(
            g.slots for g in self.groups_of(site) if stage is None or self.fits[stage][g.index]
        )

    def intra_site_gbps(self, site: str) -> float:
        return self.topology.site(site).intra_site_gbps


def _eligible(job: JobSpec, spec: NodeSpec) -> bool:
    c = job.constraints
    if c.gpu_model is not None and spec.gpu.model.lower() != c.gpu_model.lower():
        return False
    return c.min_gpu_memory_gb is None or spec.gpu.memory_gb >= c.min_gpu_memory_gb


def check_job_against_topology(job: JobSpec, topology: Topology) -> None:
    """Errors that are about the job's fields, not about capacity."""
    if job.constraints.sites:
        known = set(topology.site_names)
        for i, site in enumerate(job.constraints.sites):
            if site not in known:
                raise InputError(f"constraints.sites[{i}]: unknown site {site!r}")


def build_instance(
    topology: Topology,
    workload: Workload,
    reservations: Reservations | None = None,
    graph: SiteGraph | None = None,
) -> Instance:
    """Candidate sites and node groups for the job; raises InfeasibleError with the shortfall."""
    job = workload.job
    res = reservations or Reservations()
    graph = graph or SiteGraph(topology, res)
    check_job_against_topology(job, topology)
    allowed = set(job.constraints.sites) if job.constraints.sites else None
    tp, pp = workload.tp, workload.pp

    need_gib = max(workload.memory_bytes(p) for p in range(pp)) / GIB
    free_gpus = 0  # on eligible nodes with enough memory, whether or not tp of them fit
    groups: list[NodeGroup] = []
    for site in topology.sites:
        if allowed is not None and site.name not in allowed:
            continue
        by_kind: dict[tuple[object, ...], NodeGroup] = {}
        for name, spec in site.node_instances():
            if not _eligible(job, spec):
                continue
            held = res.held(site.name, name)
            free = [i for i in range(spec.gpu.count) if i not in held]
            if spec.gpu.memory_gb >= need_gib:
                free_gpus += len(free)
            slots = len(free) // tp
            if slots == 0:
                continue
            kind = (spec.gpu.model, spec.gpu.memory_gb, spec.gpu.tflops, spec.intra_node_gbps)
            group = by_kind.get(kind)
            if group is None:
                group = NodeGroup(len(groups) + len(by_kind), site.name, spec, [], 0)
                by_kind[kind] = group
            group.nodes.append(FreeNode(name, free))
            group.slots += slots
        groups.extend(by_kind.values())
    for i, g in enumerate(groups):
        g.index = i

    fits = [[workload.fits(p, g.spec.gpu.memory_gb) for g in groups] for p in range(pp)]
    check_capacity(workload, groups, fits, allowed, free_gpus)

    sites = [s.name for s in topology.sites if any(g.site == s.name for g in groups)]
    compute = [[workload.compute_seconds(p, g.spec) for g in groups] for p in range(pp)]
    return Instance(workload, topology, graph, res, sites, groups, fits, compute)


def check_capacity(
    workload: Workload,
    groups: list[NodeGroup],
    fits: list[list[bool]],
    allowed: set[str] | None,
    free_gpus: int,
) -> None:
    """Raise a one-line shortfall when no placement can exist, before any solver runs.

    The message says what the job needs and what is free, e.g. "needs 64 GPUs with
    ≥ 40.0 GB, 48 free"; GPUs on nodes too small for the job are not counted as free.
    """
    job, dp, tp, pp = workload.job, workload.dp, workload.tp, workload.pp
    where = f" in sites {', '.join(sorted(allowed))}" if allowed else ""
    model = f" {job.constraints.gpu_model}" if job.constraints.gpu_model else ""

    floor = job.constraints.min_gpu_memory_gb or 0.0  # the job asked for that much

    def need(shards: int, gib: float) -> str:
        gib = max(gib, floor)
        gpus = f"{shards * tp}{model} GPUs"
        if tp > 1:
            gpus += f" ({shards} groups of {tp} in one node)"
        return f"{gpus} with ≥ {gib:.1f} GB{where}"

    need_gib = max(workload.memory_bytes(p) for p in range(pp)) / GIB
    total_slots = sum(g.slots for g in groups if any(fits[p][g.index] for p in range(pp)))
    if total_slots < dp * pp:
        usable = total_slots * tp
        whole = f", only {usable} of them in whole groups of {tp}" if usable < free_gpus else ""
        raise InfeasibleError(f"needs {need(dp * pp, need_gib)}, {free_gpus} free{whole}")
    for p in range(pp):
        slots = sum(g.slots for g in groups if fits[p][g.index])
        if slots < dp:
            stage_gib = workload.memory_bytes(p) / GIB
            raise InfeasibleError(f"stage {p} needs {need(dp, stage_gib)}, {slots * tp} free")


def restrict(instance: Instance, sites: set[str]) -> Instance:
    """The same problem with only `sites` as candidates (e.g. one WAN component)."""
    keep = [g for g in instance.groups if g.site in sites]
    index = [g.index for g in keep]
    groups = [NodeGroup(i, g.site, g.spec, g.nodes, g.slots) for i, g in enumerate(keep)]
    return Instance(
        instance.workload,
        instance.topology,
        instance.graph,
        instance.reservations,
        [s for s in instance.sites if s in sites],
        groups,
        [[row[i] for i in index] for row in instance.fits],
        [[row[i] for i in index] for row in instance.compute],
    )
