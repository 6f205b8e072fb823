"""Solve a job with a fixed layout: build the instance, solve in phases, map to GPUs.

Phases (see `cpn.scheduler.cpsat` for the model): the compact bytes model first, hinted
with the better baseline; then the time model with flows between sites, hinted with
that solution; for the time objective a last pass breaks ties on bytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from cpn.contracts.job import JobSpec, ParallelSpec
from cpn.contracts.plan import ShardPlacement, SolverReport
from cpn.contracts.reservations import Reservations
from cpn.contracts.topology import Topology
from cpn.costmodel import Evaluation, Workload
from cpn.errors import InfeasibleError
from cpn.network import SiteGraph
from cpn.scheduler import baselines, heuristics, lns
from cpn.scheduler.cpsat import (
    PS,
    Objective,
    PhaseReport,
    PlacementModel,
    SolverSettings,
    run,
)
from cpn.scheduler.instance import Instance, build_instance, check_capacity, restrict
from cpn.scheduler.patterns.cuts import add_cuts
from cpn.scheduler.patterns.problem import counts_of as pattern_counts
from cpn.scheduler.patterns.search import PatternResult, pattern_search
from cpn.scheduler.realize import (
    Counts,
    complete_flows,
    counts_of,
    evaluate_shards,
    realize,
)
from cpn.scheduler.time_anneal import anneal_blocks
from cpn.scheduler.time_bound import TimeBound, iteration_time_bound
from cpn.scheduler.time_flows import balanced_flows, hop_coefficients
from cpn.scheduler.time_levels import level_search

#: Up to this many candidate sites the time phase may move shards between sites; beyond
#: it (with the bytes objective) it keeps the bytes phase's counts and chooses flows only.
FULL_TIME_MODEL_SITES = 16
#: On large instances, the share of a phase's budget the full CP-SAT solve gets (for its
#: bound and a first improvement); LNS gets the rest.
FULL_SOLVE_SHARE = 0.3
#: Share of the time limit kept for realising and evaluating the final placement.
FINISH_SHARE = 0.08
#: Relative error of the time model's integer coefficients against the cost model.
TIME_MODEL_TOLERANCE = 2e-3
#: Share of the budget the pattern search (bound, cuts, plans) may take for WAN bytes.
PATTERN_SHARE = 0.4
#: Share of the budget the annealing of block positions takes for time on large networks,
#: where the CP-SAT time model, moving shards, has not improved its clustered start in any
#: measured run (64 sites: 0.4 gave plans 0–7 % faster than none, 0.7 another 1–9 %).
ANNEAL_SHARE = 0.7
#: The annealer's share where the sync-level search runs beside it: 0.25, 0.4 and 0.45
#: gave slower plans than 0.35 on 2–4 of the four 64-site bench instances (2026-11-29).
ANNEAL_SHARE_WITH_LEVELS = 0.35
#: Share of the budget the search over sync levels (`time_levels`) takes for time, after
#: the annealing: its placements (each stage on its own overlapping sites) beat the
#: annealed ones by 4–15 % on three of the four 64-site bench instances and the CP-SAT
#: time model's by 15 % on the 16-site heterogeneous dense one. Up to `LEVEL_MIN_SITES`
#: sites the CP-SAT time model, which then often proves its plan optimal, keeps the budget;
#: beyond `LEVEL_MAX_SITES` the local search found nothing in its share (128 sites, four
#: generated networks: a model of 30–110 thousand variables) and the annealer's full share
#: did better (128.51 against 155.03 s on one).
LEVEL_SHARE = 0.45
LEVEL_MIN_SITES = 8
LEVEL_MAX_SITES = 64
#: Beyond this many sites the annealer is not run: a block position spans dozens of sites,
#: each move's flows take tens of milliseconds, and at 256 sites it gained 0.6 % (44.69 →
#: 44.43 s) while taking 12 s over its share of a 30 s budget.
ANNEAL_MAX_SITES = 128


def objective_key(objective: Objective) -> Callable[[Evaluation], tuple[float, float]]:
    """Lexicographic score of an evaluated placement: primary, then the tie-breaker."""
    if objective is Objective.WAN_BYTES:
        return lambda ev: (float(ev.wan), ev.iteration_seconds)
    return lambda ev: (ev.iteration_seconds, float(ev.wan))


@dataclass
class Solved:
    shards: list[ShardPlacement]
    evaluation: Evaluation
    report: SolverReport


def _starting_points(
    inst: Instance,
    objective: Objective,
    spread: bool = True,
    clustered: dict[int, tuple[tuple[float, float], list[ShardPlacement]]] | None = None,
) -> list[Counts]:
    """The baselines and constructive heuristics, best first, as counts with flows.

    Each candidate's replicas are re-matched across stages (`complete_flows`), which
    only removes needless crossings. For the time objective with `spread`, each also gets
    the flows of `time_flows.balanced_flows` when they are faster, and the clustered
    blocks of `heuristics.cluster_blocks` join the candidates; `clustered`, if given,
    receives the best of those per block length, with its score (for `time_anneal`).
    """
    key = objective_key(objective)
    scored: list[tuple[tuple[float, float], int, Counts]] = []
    lengths: dict[int, int] = {}  # maker index → block length of a clustered maker
    makers: list[Callable[[Instance], list[ShardPlacement] | None]] = [
        heuristics.chain_fill,
        heuristics.cluster_replicas,
        baselines.greedy,
        baselines.round_robin,
    ]
    makers += [partial(heuristics.blocks, length=n) for n in heuristics.block_lengths(inst.pp)]
    if spread and objective is Objective.ITERATION_TIME:
        for n in heuristics.block_lengths(inst.pp):
            if n < inst.pp:
                for near in (True, False):
                    lengths[len(makers)] = n
                    makers.append(partial(heuristics.cluster_blocks, length=n, near=near))
    hops = hop_coefficients(inst) if spread and objective is Objective.ITERATION_TIME else None
    for i, make in enumerate(makers):
        shards = make(inst)
        if shards is None:
            continue
        counts = complete_flows(inst, Counts(counts_of(inst, shards).shards))
        if hops is not None:
            # For time, spread the crossing replicas over pairs of sites (time_flows): for
            # the same counts these flows are the fastest (tests/unit/test_scheduler_time).
            counts = balanced_flows(inst, counts, hops) or counts
        score = key(evaluate_shards(inst, realize(inst, counts)))
        scored.append((score, i, counts))
        if clustered is not None and i in lengths:
            n = lengths[i]
            if n not in clustered or score < clustered[n][0]:
                clustered[n] = (score, shards)
    return [counts for _, _, counts in sorted(scored, key=lambda t: (t[0], t[1]))]


@dataclass(frozen=True)
class ProvenBound:
    """A lower bound proved outside CP-SAT, in the objective's unit, and what proved it."""

    value: float
    proved_by: str


