"""Plan a job: the entry point the CLI, the control plane and the REST API call."""

from __future__ import annotations

from collections.abc import Callable

from cpn.contracts.job import JobSpec
from cpn.contracts.plan import Plan
from cpn.contracts.reservations import Reservations
from cpn.contracts.topology import Topology
from cpn.network import SiteGraph
from cpn.scheduler.auto import plan_auto
from cpn.scheduler.cpsat import Objective, SolverSettings
from cpn.scheduler.realize import to_plan
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
    if progress is not None:
        progress(f"placing dp={par.dp} tp={par.tp} pp={par.pp} on {len(topology.sites)} sites")
    inst, solved = place_fixed(topology, job, par, res, graph, objective, settings)
    return to_plan(inst, solved.shards, solved.report, objective.value)
