"""`compression: {wan: auto}`: the WAN sync schedule chosen from the links the agents
measured.

The topology the scheduler plans on carries each WAN link's bandwidth and latency as the
site agents last measured them (the registry's `build_topology`). For a job with
`wan: auto` the scheduler takes the narrowest route between the job's allowed sites and
the iteration's compute time on the slowest GPU model the job may use (the cost model's
`compute_seconds`), and `cpn.wan_schedule` — the same pure functions the runtime uses
when the measured bandwidth changes during the run — makes the schedule: a dense fp16
warm-up when the whole run's budget affords one, then the first rung of the ladder whose
WAN time fits `target` (10 %) of compute, its outer optimizer chosen by the number of
outer steps it will make. The plan records the steady rung (`plan.compression`, what
placement costs) and the schedule with the figures it rests on (`plan.wan_auto`); the
runtime runs it and writes the rung into every metrics record.
"""

from __future__ import annotations

import itertools

from cpn.contracts.job import JobSpec, ParallelSpec, WanCompression
from cpn.contracts.plan import WanAutoChoice, WanPhase
from cpn.contracts.topology import Topology
from cpn.costmodel import Workload
from cpn.network import Route, SiteGraph
from cpn.wan_schedule import LADDER, Budget, Link, plan_phases

__all__ = ["LADDER", "choose", "resolve"]


def _narrowest(topology: Topology, job: JobSpec, graph: SiteGraph) -> Route | None:
    allowed = set(job.constraints.sites or topology.site_names)
    sites = [s.name for s in topology.sites if s.name in allowed and s.nodes]
    routes = [graph.route(a, b) for a, b in itertools.combinations(sites, 2)]
    known = [r for r in routes if r is not None]
    return min(known, key=lambda r: (r.bandwidth_gbps, -r.latency_ms), default=None)


def choose(
    topology: Topology, job: JobSpec, parallel: ParallelSpec, graph: SiteGraph
) -> WanAutoChoice:
    """The schedule `wan: auto` resolves to for `job` laid out as `parallel`."""
    target = job.compression.auto_target
    route = _narrowest(topology, job, graph)
    nodes = [
        n.spec
        for n in topology.nodes()
        if not job.constraints.sites or n.site in job.constraints.sites
    ]
    if route is None or not nodes or parallel.dp < 2:
        why = "one site or one replica: nothing crosses the WAN"
        only = WanPhase(start=0, rung=0, compression=LADDER[0])
        return WanAutoChoice(
            compression=LADDER[0], summary=LADDER[0].summary, reason=why, phases=[only]
        )
    slowest = min(nodes, key=lambda n: n.gpu.tflops)
    sites = min(parallel.dp, len({n.site for n in topology.nodes()}))
    w = Workload.of(job.model_copy(update={"compression": LADDER[0]}), parallel)
    slot = max(w.compute_seconds(p, slowest) for p in range(w.pp))
    compute = (w.micro_batches + w.pp - 1) * slot
    budget = Budget(job, parallel, sites, compute, target)
    link = Link(route.bandwidth_gbps, route.latency_ms)
    steps = job.train.steps
    phases = plan_phases(budget, link, steps)
    last = phases[-1]
    spec = last.compression
    share = budget.share(spec, link)
    fits = "fits" if share <= target else "is the most aggressive; still above"
    wan = budget.wan_seconds(spec, link)
    reason = (
        f"{spec.summary} {fits} {target:.0%} of compute: WAN {wan * 1e3:.3g} ms per "
        f"iteration on the narrowest route {'–'.join(route.sites)} "
        f"({route.bandwidth_gbps:g} Gbit/s, {route.latency_ms:g} ms) against "
        f"{compute * 1e3:.3g} ms of compute"
    )
    if spec.outer_lr is not None:
        how = "model averaging" if spec.outer_lr == 1 else "Nesterov outer steps"
        reason += f"; {-(-(steps - last.start) // spec.outer_every)} outer steps: {how}"
    if len(phases) > 1:
        reason += f"; after {last.start} dense fp16 warm-up steps (what the budget spares)"
    return WanAutoChoice(
        compression=spec,
        summary=spec.summary,
        reason=reason,
        wan_gbps=route.bandwidth_gbps,
        latency_ms=route.latency_ms,
        share=share if share != float("inf") else None,
        phases=[WanPhase(start=p.start, rung=p.rung, compression=p.compression) for p in phases],
        sites=sites,
        compute_s=compute,
        target=target,
    )


def resolve(
    topology: Topology, job: JobSpec, parallel: ParallelSpec, graph: SiteGraph
) -> tuple[JobSpec, WanAutoChoice | None]:
    """(the job with `wan: auto` replaced by the chosen compression, the choice), or the
    job itself and None when it does not ask for `wan: auto`."""
    if job.compression.wan is not WanCompression.AUTO:
        return job, None
    choice = choose(topology, job, parallel, graph)
    return job.model_copy(update={"compression": choice.compression}), choice