def _report(
    primary: PhaseReport | None,
    objective: Objective,
    final: Evaluation,
    seconds: float,
    proven: ProvenBound | None = None,
) -> SolverReport:
    """The solver report of the final plan: the best bound of CP-SAT's and `proven`."""
    value = float(final.wan) if objective is Objective.WAN_BYTES else final.iteration_seconds
    unit = "bytes" if objective is Objective.WAN_BYTES else "seconds"
    solved = primary is not None and math.isfinite(primary.value)
    # The time model rounds coefficients (picoseconds, 0.1 % volume units), so its proven
    # bound holds for the plans' true times only up to that rounding: taken off here.
    tolerance = 0.0 if objective is Objective.WAN_BYTES else TIME_MODEL_TOLERANCE
    solver_bound = primary.bound * (1 - tolerance) if primary is not None and solved else 0.0
    own = proven.value if proven is not None else 0.0
    if not solved and proven is None:
        return SolverReport(
            status="HEURISTIC",
            seconds=seconds,
            objective=value,
            bound=0.0,
            gap=1.0 if value > 0 else 0.0,
            objective_name=objective.value,
            objective_unit=unit,
        )
    bound = min(max(solver_bound, own), value)
    # The solver's optimum on its model is the plan's up to that rounding: OPTIMAL, with
    # the bound it proves (the CLI says "up to the time model's rounding" when below).
    proved_equal = value <= bound * (1 + 1e-12)
    optimal = proved_equal or (
        primary is not None
        and primary.status == "OPTIMAL"
        and value <= primary.value * (1 + tolerance)
    )
    gap = 0.0 if optimal or value == 0 else max(0.0, (value - bound) / value)
    proved_by = proven.proved_by if proven is not None and own >= solver_bound else "CP-SAT"
    return SolverReport(
        status="OPTIMAL" if optimal else "FEASIBLE",
        seconds=seconds,
        objective=value,
        bound=value if proved_equal else bound,
        gap=gap,
        objective_name=objective.value,
        objective_unit=unit,
        proved_by=proved_by,
    )


