"""Column generation (Dantzig–Wolfe) over per-site patterns: a bound valid at every step.

Master LP, over the patterns generated so far (λ[c, a]: sites of class c using pattern a):

    min   −B·Σ v(a)·λ[c, a]  +  Σ_p z_p                    (+ the constant B·(pp − 1)·dp)
    s.t.  Σ a_p·λ[c, a] = dp               for every stage p        (duals π_p)
          Σ [a_p ≥ 1]·λ[c, a] − k_p = 0    for every stage p        (duals μ_p)
          z_p ≥ every secant of c_p at integer k, lo_p ≤ k_p ≤ hi_p
          Σ_a λ[c, a] = |c|                for every class c (the empty pattern included)

with v(a) = Σ min(a_p, a_{p+1}) the replicas that stay in the site. GLOP solves it; the
duals (π, μ) price new patterns (`pricing.best_pattern`, exact, once per class).

The bound does not wait for the LP to converge: for *any* prices (π, μ), relaxing the
coverage and k rows gives the Lagrangian

    L(π, μ) = B·(pp − 1)·dp + Σ_p π_p·dp − Σ_c |c|·max_a [B·v(a) + π·a + μ·[a ≥ 1]]
              + Σ_p min_{lo_p ≤ k ≤ hi_p, k integer} (c_p(k) + μ_p·k)

which is at most the WAN bytes of every placement with lo ≤ k ≤ hi (each site's pattern is
one of the maximised-over ones, and c_p is exact at the integer k). The maxima are exact
(the programme), so every iteration's L is a proven bound, and a time cap is safe. At the
LP optimum L equals the LP value. Artificial columns (big cost) keep the LP feasible before
any pattern set covers the stages; they do not enter L, so they cannot make it invalid.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ortools.linear_solver import pywraplp

from cpn.scheduler.patterns.classes import Pattern, SiteClass, stays
from cpn.scheduler.patterns.pricing import Priced, best_pattern
from cpn.scheduler.patterns.problem import PatternProblem

#: A pattern enters the LP when its reduced cost is below −this (LP units, B = 1).
ENTER_TOLERANCE = 1e-7
#: Relative safety margin taken off the floating-point Lagrangian before rounding it up to
#: a multiple of the objective's unit (its terms are exact; only the sums are rounded).
FLOAT_MARGIN = 1e-9
#: LP values closer than this to an integer count as integral.
INTEGRAL = 1e-6


#: Effort of the work below in seconds of one quiet core of the development machine,
#: fitted on the benchmark instances: a pricing call, per cell of its programme, and an LP
#: solve per row and column. Counting effort instead of reading the clock keeps the
#: column generation's result the same on a busy machine (the clock is only a safety net).
PRICING_CALL_S = 2e-4
PRICING_CELL_S = 2e-8
LP_ENTRY_S = 2e-6


@dataclass
class Effort:
    """A budget of deterministic effort, with a wall-clock deadline as a safety net."""

    limit: float  # effort seconds
    deadline: float  # time.perf_counter() value
    spent: float = 0.0

    @classmethod
    def of(cls, seconds: float, wall_seconds: float) -> Effort:
        return cls(seconds, time.perf_counter() + wall_seconds)

    def spend(self, seconds: float) -> None:
        self.spent += seconds

    @property
    def left(self) -> bool:
        return self.spent < self.limit and time.perf_counter() < self.deadline


def pricing_effort(cls: SiteClass) -> float:
    total = min(cls.slots, sum(cls.caps))
    top = min(max(cls.caps, default=0), total)
    width = total + 1 if cls.slots < sum(cls.caps) else 1
    return PRICING_CALL_S + PRICING_CELL_S * len(cls.caps) * (top + 1) * width


@dataclass(frozen=True)
class Prices:
    """Dual prices in bytes: per shard of stage p, and per site holding stage p."""

    shard: tuple[float, ...]
    use: tuple[float, ...]


def lagrangian(
    problem: PatternProblem,
    prices: Prices,
    lo: Sequence[int] | None = None,
    hi: Sequence[int] | None = None,
) -> tuple[float, list[Priced]]:
    """L(π, μ) in bytes for sites per stage in [lo, hi], and each class's best pattern."""
    lo = problem.kmin if lo is None else lo
    hi = problem.kmax if hi is None else hi
    priced = [
        best_pattern(cls, problem.boundary, prices.shard, prices.use) for cls in problem.classes
    ]
    value = float(problem.crossing_all)
    value += sum(pi * problem.dp for pi in prices.shard)
    value -= sum(
        cls.size * max(0.0, float(pr.value))
        for cls, pr in zip(problem.classes, priced, strict=True)
    )
    for p in range(problem.pp):
        table, mu = problem.sync[p], prices.use[p]
        value += min(table[k] + mu * k for k in range(lo[p], hi[p] + 1))
    return value, priced


