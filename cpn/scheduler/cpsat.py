"""The placement model in OR-Tools CP-SAT: integer counts and pipeline flows.

Variables (never one per GPU or shard: replicas are interchangeable, and a boolean per
shard gives a model whose symmetric copies keep CP-SAT from proving any bound):

  x[p, g]      shards of stage p on node group g (≤ the group's slots)
  n[p, s]      Σ_g∈s x[p, g]: replicas of stage p at site s; Σ_s n[p, s] = dp
  y[p, s]      n[p, s] ≥ 1;  k[p] = Σ_s y[p, s]: sites stage p's gradients are synced over
  f[p, a, b]   replicas with stage p at site a and stage p+1 at site b: a transportation
               problem between n[p, ·] and n[p+1, ·]; f[p, s, s] stays in the site

WAN bytes per iteration (exact, in the cost model's units):
  boundary_bytes · Σ_p Σ_{a≠b} f[p, a, b]  +  Σ_p dp_wan_bytes(p, k[p])
dp_wan_bytes is linear in k (dense ring) or k(k−1) (sparse all-gather); both are convex,
so it is written as the maximum of its secants, which is exact at integer k and gives
the LP relaxation something to work with (an element constraint gives it nothing).

For bytes alone the destinations of crossing replicas do not matter: every pair of
connected sites can be joined, so only the diagonal flows are needed and the rest of the
transportation plan always exists. The bytes phase therefore solves that compact model;
the time phase adds the flows between sites, which decide the slowest pipeline hop.

Iteration time (the cost model's, in picoseconds):
  (m + pp − 1)·T + D,   T ≥ compute_p + boundary_p,   D ≥ in-site_p + wan_p
with compute_p ≥ the slowest group used by the stage, boundary_p ≥ the slowest hop it
uses (route latency + crossing replicas × activation bytes / bandwidth, both ways), and
wan_p ≥ steps(k)·latency + bytes per leader(k) / bandwidth for every pair of sites the
stage uses (half-reified on both sites being used).

The two objectives are solved lexicographically: the primary first, then the secondary
with the primary bounded by its best value.

Deterministic for the same input: by default one search worker with a fixed seed and a
*deterministic-time* budget (CP-SAT's machine-independent measure of work), so the same
input gives the same plan on a busy or an idle machine; wall-clock time is only a safety
net. CP-SAT's interleaved (deterministic) parallel search was measured 10–40× slower on
these models, so it is not used. `deterministic=False` runs a parallel portfolio against
the wall clock instead: often faster to a good plan, but not reproducible.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import reduce

from ortools.sat.python import cp_model
from ortools.sat.python import cp_model_helper as cmh

from cpn.errors import InfeasibleError
from cpn.scheduler.instance import Instance
from cpn.scheduler.realize import Counts

PS = 1e12  # picoseconds per second: the time unit inside the model
#: Largest time the model represents (2^55 ps ≈ 10 hours): every bound on a time variable
#: stays below it, so that sums of a few of them, times the micro-batches, fit CP-SAT's
#: 64-bit integers. A step that would take longer means a link or GPU far too slow for the
#: job, which is refused as infeasible instead of overflowing.
MAX_MODEL_PS = 2**55
#: Most (stage, site, site) flow variables the time model builds; beyond this each site
#: keeps arcs to its nearest sites only (plus the arcs a starting solution needs).
ARC_BUDGET = 20_000


class Objective(StrEnum):
    WAN_BYTES = "wan_bytes"
    ITERATION_TIME = "iteration_time"


@dataclass
class PhaseReport:
    objective: Objective
    status: str
    seconds: float
    value: float  # in the objective's unit: bytes or seconds
    bound: float


@dataclass(frozen=True)
class SolverSettings:
    time_limit: float = 10.0
    seed: int = 0
    deterministic: bool = True
    #: Search workers when not deterministic.
    workers: int = 4
    #: Deterministic time units per second of budget (calibrated on the benchmark models:
    #: one unit took about two seconds of one core here).
    dtime_per_second: float = 0.5
    #: Bound, cut and start the WAN-bytes search with the per-site pattern formulation
    #: (`cpn.scheduler.patterns`); False runs the CP-SAT search alone, as before it existed
    #: (the benchmark compares the two in one run).
    patterns: bool = True


def rebase(expr: cp_model.LinearExprT, clone: cp_model.CpModel) -> cp_model.LinearExprT:
    """The same linear expression over the variables of a clone of its model."""
    flat = cmh.FlatIntExpr(cp_model.LinearExpr.sum([expr]))
    return (
        sum(
            coef * clone.get_int_var_from_proto_index(var.index)
            for var, coef in zip(flat.vars, flat.coeffs, strict=True)
        )
        + flat.offset
    )


def bounds(var: cp_model.IntVar) -> tuple[int, int]:
    """Lower and upper bound of a variable.

    (The proto wrapper of OR-Tools 9.15 answers `domain[-1]` with 0, not the last
    element, so never index it from the end.)
    """
    dom = list(var.proto.domain)
    return dom[0], dom[-1]


def _gcd(values: Sequence[int]) -> int:
    nz = [abs(v) for v in values if v]
    return reduce(math.gcd, nz) if nz else 1


class PlacementModel:
    """CP-SAT model of one instance; `with_time` adds flows between sites and time."""

    def __init__(
        self,
        inst: Instance,
        *,
        with_time: bool,
        extra_arcs: set[tuple[int, str, str]] | None = None,
        fixed: Counts | None = None,
    ) -> None:
        """`fixed` pins the shard counts (only flows and time are left to decide)."""
        self.inst = inst
        self.with_time = with_time
        self.fixed = fixed
        w = inst.workload
        self.m = cp_model.CpModel()
        m = self.m
        dp, pp = inst.dp, inst.pp
        sites = inst.sites
        groups = inst.groups

        # -- counts -----------------------------------------------------------------------
        self.x: dict[tuple[int, int], cp_model.IntVar] = {}
        for p in range(pp):
            for g in groups:
                if not inst.fits[p][g.index]:
                    continue
                if fixed is None:
                    lo, hi = 0, min(dp, g.slots)
                else:
                    lo = hi = fixed.shards.get((p, g.index), 0)
                self.x[(p, g.index)] = m.new_int_var(lo, hi, f"x{p}_{g.index}")
        for g in groups:
            m.add(sum(self.x[(p, g.index)] for p in range(pp) if (p, g.index) in self.x) <= g.slots)

        self.cap: dict[tuple[int, str], int] = {
            (p, s): min(dp, inst.site_slots(s, p)) for p in range(pp) for s in sites
        }
        self.n: dict[tuple[int, str], cp_model.IntVar] = {}
        self.y: dict[tuple[int, str], cp_model.IntVar] = {}
        for p in range(pp):
            for s in sites:
                cap = self.cap[(p, s)]
                if cap == 0:
                    continue
                n = m.new_int_var(0, cap, f"n{p}_{s}")
                m.add(
                    n
                    == sum(
                        self.x[(p, g.index)] for g in inst.groups_of(s) if (p, g.index) in self.x
                    )
                )
                y = m.new_bool_var(f"y{p}_{s}")
                m.add(n <= cap * y)
                m.add(n >= y)
                self.n[(p, s)] = n
                self.y[(p, s)] = y
            m.add(sum(self.n[(p, s)] for s in sites if (p, s) in self.n) == dp)

        # -- data-parallel sites per stage, and their WAN bytes ----------------------------
        self.k: list[cp_model.IntVar] = []
        self.dp_bytes_tables: list[list[int]] = []
        for p in range(pp):
            avail = sorted((self.cap[(p, s)] for s in sites if (p, s) in self.n), reverse=True)
            kmax = len(avail)
            kmin, acc = 0, 0
            while acc < dp:  # the fewest sites whose capacity covers dp replicas
                acc += avail[kmin]
                kmin += 1
            k = m.new_int_var(kmin, kmax, f"k{p}")
            m.add(k == sum(self.y[(p, s)] for s in sites if (p, s) in self.y))
            self.k.append(k)
            self.dp_bytes_tables.append([w.dp_wan_bytes(p, kk) for kk in range(kmax + 1)])

        # -- pipeline: replicas that stay in their site ------------------------------------
        self.stay: dict[tuple[int, str], cp_model.IntVar] = {}
        for p in range(pp - 1):
            for s in sites:
                if (p, s) in self.n and (p + 1, s) in self.n:
                    v = m.new_int_var(0, min(self.cap[(p, s)], self.cap[(p + 1, s)]), f"st{p}_{s}")
                    m.add(v <= self.n[(p, s)])
                    m.add(v <= self.n[(p + 1, s)])
                    self.stay[(p, s)] = v
        # Cut: shards at a site form runs of consecutive stages, each at most pp long, so
        # at most (shards − runs) hops stay inside it, with runs ≥ shards / pp.
        if pp > 1:
            for s in sites:
                shards_here = [self.n[(p, s)] for p in range(pp) if (p, s) in self.n]
                stays = [self.stay[(p, s)] for p in range(pp - 1) if (p, s) in self.stay]
                if not stays:
                    continue
                total = max(sum(self.cap[(p, s)] for p in range(pp)), 1)
                runs = m.new_int_var(0, total, f"runs_{s}")
                m.add(pp * runs >= sum(shards_here))
                m.add(sum(stays) <= sum(shards_here) - runs)

        # -- the WAN bytes objective, scaled by the gcd of its coefficients (exact) --------
        self.crossings = [
            dp - sum(self.stay[(p, s)] for s in sites if (p, s) in self.stay) for p in range(pp - 1)
        ]
        coeffs = [w.boundary_bytes] + [v for t in self.dp_bytes_tables for v in t]
        self.bytes_unit = _gcd(coeffs)
        self.dp_cost: list[cp_model.IntVar] = []
        for p in range(pp):
            table = [v // self.bytes_unit for v in self.dp_bytes_tables[p]]
            c = m.new_int_var(0, max(table), f"dpc{p}")
            lo, hi = bounds(self.k[p])
            for kk in range(lo, hi):
                # secant through (kk, t[kk]) and (kk+1, t[kk+1]); convex ⇒ exact at integers
                m.add(c >= table[kk] + (table[kk + 1] - table[kk]) * (self.k[p] - kk))
            m.add(c >= table[lo])
            self.dp_cost.append(c)
        self.wan_units = (w.boundary_bytes // self.bytes_unit) * sum(self.crossings) + sum(
            self.dp_cost
        )

        self.time_ps: cp_model.LinearExpr | None = None
        if with_time:
            self._add_time(extra_arcs or set())

    # -- the time model --------------------------------------------------------------------
    def _arcs(self, extra: set[tuple[int, str, str]]) -> set[tuple[int, str, str]]:
        inst, w = self.inst, self.inst.workload
        sites = inst.sites
        arcs: set[tuple[int, str, str]] = set()
        used = self.fixed.per_site(inst) if self.fixed is not None else None
        for p in range(inst.pp - 1):
            src = [s for s in sites if (p, s) in self.n and (used is None or used.get((p, s)))]
            dst = [
                s for s in sites if (p + 1, s) in self.n and (used is None or used.get((p + 1, s)))
            ]
            pairs = [(a, b) for a in src for b in dst if a != b and inst.graph.route(a, b)]
            limit = max(4, ARC_BUDGET // max(1, (inst.pp - 1) * len(src)))
            if len(pairs) > limit * len(src):
                # Keep each source's nearest destinations (per-replica hop time).
                by_src: dict[str, list[tuple[float, str]]] = {}
                for a, b in pairs:
                    route = inst.graph.route(a, b)
                    assert route is not None
                    by_src.setdefault(a, []).append((w.hop_seconds(route, 1, 1.0), b))
                pairs = [(a, b) for a, lst in by_src.items() for _, b in sorted(lst)[:limit]]
            arcs.update((p, a, b) for a, b in pairs)
        arcs.update((p, a, b) for p, a, b in extra if a != b)
        return arcs

    def _add_time(self, extra_arcs: set[tuple[int, str, str]]) -> None:
        inst, w, m = self.inst, self.inst.workload, self.m
        dp, pp, sites = inst.dp, inst.pp, inst.sites
        arcs = self._arcs(extra_arcs)
        self.f: dict[tuple[int, str, str], cp_model.IntVar] = {}
        self.u: dict[tuple[int, str, str], cp_model.IntVar] = {}
        for p, a, b in sorted(arcs):
            if (p, a) not in self.n or (p + 1, b) not in self.n:
                continue
            ub = min(self.cap[(p, a)], self.cap[(p + 1, b)])
            f = m.new_int_var(0, ub, f"f{p}_{a}_{b}")
            u = m.new_bool_var(f"u{p}_{a}_{b}")
            m.add(f <= ub * u)
            self.f[(p, a, b)] = f
            self.u[(p, a, b)] = u
        out: dict[tuple[int, str], list[cp_model.IntVar]] = {}
        inc: dict[tuple[int, str], list[cp_model.IntVar]] = {}
        for (p, a, b), f in self.f.items():
            out.setdefault((p, a), []).append(f)
            inc.setdefault((p, b), []).append(f)
        for p in range(pp - 1):
            for a in sites:
                stay = self.stay.get((p, a), 0)
                if (p, a) in self.n:
                    m.add(self.n[(p, a)] == stay + sum(out.get((p, a), [])))
                if (p + 1, a) in self.n:
                    m.add(self.n[(p + 1, a)] == stay + sum(inc.get((p, a), [])))

        def ps(seconds: float) -> int:
            return max(0, within_horizon(seconds * PS, "one transfer or compute step"))

        # compute_p: the slowest group the stage uses.
        horizon_c = max(ps(c) for row in inst.compute for c in row)
        self.compute = []
        for p in range(pp):
            c = m.new_int_var(0, horizon_c, f"comp{p}")
            for g in inst.groups:
                if (p, g.index) in self.x:
                    z = m.new_bool_var(f"z{p}_{g.index}")
                    m.add(self.x[(p, g.index)] <= g.slots * z)
                    m.add(c >= ps(inst.compute[p][g.index]) * z)
            self.compute.append(c)
        # boundary_p: the slowest hop from stage p to p + 1.
        self.boundary = []
        for p in range(pp):
            terms: list[tuple[int, int, cp_model.IntVar, cp_model.IntVar | None]] = []
            if p < pp - 1:
                for s in sites:
                    if (p, s) in self.stay:
                        per = ps(w.hop_seconds(None, 1, inst.intra_site_gbps(s)))
                        terms.append((0, per, self.stay[(p, s)], None))
                for (q, a, b), f in self.f.items():
                    if q != p:
                        continue
                    route = inst.graph.route(a, b)
                    assert route is not None
                    fixed = ps(2 * route.latency_ms / 1e3)
                    per = ps(w.hop_seconds(route, 1, 1.0)) - fixed
                    terms.append((fixed, per, f, self.u[(q, a, b)]))
            ub = within_horizon(
                max((fx + per * dp for fx, per, _, _ in terms), default=0),
                f"the hop from stage {p} to stage {p + 1}",
            )
            bnd = m.new_int_var(0, ub, f"bnd{p}")
            for fixed, per, var, lit in terms:
                ct = m.add(bnd >= fixed + per * var)
                if lit is not None:
                    ct.only_enforce_if(lit)
            self.boundary.append(bnd)
        t_ub = within_horizon(
            max(horizon_c + bounds(b)[1] for b in self.boundary), "one pipeline slot"
        )
        self.slot = m.new_int_var(0, t_ub, "slot")
        for p in range(pp):
            m.add(self.slot >= self.compute[p] + self.boundary[p])

        # Data-parallel sync: in-site phase + WAN phase, worst stage. With the counts pinned
        # the sites of every stage are known, so the sync time is a constant and is left
        # out (the flows chosen do not change it).
        self.dp_time = []
        if self.fixed is not None:
            self.sync = m.new_constant(0)
            self.time_ps = (w.micro_batches + pp - 1) * self.slot
            return
        for p in range(pp):
            intra_terms = []
            for s in sites:
                if (p, s) in self.n and self.cap[(p, s)] >= 2:
                    b2 = m.new_bool_var(f"two{p}_{s}")
                    m.add(self.n[(p, s)] <= 1 + (self.cap[(p, s)] - 1) * b2)
                    intra_terms.append((ps(w.dp_intra_seconds(p, inst.intra_site_gbps(s))), b2))
            intra_ub = max((cost for cost, _ in intra_terms), default=0)
            intra = m.new_int_var(0, intra_ub, f"dpi{p}")
            for cost, b2 in intra_terms:
                m.add(intra >= cost * b2)
            used = [s for s in sites if (p, s) in self.y]
            kmax = len(used)
            wan_ub = 0
            wan = None
            if kmax >= 2:
                # Per-leader volume as a table over k, in units so that bandwidth
                # coefficients stay ≥ 1000 (0.1 % rounding).
                pairs = [(a, b) for i, a in enumerate(used) for b in used[i + 1 :]]
                routes = {pr: r for pr in pairs if (r := inst.graph.route(*pr)) is not None}
                if routes:
                    # `Workload.dp_wan_seconds` for a pair is route.seconds(volume, steps),
                    # linear in both: its coefficients come from `Route.seconds` itself.
                    per_byte = {pr: r.seconds(1, 0) * PS for pr, r in routes.items()}
                    per_msg = {pr: ps(r.seconds(0, 1)) for pr, r in routes.items()}
                    min_coef = min(per_byte.values())
                    shift = max(0, math.ceil(math.log2(1000 / min_coef))) if min_coef < 1000 else 0
                    unit = 1 << shift
                    vols = [math.ceil(w.dp_wan_per_leader(p, kk) / unit) for kk in range(kmax + 1)]
                    vol = m.new_int_var(0, max(vols), f"vol{p}")
                    m.add_element(self.k[p], vols, vol)
                    # Messages per leader are linear in k − 1 (the cost model's rule).
                    steps = w.dp_wan_steps(2) * (self.k[p] - 1)
                    max_steps = w.dp_wan_steps(kmax)
                    coefs = {pr: (per_msg[pr], round(unit * per_byte[pr])) for pr in routes}
                    wan_ub = within_horizon(
                        max(lat * max_steps + coef * max(vols) for lat, coef in coefs.values()),
                        f"stage {p}'s data-parallel sync across sites",
                    )
                    wan = m.new_int_var(0, wan_ub, f"dpw{p}")
                    for (a, b), (lat, coef) in coefs.items():
                        m.add(wan >= lat * steps + coef * vol).only_enforce_if(
                            [self.y[(p, a)], self.y[(p, b)]]
                        )
            total = m.new_int_var(0, intra_ub + wan_ub, f"dpt{p}")
            m.add(total == intra + (wan if wan is not None else 0))
            self.dp_time.append(total)
        self.sync = m.new_int_var(0, max(bounds(v)[1] for v in self.dp_time), "sync")
        for v in self.dp_time:
            m.add(self.sync >= v)
        self.time_ps = (w.micro_batches + pp - 1) * self.slot + self.sync

    # -- solving ---------------------------------------------------------------------------
    def hint(
        self,
        counts: Counts,
        objective: Objective | None = None,
        cap: tuple[Objective, int] | None = None,
        seconds: float | None = None,
    ) -> int | None:
        """Hint the solver with a placement, completed to every variable of the model.

        Counts without flows pin only the shard counts; the pinned solve then chooses the
        flows (best for `objective`). Returns the placement's value of `objective` (default:
        the time if the model has time, else the bytes) in the model's units, or None if it
        breaks a constraint or the `cap` on the other objective (or when the pinned solve
        runs past `seconds`).

        A hint of the decision variables alone leaves CP-SAT to complete it by search,
        which took seconds on 256 sites; a complete feasible hint is taken as the first
        solution at once. So the model is cloned with the decisions pinned to the
        placement, that trivial problem is solved, and its solution is the hint.
        """
        m = self.m
        m.clear_hints()  # type: ignore[no-untyped-call]
        pinned = m.clone()
        decisions = self._decisions(counts)
        for var, value in decisions:
            pinned.add(pinned.get_int_var_from_proto_index(var.index) == value)
        if cap is not None:
            pinned.add(rebase(self.objective(cap[0]), pinned) <= cap[1])
        pinned.minimize(rebase(self.objective(objective), pinned))
        solver = new_solver()
        solver.parameters.num_workers = 1
        solver.parameters.max_deterministic_time = 5.0
        if seconds is not None:
            # A wall-clock cap too: on dense networks (a full mesh of 64 sites) the pinned
            # time model took seconds of a 10 s budget on a loaded machine.
            solver.parameters.max_time_in_seconds = max(0.01, seconds)
        status = solver.solve(pinned)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            for i in range(len(m.proto.variables)):
                var = m.get_int_var_from_proto_index(i)
                m.add_hint(var, solver.value(pinned.get_int_var_from_proto_index(i)))
            return round(solver.objective_value)
        # The placement breaks a constraint or the cap: hint the shard counts only.
        for key, var in self.x.items():
            m.add_hint(var, counts.shards.get(key, 0))
        return None

    def objective(self, which: Objective | None = None) -> cp_model.LinearExprT:
        """The expression of an objective (default: time if modelled, else bytes)."""
        if which is None:
            which = Objective.ITERATION_TIME if self.time_ps is not None else Objective.WAN_BYTES
        expr = self.wan_units if which is Objective.WAN_BYTES else self.time_ps
        assert expr is not None, "the time objective needs a model built with_time"
        return expr

    def _decisions(self, counts: Counts) -> list[tuple[cp_model.IntVar, int]]:
        """The placement's values of the shard counts, and of the flows if it has them."""
        out = [(var, counts.shards.get(key, 0)) for key, var in self.x.items()]
        if not counts.flows:
            return out
        out += [(var, counts.flows.get((p, s, s), 0)) for (p, s), var in self.stay.items()]
        if self.with_time:
            out += [(var, counts.flows.get(arc, 0)) for arc, var in self.f.items()]
        return out

    def counts(self, solver: cp_model.CpSolver) -> Counts:
        shards = {k: solver.value(v) for k, v in self.x.items() if solver.value(v)}
        flows = {(p, s, s): solver.value(v) for (p, s), v in self.stay.items() if solver.value(v)}
        if self.with_time:
            flows.update({k: solver.value(v) for k, v in self.f.items() if solver.value(v)})
        return Counts(shards, flows)


