"""The integer master: choose one generated pattern per site with CP-SAT.

Over the patterns column generation produced (plus the heuristics' and the empty one),
w[c, a] counts the sites of class c that use pattern a:

    min   B·(pp − 1)·dp − B·Σ v(a)·w[c, a] + Σ_p c_p(k_p)
    s.t.  Σ_a w[c, a] = |c|,   Σ a_p·w[c, a] = dp,   k_p = Σ [a_p ≥ 1]·w[c, a]

with c_p written as the maximum of its secants (exact at integer k, since it is convex).
This is the restricted master of the column generation solved in integers ("price and
branch"): its plans are true placements (every pattern is checked with `SiteClass.holds`)
and the model is small — a variable per pattern, not per site and stage. The pattern bound
goes in as `objective ≥ bound`, so a plan that meets it ends the search at once.

Three variants are tried, cheapest first:
  - *residual*: the sites the LP already uses whole (λ ≥ 1 on a non-empty pattern) keep
    those patterns, and the rest of the sites cover what is left, with the LP's patterns
    and the ones a shard or two smaller added (exact coverage is what integer solutions
    lack; smaller patterns give them the slack) — the classic residual rounding;
  - *over-covering*: every stage covered at least dp times, each extra shard charged the
    stay it will likely cost, then trimmed back to dp by CP-SAT on the site-level model
    restricted to the chosen patterns (`search.trim`): exact coverage is the hard part of
    the master when gradients are dense, and this leaves it to a small exact model;
  - *full*: every generated pattern free, hinted with the best placement so far.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from cpn.scheduler.patterns.classes import Pattern, stays
from cpn.scheduler.patterns.problem import PatternProblem, assign

#: Shards taken off one stage of an LP pattern to make the residual's smaller patterns.
SHAVE = (1, 2)


@dataclass(frozen=True)
class MasterPlan:
    patterns: dict[str, Pattern] | None  # None: no plan found in the time given
    wan_bytes: int | None
    status: str
    deterministic_time: float  # CP-SAT's measure of the work it did


def shaved(
    problem: PatternProblem, support: Mapping[tuple[int, Pattern], float]
) -> list[list[Pattern]]:
    """Per class: the LP's patterns with one stage reduced by each of `SHAVE` shards."""
    out: list[list[Pattern]] = [[] for _ in problem.classes]
    for (ci, a), _ in sorted(support.items()):
        for p in range(problem.pp):
            for d in SHAVE:
                if a[p] >= d:
                    smaller = (*a[:p], a[p] - d, *a[p + 1 :])
                    if smaller not in out[ci]:
                        out[ci].append(smaller)
    return out


def whole_sites(support: Mapping[tuple[int, Pattern], float]) -> dict[tuple[int, Pattern], int]:
    """The non-empty patterns the LP gives whole sites to: the residual keeps them."""
    return {
        key: math.floor(v + 1e-6) for key, v in support.items() if v >= 1 - 1e-6 and any(key[1])
    }


def integer_master(
    problem: PatternProblem,
    columns: Sequence[Sequence[Pattern]],
    bound: int,
    start: Mapping[str, Pattern] | None,
    deterministic_seconds: float,
    wall_seconds: float,
    seed: int = 0,
    at_least: Mapping[tuple[int, Pattern], int] | None = None,
    over: bool = False,
) -> MasterPlan:
    """The best placement made of `columns` (per class), if one was found in time.

    `at_least`: (class, pattern) → sites that must use it (the residual variant).
    `over`: cover every stage at least dp times instead of exactly (the over-covering
    variant); the plan then needs trimming and its `wan_bytes` is None.
    """
    unit = problem.unit
    pp = problem.pp
    m = cp_model.CpModel()
    use: dict[tuple[int, Pattern], cp_model.IntVar] = {}
    for cls in problem.classes:
        options = {(0,) * pp, *(a for a in columns[cls.index] if cls.holds(a))}
        if start is not None:
            options.update(start[s] for s in cls.sites)
        if at_least:
            # The LP's patterns come from the pricing's relaxation: keep those a site holds.
            options.update(a for ci, a in at_least if ci == cls.index and cls.holds(a))
        for a in sorted(options):
            lo = at_least.get((cls.index, a), 0) if at_least and cls.holds(a) else 0
            use[(cls.index, a)] = m.new_int_var(lo, cls.size, f"w{cls.index}_{a}")
        m.add(sum(v for (ci, _), v in use.items() if ci == cls.index) == cls.size)
    covered = [sum(a[p] * v for (_, a), v in use.items() if a[p]) for p in range(pp)]
    for p in range(pp):
        if over:
            m.add(covered[p] >= problem.dp)
        else:
            m.add(covered[p] == problem.dp)
    sync_units = []
    ks = []
    for p in range(pp):
        k = m.new_int_var(problem.kmin[p], problem.kmax[p], f"k{p}")
        ks.append(k)
        m.add(k == sum(v for (_, a), v in use.items() if a[p] > 0))
        table = [v // unit for v in problem.sync[p]]
        cost = m.new_int_var(0, max(table), f"c{p}")
        for j in range(problem.kmin[p], problem.kmax[p]):
            m.add(cost >= table[j] + (table[j + 1] - table[j]) * (k - j))
        m.add(cost >= table[problem.kmin[p]])
        sync_units.append(cost)
    b = problem.boundary // unit
    staying = sum(stays(a) * v for (_, a), v in use.items())
    objective = b * (pp - 1) * problem.dp - b * staying + sum(sync_units)
    if over:
        # Each shard beyond dp will be taken off again, losing up to two stays: charge one.
        objective = objective + b * sum(c - problem.dp for c in covered)
    else:
        m.add(objective >= bound // unit)
    m.minimize(objective)
    if start is not None and not at_least:
        # A complete hint (CP-SAT took none of a partial one on the larger models).
        for (ci, a), v in use.items():
            m.add_hint(v, sum(1 for s in problem.classes[ci].sites if start[s] == a))
        for p, (k, cost) in enumerate(zip(ks, sync_units, strict=True)):
            used = sum(1 for a in start.values() if a[p] > 0)
            m.add_hint(k, used)
            m.add_hint(cost, problem.sync[p][used] // unit)
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.num_workers = 1
    prm.random_seed = seed
    prm.max_deterministic_time = max(0.01, deterministic_seconds)
    prm.max_time_in_seconds = max(0.05, wall_seconds)
    prm.linearization_level = 2
    # The model is already as small as it gets; CP-SAT's presolve took the whole budget
    # on a few thousand patterns (and then never tried the hint), so it is off.
    prm.cp_model_presolve = False
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return MasterPlan(None, None, solver.status_name(status), solver.deterministic_time)
    per_class: dict[int, list[Pattern]] = {}
    for (ci, a), v in use.items():
        per_class.setdefault(ci, []).extend([a] * solver.value(v))
    patterns = assign(problem, per_class)
    if over:
        return MasterPlan(patterns, None, solver.status_name(status), solver.deterministic_time)
    # The objective is the cost model's at the optimum; a feasible solution may leave slack
    # in a cost variable above its secants, so the plan's bytes are recomputed.
    wan = problem.wan_bytes(patterns)
    assert wan <= round(solver.objective_value) * unit
    return MasterPlan(patterns, wan, solver.status_name(status), solver.deterministic_time)
