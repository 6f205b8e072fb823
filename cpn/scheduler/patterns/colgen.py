"""Column generation (Dantzig–Wolfe) over per-site patterns.

Master LP, over the patterns generated so far (λ[c, a]: sites of class c using pattern a):

    min   −B·Σ v(a)·λ[c, a]  +  Σ_p z_p                    (+ the constant B·(pp − 1)·dp)
    s.t.  Σ a_p·λ[c, a] = dp               for every stage p        (duals π_p)
          Σ [a_p ≥ 1]·λ[c, a] − k_p = 0    for every stage p        (duals μ_p)
          z_p ≥ every secant of c_p at integer k, lo_p ≤ k_p ≤ hi_p
          Σ_a λ[c, a] = |c|                for every class c (the empty pattern included)

with v(a) = Σ min(a_p, a_{p+1}) the replicas that stay in the site. GLOP solves it; the
duals (π, μ) price new patterns (`pricing.best_pattern`, exact, once per class), and every
iteration's prices give a proven bound (`bound.lagrangian`), so the loop can stop at any
time. Artificial columns (big cost) keep the LP feasible before any pattern set covers
the stages; they are not part of the bound, so they cannot make it invalid.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ortools.linear_solver import pywraplp

from cpn.scheduler.patterns.bound import Prices, lagrangian
from cpn.scheduler.patterns.classes import Pattern, stays
from cpn.scheduler.patterns.effort import LP_ENTRY_S, Effort, pricing_effort
from cpn.scheduler.patterns.problem import PatternProblem

#: A pattern enters the LP when its reduced cost is below −this (LP units, B = 1).
ENTER_TOLERANCE = 1e-7
#: LP values closer than this to an integer count as integral.
INTEGRAL = 1e-6


class MasterLP:
    """The restricted master LP in GLOP, in units of `scale` bytes (values near 1)."""

    def __init__(self, problem: PatternProblem) -> None:
        self.problem = problem
        pp, dp = problem.pp, problem.dp
        self.scale = float(problem.boundary or max(max(t) for t in problem.sync) or 1)
        lp = pywraplp.Solver.CreateSolver("GLOP")
        assert lp is not None
        # GLOP's presolve answered ABNORMAL on re-solves after rows were added (the lazy
        # secants); the LP is small and better solved as it is.
        lp.SetSolverSpecificParametersAsString("use_preprocessing: false")
        self.lp = lp
        inf = lp.infinity()
        self.objective = lp.Objective()
        self.cover = [lp.Constraint(dp, dp, f"cover{p}") for p in range(pp)]
        self.link = [lp.Constraint(0, 0, f"link{p}") for p in range(pp)]
        self.convex = [lp.Constraint(c.size, c.size, f"class{c.index}") for c in problem.classes]
        self.k: list[pywraplp.Variable] = []
        self.z: list[pywraplp.Variable] = []
        self.tables = [[v / self.scale for v in t] for t in problem.sync]
        self.secants: set[tuple[int, int]] = set()
        # Data-parallel cost: z_p above the secants of c_p (exact at integer k). There are
        # up to dp of them per stage; they enter when the LP's k needs them (`solve`).
        for p in range(pp):
            k = lp.NumVar(problem.kmin[p], problem.kmax[p], f"k{p}")
            self.link[p].SetCoefficient(k, -1)
            self.k.append(k)
            z = lp.NumVar(0, inf, f"z{p}")
            self.objective.SetCoefficient(z, 1.0)
            self.z.append(z)
            self._secant(p, problem.kmin[p])
            self._secant(p, problem.kmax[p] - 1)
        # Artificial columns: any coverage and any k, at a cost far above what a shard
        # can save, so that the LP is feasible before the patterns are.
        most = problem.boundary * pp + max(max(t) for t in problem.sync) + 1
        big = 4.0 * most / self.scale + 4.0
        for row in (*self.cover, *self.link):
            for sign in (1, -1):
                art = lp.NumVar(0, inf, f"art_{row.name()}{'+' if sign > 0 else '-'}")
                row.SetCoefficient(art, sign)
                self.objective.SetCoefficient(art, big)
        self.objective.SetMinimization()
        self.columns: dict[tuple[int, Pattern], pywraplp.Variable] = {}
        for cls in problem.classes:
            self.add(cls.index, (0,) * pp)

    def add(self, ci: int, pattern: Pattern) -> bool:
        """Add a column; False if it is already there."""
        if (ci, pattern) in self.columns:
            return False
        var = self.lp.NumVar(0, self.lp.infinity(), "")
        value = -self.problem.boundary * stays(pattern) / self.scale
        self.objective.SetCoefficient(var, value)
        for p, a in enumerate(pattern):
            if a:
                self.cover[p].SetCoefficient(var, a)
                self.link[p].SetCoefficient(var, 1)
        self.convex[ci].SetCoefficient(var, 1)
        self.columns[(ci, pattern)] = var
        return True

    def set_k_bounds(self, lo: Sequence[int], hi: Sequence[int]) -> None:
        for var, a, b in zip(self.k, lo, hi, strict=True):
            var.SetBounds(a, b)

    def _secant(self, p: int, j: int) -> None:
        """z_p ≥ c_p(j) + (c_p(j + 1) − c_p(j))·(k_p − j), within [kmin, kmax − 1]."""
        j = max(self.problem.kmin[p], min(j, self.problem.kmax[p] - 1))
        if (p, j) in self.secants:
            return
        self.secants.add((p, j))
        table = self.tables[p]
        slope = table[j + 1] - table[j] if j + 1 < len(table) else 0.0
        row = self.lp.Constraint(table[j] - slope * j, self.lp.infinity())
        row.SetCoefficient(self.z[p], 1.0)
        row.SetCoefficient(self.k[p], -slope)

    def _missing_secants(self) -> bool:
        """Add the secant under each k_p where z_p is below c_p's interpolation."""
        # Read the whole solution before the first row changes the model.
        values = [
            (k.solution_value(), z.solution_value()) for k, z in zip(self.k, self.z, strict=True)
        ]
        missing = []
        for p, (k, z) in enumerate(values):
            j = min(math.floor(k + INTEGRAL), self.problem.kmax[p] - 1)
            j = max(j, self.problem.kmin[p])
            table = self.tables[p]
            if j + 1 < len(table):
                want = table[j] + (table[j + 1] - table[j]) * (k - j)
            else:
                want = table[j]
            if z < want - 1e-9 * (1 + abs(want)) and (p, j) not in self.secants:
                missing.append((p, j))
        for p, j in missing:
            self._secant(p, j)
        return bool(missing)

    def solve(self, effort: Effort | None = None) -> bool:
        while True:
            if effort is not None:
                effort.spend(LP_ENTRY_S * (self.lp.NumConstraints() + self.lp.NumVariables()))
            if self.lp.Solve() != pywraplp.Solver.OPTIMAL:
                return False
            if not self._missing_secants():
                return True

    def prices(self) -> tuple[Prices, list[float]]:
        """(π, μ) in bytes and the classes' duals σ in LP units; read before any change."""
        prices = Prices(
            tuple(c.dual_value() * self.scale for c in self.cover),
            tuple(c.dual_value() * self.scale for c in self.link),
        )
        return prices, [row.dual_value() for row in self.convex]

    def solution(self) -> dict[tuple[int, Pattern], float]:
        return {key: v.solution_value() for key, v in self.columns.items()}

    def sites_per_stage(self) -> list[float]:
        return [float(v.solution_value()) for v in self.k]