@dataclass
class Optimised:
    counts: Counts
    report: PhaseReport  # status and proven bound of the full solve; value of the result
    units: int | None  # the model's objective for `counts`, in its units


def optimise(
    model: PlacementModel,
    objective: Objective,
    start: Counts | None,
    settings: SolverSettings,
    seconds: float,
    cap: tuple[Objective, int] | None = None,
) -> Optimised | None:
    """A full solve (for the bound), then LNS on what is left if it was not optimal.

    `seconds` is both the deterministic budget (× `settings.dtime_per_second`) and a hard
    wall-clock limit for the phase. Small instances are usually solved to optimality by
    the full solve alone; on large ones it gets a share and the deterministic LNS the rest.
    """
    began = time.perf_counter()
    deadline = began + seconds
    # The start's value under the cap `run` adds below (None: no incumbent for LNS).
    # The time model's pinned solve can take seconds on dense networks: cap it by the
    # phase's budget (the compact model's is quick and keeps its deterministic limit).
    hint_wall = seconds if model.with_time else None
    start_units = model.hint(start, objective, cap, hint_wall) if start is not None else None
    large = len(model.inst.sites) > FULL_TIME_MODEL_SITES
    first = seconds * (FULL_SOLVE_SHARE if large else 1.0)
    wall = max(0.05, min(2 * first, deadline - time.perf_counter()))
    solver, _, report = run(model, objective, settings, first, cap, wall)
    if math.isfinite(report.value):
        counts, units = model.counts(solver), round(solver.objective_value)
    elif start is not None and start_units is not None:
        # The full solve found nothing in its share (presolve and the root LP can take it
        # all on large models): carry on from the start.
        counts, units = start, start_units
    else:
        return None
    scale = model.bytes_unit if objective is Objective.WAN_BYTES else 1 / PS
    left_wall = deadline - time.perf_counter()
    if report.status != "OPTIMAL" and seconds - first > 0.05 and left_wall > 0.1:
        # LNS works on the model as it is, so a cap added by `run` stays in force.
        result = lns.improve(model, objective, counts, units, settings, seconds - first, left_wall)
        if result.improvements:
            counts, units = result.counts, result.value
            if model.with_time:
                # LNS returns counts only; read the flows back from a pinned solve.
                left = max(0.05, deadline - time.perf_counter())
                if model.hint(counts, objective, cap, left) is not None:
                    counts = _flows_of_hint(model, counts)
                else:  # the pinned solve ran out of time: the greedy flows will do
                    counts = complete_flows(model.inst, Counts(counts.shards))
    if report.value != units * scale:
        report = PhaseReport(
            objective, report.status, time.perf_counter() - began, units * scale, report.bound
        )
    return Optimised(counts, report, units)


def _flows_of_hint(model: PlacementModel, counts: Counts) -> Counts:
    """Counts with the flows the model's completed hint chose for them."""
    hint = model.m.proto.solution_hint
    hinted = dict(zip(hint.vars, hint.values, strict=True))
    flows = {(p, s, s): hinted.get(v.index, 0) for (p, s), v in model.stay.items()}
    flows.update({arc: hinted.get(v.index, 0) for arc, v in model.f.items()})
    return Counts(counts.shards, {k: v for k, v in flows.items() if v})


