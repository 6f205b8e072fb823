"""Plan a job: the entry point the CLI, the control plane and the REST API call."""

from __future__ import annotations

from collections.abc import Callable

from cpn.contracts.job import JobSpec
from cpn.contracts.plan import Binding, Plan
from cpn.contracts.reservations import Reservations
from cpn.contracts.topology import Topology
from cpn.network import SiteGraph
from cpn.scheduler import wan_auto
from cpn.scheduler.auto import plan_auto
from cpn.scheduler.cpsat import Objective, SolverSettings
from cpn.scheduler.realize import phase_bytes, to_plan
from cpn.scheduler.solve import place_fixed


def plan_job(
    topology: Topology,
    job: JobSpec,
    reservations: Reservations | None = None,
    objective: Objective = Objective.WAN_BYTES,
    settings: SolverSettings | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """The plan for `job` on `topology`.

    Raises `InputError` for a job that does not match the topology and `InfeasibleError`
    (with what is needed and what is free) when no placement exists.
    """
    res = reservations or Reservations()
    settings = settings or SolverSettings()
    graph = SiteGraph(topology, res)
    if job.parallel == "auto":
        return plan_auto(topology, job, res, graph, objective, settings, progress)
    par = job.fixed_parallel
    # wan: auto — the compression follows from the measured links, before placement.
    placed, auto = wan_auto.resolve(topology, job, par, graph)
    if progress is not None:
        progress(f"placing dp={par.dp} tp={par.tp} pp={par.pp} on {len(topology.sites)} sites")
        if auto is not None:
            progress(f"wan: auto chose {auto.summary}: {auto.reason}")
    inst, solved = place_fixed(topology, placed, par, res, graph, objective, settings)
    plan = to_plan(inst, solved.shards, solved.report, objective.value)
    if auto is None:
        return plan
    # Bound to the job as submitted (wan: auto); the plan says what it runs, phase by phase.
    auto = phase_bytes(inst, solved.shards, auto)
    return plan.model_copy(update={"binding": Binding.of(job, topology), "wan_auto": auto})
