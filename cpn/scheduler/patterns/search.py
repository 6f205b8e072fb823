"""The pattern search: bound, branching, plans and cuts for one instance, within a budget.

1. Column generation from the heuristics' patterns gives the LP bound and the prices.
2. The integer master (residual, then full) turns the generated patterns into plans.
3. Branching on the sites per stage raises the bound, with the best plan as cutoff.

What comes out — the proven bound, the best plan, and the prices for cuts — goes to the
CP-SAT model (`solve.py`): `objective ≥ bound`, the cuts, and the better of this plan and
the heuristics as the start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from cpn.scheduler.cpsat import PlacementModel, SolverSettings, configure
from cpn.scheduler.instance import Instance
from cpn.scheduler.patterns.branching import branch_on_sites
from cpn.scheduler.patterns.classes import Pattern
from cpn.scheduler.patterns.colgen import Effort, Prices, exact_bound, generate, start_master
from cpn.scheduler.patterns.cuts import add_cuts
from cpn.scheduler.patterns.master import integer_master, shaved, whole_sites
from cpn.scheduler.patterns.problem import PatternProblem, pattern_problem, patterns_of
from cpn.scheduler.realize import Counts

#: Shares of the pattern search's budget: at most for column generation, at most for the
#: residual master, and at least for branching (the full master takes what is between).
COLUMN_SHARE = 0.35
RESIDUAL_SHARE = 0.15
TRIM_SHARE = 0.1
BRANCHING_SHARE = 0.25
#: Most patterns the full master takes with the smaller variants of every pattern.
MASTER_COLUMNS = 5000
#: Wall-clock safety factor over the deterministic budgets.
WALL_FACTOR = 2.0


def trim(
    inst: Instance,
    problem: PatternProblem,
    patterns: dict[str, Pattern],
    cuts: Sequence[Prices],
    seconds: float,
    settings: SolverSettings,
) -> tuple[dict[str, Pattern] | None, float]:
    """The best placement with every site's shards at most its pattern's (CP-SAT), and the
    effort it took (seconds)."""
    model = PlacementModel(inst, with_time=False)
    for prices in cuts:
        add_cuts(model, problem, prices)
    for (p, s), n in model.n.items():
        model.m.add(n <= patterns[s][p])
    model.m.minimize(model.wan_units)
    solver = cp_model.CpSolver()
    configure(solver, settings, seconds, seconds * WALL_FACTOR)
    solver.parameters.num_workers = 1
    status = solver.solve(model.m)
    used = solver.deterministic_time / settings.dtime_per_second
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, used
    per_site = model.counts(solver).per_site(inst)
    out = {s: tuple(per_site.get((p, s), 0) for p in range(inst.pp)) for s in inst.sites}
    return out, used


@dataclass
class PatternResult:
    problem: PatternProblem
    bound: int  # proven lower bound on WAN bytes, a multiple of `problem.unit`
    proved: bool  # `plan_bytes` (or the best start) meets the bound
    plan: dict[str, Pattern] | None  # the best placement found, a pattern per site
    plan_bytes: int | None
    cuts: list[Prices]  # prices whose per-site cuts go into the CP-SAT model
    lp_bound: int  # the bound of the LP alone (before branching)
    iterations: int
    nodes: int
    converged: bool


def pattern_search(
    inst: Instance,
    starts: Sequence[Counts],
    seconds: float,
    settings: SolverSettings,
) -> PatternResult:
    """Bound and plan `inst` in about `seconds` of effort (more if the machine is slow).

    Effort is counted deterministically (column generation's model of its own work,
    CP-SAT's deterministic time for the masters), so the result does not depend on how
    busy the machine is; the wall clock only caps each step at `WALL_FACTOR` × its share.
    """
    problem = pattern_problem(inst)
    class_of = {s: c.index for c in problem.classes for s in c.sites}
    plans = [patterns_of(inst, c) for c in starts]
    best: dict[str, Pattern] | None = None
    best_bytes: int | None = None
    for plan in plans:
        value = problem.wan_bytes(plan)
        if best_bytes is None or value < best_bytes:
            best, best_bytes = plan, value

    master = start_master(problem, ((class_of[s], a) for p in plans for s, a in p.items()))
    effort = Effort.of(seconds * COLUMN_SHARE, seconds * COLUMN_SHARE * WALL_FACTOR)
    root = generate(master, effort, stop_at=best_bytes)
    spent = effort.spent
    lp_bound = exact_bound(problem, root.best_prices) if root.best_prices is not None else 0
    support = master.solution() if root.converged else {}
    support = {k: v for k, v in support.items() if v > 1e-6}
    cuts = [p for p in (root.best_prices, root.last_prices) if p is not None]
    if cuts and cuts[0] == cuts[-1]:
        cuts = cuts[:1]

    def done() -> bool:
        return best_bytes is not None and lp_bound >= best_bytes

    def run_master(
        columns: list[list[Pattern]],
        share: float,
        start: dict[str, Pattern] | None,
        at_least: dict[tuple[int, Pattern], int] | None = None,
    ) -> None:
        nonlocal best, best_bytes, spent
        if share <= 0:
            return
        got = integer_master(
            problem,
            columns,
            lp_bound,
            start,
            share * settings.dtime_per_second,
            share * WALL_FACTOR,
            settings.seed,
            at_least,
        )
        spent += got.deterministic_time / settings.dtime_per_second
        better = got.wan_bytes is not None and (best_bytes is None or got.wan_bytes < best_bytes)
        if better and got.patterns is not None:
            best, best_bytes = got.patterns, got.wan_bytes

    columns = [[a for (ci, a) in master.columns if ci == c.index] for c in problem.classes]
    if support and not done():
        # The residual: whole LP sites kept, the LP's patterns and smaller ones for the rest.
        extra = shaved(problem, support)
        residual = [c + e for c, e in zip(columns, extra, strict=True)]
        run_master(residual, seconds * RESIDUAL_SHARE, None, whole_sites(support))
    if support and not done():
        # Over-covering, then trimmed to dp on the site-level model (dense sync's friend).
        over = integer_master(
            problem,
            columns,
            lp_bound,
            None,
            seconds * RESIDUAL_SHARE * settings.dtime_per_second,
            seconds * RESIDUAL_SHARE * WALL_FACTOR,
            settings.seed,
            over=True,
        )
        spent += over.deterministic_time / settings.dtime_per_second
        if over.patterns is not None:
            trimmed, used = trim(inst, problem, over.patterns, cuts, seconds * TRIM_SHARE, settings)
            spent += used
            if trimmed is not None:
                value = problem.wan_bytes(trimmed)
                if best_bytes is None or value < best_bytes:
                    best, best_bytes = trimmed, value
    if not done():
        # Every pattern, and each a shard or two smaller: integer plans need the slack.
        extra = shaved(problem, dict.fromkeys(master.columns, 1.0))
        if sum(map(len, columns)) + sum(map(len, extra)) > MASTER_COLUMNS:
            extra = [[] for _ in columns]
        full = [c + e for c, e in zip(columns, extra, strict=True)]
        run_master(full, seconds * (1 - BRANCHING_SHARE) - spent, best)

    bound, nodes, proved = lp_bound, 1, done()
    if root.converged and not proved:
        left = max(seconds * BRANCHING_SHARE, seconds - spent)
        branching = branch_on_sites(master, root, best_bytes, Effort.of(left, left * WALL_FACTOR))
        nodes = branching.nodes
        bound, proved = max(lp_bound, branching.bound), branching.proved
    if best_bytes is not None and bound >= best_bytes:
        bound, proved = best_bytes, True
    return PatternResult(
        problem=problem,
        bound=bound,
        proved=proved,
        plan=best,
        plan_bytes=best_bytes,
        cuts=cuts,
        lp_bound=lp_bound,
        iterations=root.iterations,
        nodes=nodes,
        converged=root.converged,
    )