def _annealed(
    inst: Instance,
    clustered: dict[int, tuple[tuple[float, float], list[ShardPlacement]]],
    effort: float,
    wall: float,
) -> Counts | None:
    """The fastest of the clustered starts after annealing their block positions
    (`time_anneal`), as counts with the best flows; None if none survives.

    `effort` (seconds of counted work, the same on every machine) is split evenly over the
    block lengths; `wall` caps the clock for all of them (a safety net).
    """
    deadline = time.perf_counter() + wall
    best: tuple[float, Counts] | None = None
    for n in sorted(clustered, key=lambda n: clustered[n][0]):
        left = deadline - time.perf_counter()
        if left <= 0.05:
            break
        start = clustered[n][1]
        result = anneal_blocks(inst, n, start, effort / len(clustered), seed=n, wall=left)
        if result is None:
            continue
        counts = complete_flows(inst, Counts(counts_of(inst, result.shards).shards))
        counts = balanced_flows(inst, counts) or counts
        value = evaluate_shards(inst, realize(inst, counts)).iteration_seconds
        if best is None or value < best[0]:
            best = (value, counts)
    return None if best is None else best[1]


def time_model(
    inst: Instance, counts: Counts, objective: Objective, bound: TimeBound | None
) -> PlacementModel:
    """Phase 2's CP-SAT model with iteration time, around `counts`: for the time objective
    or up to `FULL_TIME_MODEL_SITES` sites the shards move freely; otherwise (bytes on many
    sites) the counts stay and only the flows between sites are chosen. With `bound`,
    CP-SAT may stop at a placement that meets it."""
    arcs = {k for k in counts.flows if k[1] != k[2]}
    full = len(inst.sites) <= FULL_TIME_MODEL_SITES or objective is Objective.ITERATION_TIME
    timed = PlacementModel(inst, with_time=True, extra_arcs=arcs, fixed=None if full else counts)
    if bound is not None and timed.time_ps is not None:
        # CP-SAT may stop when a placement meets the bound (less the model's rounding).
        floor_ps = math.floor(bound.seconds * PS * (1 - TIME_MODEL_TOLERANCE))
        timed.m.add(timed.time_ps >= floor_ps)
    return timed


