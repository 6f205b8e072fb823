"""`parallel: auto`: choose dp × tp × pp for a GPU budget, then place it.

Candidates: every factorisation of the budget with tp ≤ the GPUs of the largest eligible
node and dividing the heads, pp dividing the layers, dp dividing the batch into whole
micro-batches, and every stage fitting in the memory of some eligible GPU. They are
solved in order of a proven lower bound on their iteration time (`time_bound.py`: compute,
pipeline hops and data-parallel sync any placement must pay; without the pattern machinery,
pure compute on the fastest eligible GPU), sharing the budget; a candidate whose bound is
no better than the best plans found so far (the winner and its runners-up) is pruned
without solving. The plan with the
best predicted iteration time wins (DESIGN.md §4); the next ones are reported as
runners-up. The report's gap is on iteration time against the least bound of the layouts
solved, which bounds every layout (the pruned ones' bounds are above the best plan).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from cpn.contracts.job import JobSpec, ParallelSpec, layout_problem
from cpn.contracts.plan import Alternative, Plan, SolverReport
from cpn.contracts.reservations import Reservations
from cpn.contracts.topology import Topology
from cpn.costmodel import GIB, Workload
from cpn.errors import InfeasibleError
from cpn.network import SiteGraph
from cpn.scheduler.cpsat import Objective, SolverSettings
from cpn.scheduler.instance import Instance, build_instance, check_job_against_topology
from cpn.scheduler.realize import to_plan
from cpn.scheduler.solve import Solved, place_fixed
from cpn.scheduler.time_bound import iteration_time_bound

RUNNERS_UP = 3


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(job: JobSpec, topology: Topology) -> list[tuple[float, ParallelSpec]]:
    """Feasible-looking layouts with a lower bound on their iteration time, best first."""
    assert job.gpus is not None
    c = job.constraints
    allowed = set(c.sites) if c.sites else None
    specs = [
        n.spec
        for n in topology.nodes()
        if (allowed is None or n.site in allowed)
        and (c.gpu_model is None or n.spec.gpu.model.lower() == c.gpu_model.lower())
        and (c.min_gpu_memory_gb is None or n.spec.gpu.memory_gb >= c.min_gpu_memory_gb)
    ]
    if not specs:
        return []
    max_tp = max(s.gpu.count for s in specs)
    max_mem = max(s.gpu.memory_gb for s in specs)
    fastest = max(specs, key=lambda s: (s.gpu.tflops, s.intra_node_gbps))
    out = []
    for tp in divisors(job.gpus):
        if tp > max_tp:
            continue
        for pp in divisors(job.gpus // tp):
            dp = job.gpus // (tp * pp)
            par = ParallelSpec(dp=dp, tp=tp, pp=pp)
            if layout_problem(job.model, job.train, par):
                continue
            w = Workload(job, par)
            if any(w.memory_bytes(p) > max_mem * GIB for p in range(pp)):
                continue
            slot = max(w.compute_seconds(p, fastest) for p in range(pp))
            out.append(((w.micro_batches + pp - 1) * slot, par))
    out.sort(key=lambda t: (t[0], t[1].pp, t[1].tp))
    return out


def plan_auto(
    topology: Topology,
    job: JobSpec,
    reservations: Reservations,
    graph: SiteGraph,
    objective: Objective,
    settings: SolverSettings,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    check_job_against_topology(job, topology)
    cands = candidates(job, topology)
    if not cands:
        raise InfeasibleError(
            f"no dp×tp×pp layout of {job.gpus} GPUs fits: tp must divide heads "
            f"({job.model.heads}) and fit in one node, pp divide layers ({job.model.layers}), "
            f"dp divide global_batch/micro_batch, and every stage fit in GPU memory"
        )
    start = time.perf_counter()
    reasons: list[str] = []
    # Each layout's proven bound on the iteration time of any of its placements: the
    # compute-only one, or (with the pattern machinery) `iteration_time_bound`.
    ranked: list[tuple[float, ParallelSpec]] = []
    for compute_only, par in cands:
        bound = compute_only
        if settings.patterns:
            try:
                inst = build_instance(topology, Workload(job, par), reservations, graph)
            except InfeasibleError as exc:
                reasons.append(f"dp={par.dp} tp={par.tp} pp={par.pp}: {exc}")
                continue
            bound = max(bound, iteration_time_bound(inst).seconds)
        ranked.append((bound, par))
    ranked.sort(key=lambda t: (t[0], t[1].pp, t[1].tp))
    tried: list[tuple[float, ParallelSpec, Instance, Solved, float]] = []
    pruned = 0
    for i, (bound, par) in enumerate(ranked):
        # A layout is pruned when its bound shows it can be neither the best plan nor a
        # runner-up: no better than the slowest of the best 1 + RUNNERS_UP plans so far.
        times = sorted(t[0] for t in tried)
        cutoff = times[RUNNERS_UP] if len(times) > RUNNERS_UP else float("inf")
        if bound >= cutoff:
            pruned += len(ranked) - i  # sorted by bound: every later one is pruned too
            break
        if progress is not None:
            progress(f"[{i + 1}/{len(ranked)}] dp={par.dp} tp={par.tp} pp={par.pp}")
        # Equal shares, fixed in advance: the plan must not depend on the machine's speed.
        per_try = replace(settings, time_limit=max(0.5, settings.time_limit / len(ranked)))
        try:
            inst, solved = place_fixed(topology, job, par, reservations, graph, objective, per_try)
        except InfeasibleError as exc:
            reasons.append(f"dp={par.dp} tp={par.tp} pp={par.pp}: {exc}")
            continue
        tried.append((solved.evaluation.iteration_seconds, par, inst, solved, bound))
    if not tried:
        raise InfeasibleError(
            f"none of {len(cands)} layouts of {job.gpus} GPUs can be placed (first: {reasons[0]})"
        )
    tried.sort(key=lambda t: (t[0], t[3].evaluation.wan))
    _, par, inst, solved, _ = tried[0]
    runners = [
        Alternative(
            parallel=p,
            predicted_iteration_seconds=s.evaluation.iteration_seconds,
            wan_bytes=s.evaluation.wan,
            status=s.report.status,
        )
        for _, p, _, s, _ in tried[1 : 1 + RUNNERS_UP]
    ]
    counts = {
        "seconds": time.perf_counter() - start,
        "layouts_considered": len(cands),
        "layouts_solved": len(tried),
        "layouts_pruned": pruned,
    }
    if settings.patterns:
        report = _layout_search_report(tried, objective, counts)
    else:
        report = solved.report.model_copy(update=counts)
    return to_plan(inst, solved.shards, report, objective.value, runners)


def _layout_search_report(
    tried: list[tuple[float, ParallelSpec, Instance, Solved, float]],
    objective: Objective,
    counts: dict[str, float | int],
) -> SolverReport:
    """The report of the layout search: the winner's iteration time against the least
    bound of the layouts solved.

    `parallel: auto` ranks layouts by iteration time, so that is what its gap is about,
    whatever objective placed each layout. A layout pruned without solving had a bound at
    least the best time found, so the least bound of those solved bounds every layout.
    """
    value = tried[0][3].evaluation.iteration_seconds
    bounds = []
    for _, _, _, solved, layout_bound in tried:
        solver = solved.report
        if objective is Objective.ITERATION_TIME and solver.bound > layout_bound:
            bounds.append((solver.bound, solver.proved_by or "CP-SAT"))
        else:
            bounds.append((layout_bound, "time bound"))
    bound, proved_by = min(bounds)
    optimal = value <= bound * (1 + 1e-12)
    return SolverReport(
        status="OPTIMAL" if optimal else "FEASIBLE",
        seconds=float(counts["seconds"]),
        objective=value,
        bound=value if optimal else bound,
        gap=0.0 if optimal or value == 0 else max(0.0, (value - bound) / value),
        objective_name=Objective.ITERATION_TIME.value,
        objective_unit="seconds",
        proved_by=proved_by,
        layouts_considered=int(counts["layouts_considered"]),
        layouts_solved=int(counts["layouts_solved"]),
        layouts_pruned=int(counts["layouts_pruned"]),
    )
