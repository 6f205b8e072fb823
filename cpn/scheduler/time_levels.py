"""Plans for iteration time at chosen sync levels: the decision model, searched locally.

The other searches for time keep each block of stages on sites of its own with whole
blocks per site (`heuristics.cluster_blocks`, `time_anneal`) or move shards one at a time
(the CP-SAT time model, which at 64 sites never improved those starts). The fastest
placements measured on the bench networks are of another kind: every stage on its own
set of sites, just tight enough for a sync level well below the starts', the sets
overlapping so that most replicas stay in their site and the rest cross on fast pairs.
`time_decision.decision_model` describes exactly those — at a sync level `d` and a target
`B`, stages whose sites are pairwise close enough for `d` and boundaries that fit `(B −
d)/(m + pp − 1)` — and CP-SAT's feasibility-jump local search (`use_ls_only`, one worker,
so a run is deterministic) finds its solutions in a second or two where its tree search
found none in 30 s (measured on the 64-site heterogeneous top-k instance, 2026-11-29).

A solution's shards per site become a placement (node groups by
`patterns.problem.counts_of`, the fastest flows by `time_flows.balanced_flows`) that the
cost model times; the model relaxes the slot (compute at its floor, a pair's cheaper
direction), so a plan is kept only when the cost model finds it faster than the best so
far. Local search cannot prove a target out of reach: an attempt that finds nothing costs
its whole cap, so the targets step down by `STEP` and a level that fails is dropped. The
local search starts from the start placement (`start_hint`) and, once a level gave a
solution, from that solution: near a known placement it finds the next one in a fraction
of the effort (0.0–0.7 units against 0.5–3.5 for a first one on the 64-site bench).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ortools.sat.python import cp_model

from cpn.scheduler.instance import Instance
from cpn.scheduler.patterns.problem import counts_of
from cpn.scheduler.realize import Counts, evaluate_shards, realize
from cpn.scheduler.time_decision import Decision, decision_model
from cpn.scheduler.time_flows import balanced_flows

#: Sync levels tried, as fractions of the best iteration time so far, in this order. The
#: fastest plans found on the bench instances (16 and 64 sites, homogeneous and
#: heterogeneous networks, dense and top-k sync) sync in 0.45–0.9 of their time, mostly
#: 0.5–0.7, so those go first.
FRACTIONS = (0.55, 0.45, 0.65, 0.75, 0.35, 0.85)
#: Each target asks for this much less than the best time so far.
STEP = 0.03
#: Deterministic time one attempt may take: the first solutions at a level on the bench
#: instances took 0.01–14 units, most below 3.5.
ATTEMPT_DTIME = 3.5
#: What building an attempt's model, hinting it and timing its placement cost, in the same
#: units: a fixed part and a part per variable of the model (measured: 0.03 s for 400–2 000
#: variables at 16 sites, 0.19 s for 30 000 at 64), counted so that the clock, a safety
#: net, does not decide when the search stops (it did on a loaded machine: review).
ATTEMPT_OVERHEAD = 0.05
OVERHEAD_PER_VARIABLE = 2e-5
#: CP-SAT's deterministic time per second of one core for this local search (measured,
#: presolve off: 1.1–2.6 on the 16- and 64-site bench models).
DTIME_PER_SECOND = 1.6


@dataclass(frozen=True)
class Attempt:
    """One local search at a sync level and a target, and what it gave."""

    sync: float
    target: float
    status: str
    dtime: float
    #: What the budget was charged: `dtime` and the attempt's `overhead`.
    counted: float
    #: The cost model's iteration time of the placement found (None: nothing placed).
    seconds: float | None


@dataclass
class LevelSearch:
    """The fastest placement found (None: nothing faster than the start) and the log."""

    counts: Counts | None
    seconds: float
    attempts: list[Attempt]


def placement(
    inst: Instance,
    decision: Decision,
    solution: cp_model.CpSolver | cp_model.CpSolverSolutionCallback,
) -> Counts | None:
    """The solution's shards per site as counts with the fastest flows (None: the model's
    relaxation let it through but the nodes or the routes cannot carry it)."""
    patterns = {site: [0] * inst.pp for site in inst.sites}
    for (p, s), var in decision.held.items():
        patterns[inst.sites[s]][p] = solution.value(var)
    try:
        counts = counts_of(inst, patterns)
    except ValueError:  # fit sets that are not nested: Hall's condition is not enough
        return None
    return balanced_flows(inst, counts)


def overhead(model: cp_model.CpModel) -> float:
    """The counted cost of an attempt besides CP-SAT's own work (`ATTEMPT_OVERHEAD`)."""
    return ATTEMPT_OVERHEAD + OVERHEAD_PER_VARIABLE * len(model.proto.variables)