def solve_instance(inst: Instance, objective: Objective, settings: SolverSettings) -> Solved:
    """Place one instance (all its candidate sites joined by the WAN)."""
    start = time.perf_counter()
    # Keep a slice of the budget for mapping the result to GPUs and pricing it.
    budget = settings.time_limit * (1 - FINISH_SHARE)

    def left() -> float:
        return max(0.05, budget - (time.perf_counter() - start))

    clustered: dict[int, tuple[tuple[float, float], list[ShardPlacement]]] = {}
    starts = _starting_points(inst, objective, spread=settings.patterns, clustered=clustered)
    seed = starts[0] if starts else None
    key = objective_key(objective)

    # The sync-level search runs for time on 9 to 64 sites; where it does, the annealer
    # gives it part of its share.
    with_levels = (
        objective is Objective.ITERATION_TIME
        and settings.patterns
        and LEVEL_MIN_SITES < len(inst.sites) <= LEVEL_MAX_SITES
    )

    # Phase 0 (time, large networks): anneal the clustered starts' block positions.
    anneals = (
        objective is Objective.ITERATION_TIME
        and settings.patterns
        and FULL_TIME_MODEL_SITES < len(inst.sites) <= ANNEAL_MAX_SITES
        and bool(clustered)
    )
    # Beyond the sync-level search's sites the annealer takes its whole share and the
    # CP-SAT time model is not built: at 128 sites its build alone took 2.7–3.2 s and it
    # was left 0.04 s to search, with a 10 s budget and with 30 s alike (four networks,
    # 2026-11-29), so it only pushed the solve past its budget.
    annealed_only = anneals and len(inst.sites) > LEVEL_MAX_SITES
    time_bound: TimeBound | None = None
    if annealed_only:
        # The bound before the annealer (2–4.5 s at 128 sites), so that the annealer's
        # clock net is what the budget has left after it.
        time_bound = iteration_time_bound(inst)
    if anneals:
        anneal_share = ANNEAL_SHARE_WITH_LEVELS if with_levels else ANNEAL_SHARE
        share = settings.time_limit * (1 - FINISH_SHARE) * anneal_share
        annealed = _annealed(inst, clustered, share, min(2 * share, left()))
        if annealed is not None and (
            seed is None
            or key(evaluate_shards(inst, realize(inst, annealed)))
            < key(evaluate_shards(inst, realize(inst, seed)))
        ):
            seed = annealed

    # Phase 0 (time, 9 to 64 sites): placements at chosen sync levels, faster than the
    # start. The bound comes first: no target below it is tried.
    if with_levels and seed is not None:
        time_bound = iteration_time_bound(inst)
        share = settings.time_limit * (1 - FINISH_SHARE) * LEVEL_SHARE
        levels = level_search(
            inst,
            seed,
            share,
            # The later phases keep a fifth of what is left, should the clock run slow.
            min(2 * share, 0.8 * left()),
            floor=time_bound.seconds,
            sync_floor=time_bound.shared_sync,
            seed=settings.seed,
        )
        if levels.counts is not None:
            seed = levels.counts

    # Phase 0 (WAN bytes): the pattern formulation's bound, cuts and plan.
    pattern: PatternResult | None = None
    if settings.patterns and objective is Objective.WAN_BYTES:
        pattern = pattern_search(inst, starts, left() * PATTERN_SHARE, settings)
        if pattern.plan is not None:
            planned = complete_flows(inst, pattern_counts(inst, pattern.plan))
            if seed is None or key(evaluate_shards(inst, realize(inst, planned))) < key(
                evaluate_shards(inst, realize(inst, seed))
            ):
                seed = planned

    # Phase 1: bytes on the compact model (exact for bytes; also the fastest way to a
    # feasible placement, which the time model then starts from).
    # For time on many sites the starts are feasible and faster than what a bytes
    # optimum would give; the budget goes to the time phase instead.
    skip_bytes = (
        objective is Objective.ITERATION_TIME
        and settings.patterns
        and seed is not None
        and len(inst.sites) > FULL_TIME_MODEL_SITES
    )
    first: Optimised | None = None
    if not skip_bytes:
        compact = PlacementModel(inst, with_time=False)
        if pattern is not None:
            for prices in pattern.cuts:
                add_cuts(compact, pattern.problem, prices)
            # CP-SAT stops as soon as a placement meets the pattern bound.
            compact.m.add(compact.wan_units >= pattern.bound // compact.bytes_unit)
        share = 0.6 if objective is Objective.WAN_BYTES else 0.25
        first = optimise(compact, Objective.WAN_BYTES, seed, settings, left() * share)
    if first is not None:
        counts = complete_flows(inst, first.counts)
        best_units: int | None = first.units
        bytes_phase: PhaseReport | None = first.report
    elif seed is not None:
        counts, best_units, bytes_phase = seed, None, None
    else:
        raise InfeasibleError(
            f"no placement of {inst.dp}×{inst.pp} shards satisfies capacity and memory "
            "per stage on the sites allowed"
        )

    # Phase 2: iteration time. On small instances the full model (counts free, flows
    # between every pair of sites); on large ones, with the bytes objective, the counts
    # of phase 1 stay and only the flows between sites are chosen (a small model).
    if objective is Objective.ITERATION_TIME:
        if seed is not None and key(evaluate_shards(inst, realize(inst, seed))) < key(
            evaluate_shards(inst, realize(inst, counts))
        ):
            counts = seed  # start the time search from the faster of the two
        if settings.patterns and time_bound is None:
            time_bound = iteration_time_bound(inst)
    primary: PhaseReport | None = bytes_phase if objective is Objective.WAN_BYTES else None
    if objective is Objective.WAN_BYTES:
        cap = (Objective.WAN_BYTES, best_units) if best_units is not None else None
        timed = time_model(inst, counts, objective, time_bound)
        second = optimise(timed, Objective.ITERATION_TIME, counts, settings, left(), cap)
        if second is not None:
            counts = second.counts
    elif not annealed_only:  # with `annealed_only` the annealer's plan is final
        timed = time_model(inst, counts, objective, time_bound)
        second = optimise(timed, Objective.ITERATION_TIME, counts, settings, left() * 0.75)
        if second is not None:
            primary = second.report
            counts = second.counts
            cap_ps = (Objective.ITERATION_TIME, second.units or 0)
            third = optimise(timed, Objective.WAN_BYTES, counts, settings, left(), cap_ps)
            if third is not None:
                counts = third.counts

    shards = realize(inst, counts)
    ev = evaluate_shards(inst, shards)
    if settings.patterns and objective is Objective.ITERATION_TIME:
        # The search's flows may still pile replicas on one pair of sites: spread them.
        spread = balanced_flows(inst, counts)
        if spread is not None:
            spread_shards = realize(inst, spread)
            spread_ev = evaluate_shards(inst, spread_shards)
            if key(spread_ev) < key(ev):
                shards, ev = spread_shards, spread_ev
    if seed is not None:
        # Only when a phase ran out of time can the start be better: never return worse.
        seed_shards = realize(inst, seed)
        seed_ev = evaluate_shards(inst, seed_shards)
        if key(seed_ev) < key(ev):
            shards, ev = seed_shards, seed_ev
    proven = None
    if pattern is not None:
        proven = ProvenBound(float(pattern.bound), "pattern bound")
    elif time_bound is not None:
        proven = ProvenBound(time_bound.seconds, "time bound")
    report = _report(primary, objective, ev, time.perf_counter() - start, proven)
    return Solved(shards, ev, report)


def place_fixed(
    topology: Topology,
    job: JobSpec,
    parallel: ParallelSpec,
    reservations: Reservations,
    graph: SiteGraph,
    objective: Objective,
    settings: SolverSettings,
) -> tuple[Instance, Solved]:
    """Place a job with a fixed layout, trying each WAN component if sites are split."""
    workload = Workload(job, parallel)
    inst = build_instance(topology, workload, reservations, graph)
    comps = [c for c in graph.components() if c & set(inst.sites)]
    if len(comps) == 1:
        return inst, solve_instance(inst, objective, settings)
    key = objective_key(objective)
    best: tuple[Instance, Solved] | None = None
    reasons = []
    reports = []  # each solved component's report: a plan elsewhere could be better
    for comp in comps:
        try:
            sub = restrict(inst, set(comp))
            free = sum(len(n.free_gpus) for g in sub.groups for n in g.nodes)
            check_capacity(workload, sub.groups, sub.fits, set(comp), free)
            solved = solve_instance(sub, objective, settings)
        except InfeasibleError as exc:
            reasons.append(str(exc))
            continue
        reports.append(solved.report)
        if best is None or key(solved.evaluation) < key(best[1].evaluation):
            best = (sub, solved)
    if best is None:
        raise InfeasibleError(
            "the sites with free GPUs are split into WAN components that cannot reach each "
            f"other, and no single component fits the job ({reasons[0]})"
        )
    sub, solved = best
    report = least_of_components(solved.report, reports)
    if report is not solved.report:
        solved = Solved(solved.shards, solved.evaluation, report)
    return sub, solved


def least_of_components(chosen: SolverReport, reports: list[SolverReport]) -> SolverReport:
    """The report of a plan chosen among WAN components whose solves gave `reports`.

    The job runs in one component, so no placement beats the least of their bounds; the
    chosen one's own bound covers only its component. The least bound is said with what
    proved it: a component whose solve proved nothing (HEURISTIC, bound 0) leaves the
    gap unknown rather than 100 % "proved by" the chosen component's prover.
    """
    least = min(reports, key=lambda r: (r.bound, r.proved_by is None))  # a proof wins ties
    if least.bound >= chosen.bound:
        return chosen
    value = chosen.objective
    proved = least.proved_by is not None
    optimal = proved and value <= least.bound * (1 + 1e-12)
    return chosen.model_copy(
        update={
            "bound": least.bound,
            "status": "OPTIMAL" if optimal else "FEASIBLE",
            "gap": 0.0
            if optimal or value == 0
            else (max(0.0, (value - least.bound) / value) if proved else 1.0),
            "proved_by": least.proved_by,
        }
    )