@dataclass
class Generated:
    """What one run of column generation (at one set of k bounds) found."""

    converged: bool = False  # no pattern priced out: `best` is the LP optimum
    best: float = -math.inf  # the largest Lagrangian seen (bytes): a bound for these bounds
    best_prices: Prices | None = None
    last_prices: Prices | None = None
    iterations: int = 0
    history: list[float] = field(default_factory=list)


def generate(
    master: MasterLP,
    effort: Effort,
    lo: Sequence[int] | None = None,
    hi: Sequence[int] | None = None,
    stop_at: float | None = None,
) -> Generated:
    """Price and add columns until none enters, the effort runs out, or L ≥ `stop_at`."""
    problem = master.problem
    lo = problem.kmin if lo is None else lo
    hi = problem.kmax if hi is None else hi
    master.set_k_bounds(lo, hi)
    pricing = sum(pricing_effort(cls) for cls in problem.classes)
    out = Generated()
    while True:
        out.iterations += 1
        if not master.solve(effort):
            return out
        prices, sigma = master.prices()
        out.last_prices = prices
        value, priced = lagrangian(problem, prices, lo, hi)
        effort.spend(pricing)
        out.history.append(value)
        if value > out.best:
            out.best, out.best_prices = value, prices
        if stop_at is not None and value >= stop_at:
            return out
        entering = [
            (cls.index, pr.pattern)
            for cls, pr in zip(problem.classes, priced, strict=True)
            if -float(pr.value) / master.scale - sigma[cls.index] < -ENTER_TOLERANCE
            and (cls.index, pr.pattern) not in master.columns
        ]
        if not entering:
            out.converged = True
            return out
        # Out of effort: return with the LP as solved (its solution still readable).
        if not effort.left:
            return out
        for ci, pattern in entering:
            master.add(ci, pattern)


def start_master(problem: PatternProblem, initial: Iterable[tuple[int, Pattern]]) -> MasterLP:
    """The master LP with the empty pattern of every class and the `initial` columns."""
    master = MasterLP(problem)
    for ci, pattern in initial:
        master.add(ci, pattern)
    return master
