"""`compression: {wan: auto}`: the WAN sync chosen from the links the agents measured.

The topology the scheduler plans on carries each WAN link's bandwidth and latency as the
site agents last measured them (the registry's `build_topology`). For a job with
`wan: auto` the scheduler walks a ladder from the most precise sync to the most
aggressive and takes the first whose WAN time per iteration fits in `target` (10 %) of
the iteration's compute time, on the narrowest route between the job's allowed sites:

    dense (the gradient dtype) → fp16 → outer H=8 fp16 → outer H=32 int8
    → outer H=128 int4 → outer H=128 top-k 1 %

(the last one is taken when nothing fits). Per-step modes come first because they are
exact or nearly so; outer steps trade fewer exchanges for some loss (bench/README.md has
the measured frontier). The WAN time is the cost model's (`Workload.dp_wan_per_leader`,
`dp_wan_steps`; an outer step's latency counted once per H iterations), the compute time
its `compute_seconds` on the slowest GPU model the job may use. The plan records the
chosen compression (`plan.compression`) and why (`plan.wan_auto`); the runtime runs it
and writes it into every metrics record.
"""

from __future__ import annotations

import itertools

from cpn.contracts.job import (
    CompressionSpec,
    JobSpec,
    OuterValues,
    ParallelSpec,
    WanCompression,
)
from cpn.contracts.plan import WanAutoChoice
from cpn.contracts.topology import Topology
from cpn.costmodel import Workload
from cpn.network import Route, SiteGraph

LADDER: tuple[CompressionSpec, ...] = (
    CompressionSpec(wan=WanCompression.NONE),
    CompressionSpec(wan=WanCompression.FP16),
    CompressionSpec(wan=WanCompression.OUTER, every=8, values=OuterValues.FP16),
    CompressionSpec(wan=WanCompression.OUTER, every=32, values=OuterValues.INT8),
    CompressionSpec(wan=WanCompression.OUTER, every=128, values=OuterValues.INT4),
    CompressionSpec(wan=WanCompression.OUTER, every=128, values=OuterValues.TOPK, density=0.01),
)


def _narrowest(topology: Topology, job: JobSpec, graph: SiteGraph) -> Route | None:
    allowed = set(job.constraints.sites or topology.site_names)
    sites = [s.name for s in topology.sites if s.name in allowed and s.nodes]
    routes = [graph.route(a, b) for a, b in itertools.combinations(sites, 2)]
    known = [r for r in routes if r is not None]
    return min(known, key=lambda r: (r.bandwidth_gbps, -r.latency_ms), default=None)


def choose(
    topology: Topology, job: JobSpec, parallel: ParallelSpec, graph: SiteGraph
) -> WanAutoChoice:
    """The compression `wan: auto` resolves to for `job` laid out as `parallel`."""
    target = job.compression.auto_target
    route = _narrowest(topology, job, graph)
    nodes = [
        n.spec
        for n in topology.nodes()
        if not job.constraints.sites or n.site in job.constraints.sites
    ]
    if route is None or not nodes or parallel.dp < 2:
        why = "one site or one replica: nothing crosses the WAN"
        return WanAutoChoice(compression=LADDER[0], summary=LADDER[0].summary, reason=why)
    slowest = min(nodes, key=lambda n: n.gpu.tflops)
    sites = min(parallel.dp, len({n.site for n in topology.nodes()}))
    for spec in LADDER:
        w = Workload.of(job.model_copy(update={"compression": spec}), parallel)
        slot = max(w.compute_seconds(p, slowest) for p in range(w.pp))
        compute = (w.micro_batches + w.pp - 1) * slot
        latency = route.seconds(0.0, w.dp_wan_steps(sites)) / w.outer_every
        wan = max(route.seconds(w.dp_wan_per_leader(p, sites), 0) + latency for p in range(w.pp))
        share = wan / compute if compute > 0 else float("inf")
        if share <= target or spec is LADDER[-1]:
            fits = "fits" if share <= target else "is the most aggressive; still above"
            reason = (
                f"{spec.summary} {fits} {target:.0%} of compute: WAN {wan * 1e3:.3g} ms per "
                f"iteration on the narrowest route {'–'.join(route.sites)} "
                f"({route.bandwidth_gbps:g} Gbit/s, {route.latency_ms:g} ms) against "
                f"{compute * 1e3:.3g} ms of compute"
            )
            return WanAutoChoice(
                compression=spec,
                summary=spec.summary,
                reason=reason,
                wan_gbps=route.bandwidth_gbps,
                latency_ms=route.latency_ms,
                share=share if share != float("inf") else None,
            )
    raise AssertionError("unreachable: the ladder's last rung is always taken")


def resolve(
    topology: Topology, job: JobSpec, parallel: ParallelSpec, graph: SiteGraph
) -> tuple[JobSpec, WanAutoChoice | None]:
    """(the job with `wan: auto` replaced by the chosen compression, the choice), or the
    job itself and None when it does not ask for `wan: auto`."""
    if job.compression.wan is not WanCompression.AUTO:
        return job, None
    choice = choose(topology, job, parallel, graph)
    return job.model_copy(update={"compression": choice.compression}), choice