def start_hint(inst: Instance, counts: Counts) -> dict[str, int]:
    """`counts` in the decision model's variable names: where the local search starts
    until a level gives it a solution of its own (the start breaks the level's sync or
    its target, but is near placements that meet them)."""
    hint: dict[str, int] = {}
    sites_of: dict[int, int] = {}
    for (p, site), n in counts.per_site(inst).items():
        s = inst.site_index[site]
        hint[f"n{p}_{s}"] = n
        hint[f"y{p}_{s}"] = int(n > 0)
        sites_of[p] = sites_of.get(p, 0) + int(n > 0)
    for p, k in sites_of.items():
        hint[f"k{p}"] = k
    for (p, a, b), moved in counts.flows.items():
        hint[f"x{p}_{inst.site_index[a]}_{inst.site_index[b]}"] = moved
    return hint


def level_search(
    inst: Instance,
    start: Counts,
    seconds: float,
    wall: float,
    floor: float = 0.0,
    sync_floor: float = 0.0,
    seed: int = 0,
) -> LevelSearch:
    """Search the sync levels for placements faster than `start`.

    `seconds` is the budget in seconds of one core (counted as CP-SAT's deterministic
    time, so the same on every machine), `wall` a safety net on the clock. No target is
    set below `floor` (a proven bound: nothing is faster) and no level below
    `sync_floor` (no placement syncs faster).
    """
    best = evaluate_shards(inst, realize(inst, start)).iteration_seconds
    found: Counts | None = None
    budget = seconds * DTIME_PER_SECOND
    spent = 0.0
    deadline = time.perf_counter() + wall
    attempts: list[Attempt] = []
    # A level is a fraction of the best time when it is first tried. One that gave a
    # faster plan is tried again at once with a lower target, the local search starting
    # from the solution it gave (a continuation: each such step took 0.0–0.7 units on the
    # 64-site bench, a first solution at a level 0.5–3.5); one that gives nothing is dropped.
    # Without data parallelism nothing syncs: only the level 0 means anything.
    fractions = deque(FRACTIONS if inst.dp > 1 else (0.0,))
    again: float | None = None
    hint = start_hint(inst, start)
    while again is not None or fractions:
        sync = again if again is not None else fractions.popleft() * best
        again = None
        target = best * (1 - STEP)
        cap = min(ATTEMPT_DTIME, budget - spent)
        left = deadline - time.perf_counter()
        if cap <= 0.05 or left <= 0.05:
            break
        if target <= max(sync, floor) or sync < sync_floor:
            continue
        decision = decision_model(inst, sync, target, range(inst.pp))
        model = decision.model
        named = [(i, hint[v.name]) for i, v in enumerate(model.proto.variables) if v.name in hint]
        model.proto.solution_hint.vars.extend(i for i, _ in named)
        model.proto.solution_hint.values.extend(value for _, value in named)
        solver = cp_model.CpSolver()
        prm = solver.parameters
        prm.num_workers = 1
        prm.use_ls_only = True
        # Presolve took two thirds of a search that finds a placement (3.76 s of the
        # 64-site heterogeneous dense model's first level; 0.63 s without it).
        prm.cp_model_presolve = False
        prm.random_seed = seed
        prm.max_deterministic_time = cap
        prm.max_time_in_seconds = min(left, 1.0 + 4 * cap / DTIME_PER_SECOND)  # safety net
        status = solver.solve(model)
        counted = solver.deterministic_time + overhead(model)
        spent += counted
        value = None
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            counts = placement(inst, decision, solver)
            if counts is not None:
                value = evaluate_shards(inst, realize(inst, counts)).iteration_seconds
        attempts.append(
            Attempt(
                sync, target, solver.status_name(status), solver.deterministic_time, counted, value
            )
        )
        if value is not None and value < best:
            best, found = value, counts
            again = sync
            values = solver.response_proto.solution
            hint = {v.name: values[i] for i, v in enumerate(model.proto.variables) if v.name}
    return LevelSearch(found, best, attempts)