def within_horizon(value_ps: float, what: str) -> int:
    """`value_ps` as an integer, or InfeasibleError if the model cannot represent it."""
    if not math.isfinite(value_ps) or value_ps > MAX_MODEL_PS:
        raise InfeasibleError(
            f"{what} would take more than {MAX_MODEL_PS / PS / 3600:.0f} hours on these GPUs "
            "and links: a link or GPU is far too slow for this job"
        )
    return round(value_ps)


def new_solver() -> cp_model.CpSolver:
    """A CP-SAT solver that every solve in the scheduler uses.

    OR-Tools 9.15's presolve certifies wrong optima through its inclusion detection
    (google/or-tools#5293, open): on a 3-site time model it proved 0.3003 s "OPTIMAL"
    where a 0.2503 s placement of the same model exists (tests/unit/test_scheduler.py,
    `test_time_model_optimum_survives_presolve`). `presolve_inclusion_work_limit = 0`
    switches that family off and leaves the rest of presolve on, as the issue reports;
    on the bench instances it changed neither the plans nor the solve times measurably.
    """
    solver = cp_model.CpSolver()
    solver.parameters.presolve_inclusion_work_limit = 0
    return solver


def configure(
    solver: cp_model.CpSolver, settings: SolverSettings, seconds: float, wall_cap: float | None
) -> None:
    prm = solver.parameters
    prm.random_seed = settings.seed
    # The LP with all linear constraints closes these models fastest (measured).
    prm.linearization_level = 2
    wall = 2 * seconds if settings.deterministic else seconds
    if wall_cap is not None:
        wall = min(wall, wall_cap)
    prm.max_time_in_seconds = max(0.05, wall)
    if settings.deterministic:
        prm.num_workers = 1
        prm.max_deterministic_time = max(0.01, seconds * settings.dtime_per_second)
    else:
        prm.num_workers = settings.workers