def round_bound(problem: PatternProblem, value: float) -> int:
    """The least multiple of the unit ≥ `value` less a float safety margin; never < 0.

    For decisions only (stopping, pruning); the bounds reported come from `exact_bound`.
    """
    safe = value - FLOAT_MARGIN * (abs(value) + problem.crossing_all + 1)
    return max(0, math.ceil(safe / problem.unit) * problem.unit)


@dataclass(frozen=True)
class IntegerPrices:
    """Prices scaled to integers: the true prices are these ÷ `scale`, in units of `unit`."""

    scale: int
    stay: int
    shard: tuple[int, ...]
    use: tuple[int, ...]


def integer_prices(problem: PatternProblem, prices: Prices, bits: int) -> IntegerPrices:
    """(B, π, μ) in objective units × 2^s, rounded, with the largest about 2^bits.

    Any prices give a valid Lagrangian and valid cuts, so rounding them costs at most a
    sliver of strength, never validity; the integer programme then evaluates them exactly.
    """
    unit = problem.unit
    top = max((min(c.slots, sum(c.caps)) for c in problem.classes), default=1)
    size = (problem.boundary / unit + max(map(abs, prices.shard), default=0.0) / unit) * max(
        top, 1
    ) * problem.pp + sum(abs(v) for v in prices.use) / unit
    shift = max(0, min(40, bits - math.ceil(math.log2(size + 1))))
    scale = 1 << shift
    return IntegerPrices(
        scale,
        problem.boundary // unit * scale,
        tuple(round(v / unit * scale) for v in prices.shard),
        tuple(round(v / unit * scale) for v in prices.use),
    )


def exact_bound(
    problem: PatternProblem,
    prices: Prices,
    lo: Sequence[int] | None = None,
    hi: Sequence[int] | None = None,
) -> int:
    """A proven lower bound in bytes (a multiple of the unit), computed in integers.

    The Lagrangian of the prices rounded by `integer_prices`, with the exact integer
    programme for each class and Python integers for the sum: no floating point between
    the prices and the bound, so the rounding up to the objective's unit is exact.
    """
    lo = problem.kmin if lo is None else lo
    hi = problem.kmax if hi is None else hi
    q = integer_prices(problem, prices, bits=58)
    unit = problem.unit
    total = problem.crossing_all // unit * q.scale + sum(v * problem.dp for v in q.shard)
    for cls in problem.classes:
        best = int(best_pattern(cls, q.stay, q.shard, q.use).value)
        total -= cls.size * max(0, best)
    for p in range(problem.pp):
        table = problem.sync[p]
        total += min(table[k] // unit * q.scale + q.use[p] * k for k in range(lo[p], hi[p] + 1))
    units = -(-total // q.scale)  # ceil, exact
    return max(0, units) * unit


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
        self.artificials = []
        for row in (*self.cover, *self.link):
            for sign in (1, -1):
                art = lp.NumVar(0, inf, f"art_{row.name()}{'+' if sign > 0 else '-'}")
                row.SetCoefficient(art, sign)
                self.objective.SetCoefficient(art, big)
                self.artificials.append(art)
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

    def value(self) -> float:
        """The LP's objective in bytes, constant included."""
        return float(self.objective.Value()) * self.scale + self.problem.crossing_all

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

    def artificial(self) -> float:
        return float(sum(v.solution_value() for v in self.artificials))


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
