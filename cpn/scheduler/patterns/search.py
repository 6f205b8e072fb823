"""The pattern search: bound, branching, plans and cuts for one instance, within a budget.

1. Column generation from the heuristics' patterns gives the LP bound and the prices.
2. Integer masters turn the generated patterns into plans: the residual of the LP, and the
   over-covering one trimmed by CP-SAT.
3. Branching on the sites per stage raises the bound, with the best plan as cutoff; the
   residual of its most promising node's LP is tried next.
4. What effort is left goes to the full master, started from the best plan.

What comes out — the proven bound, the best plan, and the prices for cuts — goes to the
CP-SAT model (`solve.py`): `objective ≥ bound`, the cuts, and the better of this plan and
the heuristics as the start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from cpn.scheduler.cpsat import PlacementModel, SolverSettings, configure, new_solver
from cpn.scheduler.instance import Instance
from cpn.scheduler.patterns.bound import Prices, exact_bound
from cpn.scheduler.patterns.branching import branch_on_sites
from cpn.scheduler.patterns.classes import Pattern
from cpn.scheduler.patterns.colgen import generate, start_master
from cpn.scheduler.patterns.cuts import add_cuts
from cpn.scheduler.patterns.effort import Effort
from cpn.scheduler.patterns.master import integer_master, shaved, whole_sites
from cpn.scheduler.patterns.problem import PatternProblem, pattern_problem, patterns_of
from cpn.scheduler.realize import Counts

#: Shares of the pattern search's budget (each step takes at most its share, or what is
#: left): column generation (at the root, and again at the best node), each integer master,
#: the trimming of the over-covering master's plan, and branching.
COLUMN_SHARE = 0.2
MASTER_SHARE = 0.1
TRIM_SHARE = 0.05
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
    solver = new_solver()
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
    spent = 0.0

    def offer(plan: dict[str, Pattern] | None) -> None:
        nonlocal best, best_bytes
        if plan is not None:
            value = problem.wan_bytes(plan)
            if best_bytes is None or value < best_bytes:
                best, best_bytes = plan, value

    for plan in plans:
        offer(plan)

    def share(fraction: float) -> float:
        """Effort for a step: its fraction of the budget, or what is left if less."""
        return max(0.0, min(seconds * fraction, seconds - spent))

    master = start_master(problem, ((class_of[s], a) for p in plans for s, a in p.items()))
    effort = Effort.of(share(COLUMN_SHARE), share(COLUMN_SHARE) * WALL_FACTOR)
    root = generate(master, effort, stop_at=best_bytes)
    spent += effort.spent
    bound = exact_bound(problem, root.best_prices) if root.best_prices is not None else 0
    lp_bound = bound
    cuts = [p for p in (root.best_prices, root.last_prices) if p is not None]
    if cuts and cuts[0] == cuts[-1]:
        cuts = cuts[:1]

    def done() -> bool:
        return best_bytes is not None and bound >= best_bytes

    def lp_support() -> dict[tuple[int, Pattern], float]:
        """The LP's current solution (read before anything changes the LP)."""
        return {k: v for k, v in master.solution().items() if v > 1e-6}

    def residual(support: dict[tuple[int, Pattern], float], effort_s: float) -> None:
        """The residual master on an LP solution (see master.py)."""
        nonlocal spent
        if not support or effort_s <= 0 or done():
            return
        columns = [[a for (ci, a) in master.columns if ci == c.index] for c in problem.classes]
        extra = shaved(problem, support)
        got = integer_master(
            problem,
            [c + e for c, e in zip(columns, extra, strict=True)],
            bound,
            None,
            effort_s * settings.dtime_per_second,
            effort_s * WALL_FACTOR,
            settings.seed,
            at_least=whole_sites(support),
        )
        spent += got.deterministic_time / settings.dtime_per_second
        offer(got.patterns)

    nodes = 1
    if root.converged:
        residual(lp_support(), share(MASTER_SHARE))
        if not done():
            # Over-covering, then trimmed to dp on the site-level model.
            columns = [[a for (ci, a) in master.columns if ci == c.index] for c in problem.classes]
            budget = share(MASTER_SHARE)
            over = integer_master(
                problem,
                columns,
                bound,
                None,
                budget * settings.dtime_per_second,
                budget * WALL_FACTOR,
                settings.seed,
                over=True,
            )
            spent += over.deterministic_time / settings.dtime_per_second
            if over.patterns is not None:
                trimmed, used = trim(
                    inst, problem, over.patterns, cuts, share(TRIM_SHARE), settings
                )
                spent += used
                offer(trimmed)
        if not done():
            budget = share(BRANCHING_SHARE)
            branch_effort = Effort.of(budget, budget * WALL_FACTOR)
            branching = branch_on_sites(master, root, best_bytes, branch_effort)
            spent += branch_effort.spent
            nodes = branching.nodes
            bound = max(bound, branching.bound)
            if branching.best_lo is not None and branching.best_hi is not None and not done():
                # The most promising node's LP: its residual often rounds where the root's
                # did not (its k are integral or nearly so).
                node_effort = Effort.of(share(COLUMN_SHARE), share(COLUMN_SHARE) * WALL_FACTOR)
                generate(master, node_effort, branching.best_lo, branching.best_hi)
                spent += node_effort.spent
                support = lp_support()
                master.set_k_bounds(problem.kmin, problem.kmax)
                residual(support, share(MASTER_SHARE))
    if not done() and best is not None:
        # What is left: every pattern, and each a shard or two smaller, from the best plan.
        columns = [[a for (ci, a) in master.columns if ci == c.index] for c in problem.classes]
        extra = shaved(problem, dict.fromkeys(master.columns, 1.0))
        if sum(map(len, columns)) + sum(map(len, extra)) > MASTER_COLUMNS:
            extra = [[] for _ in columns]
        budget = share(1.0)
        if budget > 0:
            got = integer_master(
                problem,
                [c + e for c, e in zip(columns, extra, strict=True)],
                bound,
                best,
                budget * settings.dtime_per_second,
                budget * WALL_FACTOR,
                settings.seed,
            )
            spent += got.deterministic_time / settings.dtime_per_second
            offer(got.patterns)
    proved = done()
    if best_bytes is not None and proved:
        bound = best_bytes
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
