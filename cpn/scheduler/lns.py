"""Large-neighbourhood search around CP-SAT, deterministic.

On dozens or hundreds of sites one CP-SAT worker rarely improves its starting point
within seconds: the search space is huge and the LP bound weak. CP-SAT's own LNS runs
only with parallel workers, whose results depend on thread timing. So cpn runs the
classic loop itself: keep the incumbent; pick a neighbourhood (a few sites, or a window
of stages); pin every shard count outside it to the incumbent; ask CP-SAT for a strictly
better solution of that small problem under a small deterministic-time budget; keep it
if found. Neighbourhoods come from a seeded random generator, so the same input gives
the same plan.

Neighbourhoods, chosen in turn:
  - sites: a few sites the job uses plus a few it could use (weighted by free slots), so
    shards can move between them, a site can be emptied or a new one opened;
  - thinnest: the used sites holding the fewest shards, with roomy sites to absorb them;
  - stages: every site, but only a window of consecutive stages may move.
A neighbourhood whose sub-problem is proven to have nothing better grows; one that runs
out of time shrinks.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from cpn.scheduler.cpsat import (
    Objective,
    PlacementModel,
    SolverSettings,
    configure,
    new_solver,
    rebase,
)
from cpn.scheduler.instance import Instance
from cpn.scheduler.realize import Counts

#: Deterministic-time budget of one neighbourhood solve.
STEP_DTIME = 0.05
#: Sites in a neighbourhood at first (it adapts).
INITIAL_SIZE = 6


@dataclass
class LnsResult:
    counts: Counts
    value: int  # the model's objective, in its units
    steps: int
    improvements: int


def improve(
    model: PlacementModel,
    objective: Objective,
    incumbent: Counts,
    value: int,
    settings: SolverSettings,
    seconds: float,
    wall_cap: float,
) -> LnsResult:
    """Improve `incumbent` (objective `value`) for about `seconds` of deterministic time."""
    inst = model.inst
    expr = model.objective(objective)
    rng = random.Random(settings.seed)
    dtime_budget = seconds * settings.dtime_per_second
    deadline = time.perf_counter() + wall_cap
    spent = 0.0
    size = max(2, min(INITIAL_SIZE, len(inst.sites)))
    steps = improvements = 0
    while spent < dtime_budget and time.perf_counter() < deadline:
        steps += 1
        kind = steps % 3
        free_sites, free_stages = _neighbourhood(inst, incumbent, rng, kind, size)
        sub = model.m.clone()
        for (p, g), var in model.x.items():
            if inst.groups[g].site in free_sites and p in free_stages:
                continue
            pinned = sub.get_int_var_from_proto_index(var.index)
            sub.add(pinned == incumbent.shards.get((p, g), 0))
        target = rebase(expr, sub)
        sub.add(target <= value - 1)  # strictly better, or prove there is nothing
        sub.minimize(target)
        solver = new_solver()
        step = min(STEP_DTIME, max(0.01, dtime_budget - spent)) / settings.dtime_per_second
        left = deadline - time.perf_counter()
        configure(solver, SolverSettings(seed=settings.seed + steps), step, left)
        status = solver.solve(sub)
        spent += solver.deterministic_time
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            shards = {
                key: solver.value(sub.get_int_var_from_proto_index(var.index))
                for key, var in model.x.items()
            }
            incumbent = Counts({k: v for k, v in shards.items() if v})
            value = round(solver.objective_value)
            improvements += 1
        elif status == cp_model.INFEASIBLE:
            size = min(len(inst.sites), size + 1)  # nothing better here: look wider
        else:
            size = max(2, size - 1)  # ran out of time: look narrower
    return LnsResult(incumbent, value, steps, improvements)


def _neighbourhood(
    inst: Instance, incumbent: Counts, rng: random.Random, kind: int, size: int
) -> tuple[set[str], set[int]]:
    per_site = incumbent.per_site(inst)
    load = {s: 0 for s in inst.sites}
    for (_, s), c in per_site.items():
        load[s] += c
    used = [s for s in inst.sites if load[s]]
    unused = [s for s in inst.sites if not load[s]]
    all_stages = set(range(inst.pp))
    if kind == 2 and inst.pp > 1:
        width = max(2, min(inst.pp, math.ceil(size / 2)))
        p0 = rng.randrange(0, inst.pp - width + 1)
        return set(inst.sites), set(range(p0, p0 + width))
    chosen: list[str] = []
    if kind == 1:
        thin = sorted(used, key=lambda s: (load[s], inst.site_index[s]))
        chosen += thin[: max(1, size // 2)]
    pool = [s for s in used if s not in chosen]
    rng.shuffle(pool)
    chosen += pool[: max(1, size - len(chosen) - 2)]
    roomy = [s for s in unused if inst.site_slots(s) > 0]
    if roomy:
        weights = [inst.site_slots(s) for s in roomy]
        for _ in range(min(2, len(roomy))):
            pick = rng.choices(roomy, weights=weights)[0]
            if pick not in chosen:
                chosen.append(pick)
    return set(chosen), all_stages