def run(
    model: PlacementModel,
    objective: Objective,
    settings: SolverSettings,
    seconds: float,
    bound_other: tuple[Objective, int] | None = None,
    wall_cap: float | None = None,
) -> tuple[cp_model.CpSolver, cp_model.CpSolverStatus, PhaseReport]:
    """Minimise `objective` on `model`, optionally with the other objective capped.

    `seconds` is the phase's budget (deterministic time when `settings.deterministic`);
    `wall_cap` the wall-clock seconds the caller can still afford, which wins if the
    machine is slow (at the price of reproducibility for that run).
    """
    m = model.m
    expr = model.objective(objective)
    if bound_other is not None:
        # The cap stays in the model: a capped phase is always the model's last.
        other, cap_value = bound_other
        m.add(model.objective(other) <= cap_value)
    m.minimize(expr)
    solver = new_solver()
    configure(solver, settings, seconds, wall_cap)
    start = time.perf_counter()
    status = solver.solve(m)
    elapsed = time.perf_counter() - start
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    value: float = math.inf
    bound: float = 0.0
    if found and objective is Objective.WAN_BYTES:
        # Integer objective: keep bytes exact (a float product drifts by an ulp).
        value = float(round(solver.objective_value) * model.bytes_unit)
        # Bytes are never negative, whatever the LP relaxation proves.
        bound = float(max(0, math.ceil(solver.best_objective_bound - 1e-6)) * model.bytes_unit)
    elif found:
        value = solver.objective_value / PS
        bound = max(0.0, solver.best_objective_bound / PS)
    report = PhaseReport(
        objective=objective,
        status=solver.status_name(status),
        seconds=elapsed,
        value=value,
        bound=bound,
    )
    return solver, status, report
