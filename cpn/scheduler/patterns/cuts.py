"""Per-site cuts for the CP-SAT model from the column generation's dual prices.

For prices (π, μ) and every site s of class c, each pattern the site can hold satisfies

    B·Σ_p stay[p, s] + Σ_p π_p·n[p, s] + Σ_p μ_p·y[p, s]  ≤  h_c := max_a [B·v(a) + π·a + μ·[a ≥ 1]]

in the CP-SAT model's variables (n: shards of stage p at s, y: n ≥ 1, stay ≤ min(n_p,
n_{p+1}), so the left side is at most the pattern's value). Summed over the sites, with
Σ_s n[p, s] = dp and Σ_s y[p, s] = k_p, these give the objective the Lagrangian bound
L(π, μ) — so CP-SAT's own LP starts from the pattern bound instead of the weak count
relaxation, and every plan stays feasible (a site's pattern never exceeds h_c).

CP-SAT needs integer coefficients: the prices are scaled and rounded first, and h_c is then
computed *for the rounded prices* by the exact integer programme, so the cut is valid as
written whatever the rounding did to its strength.
"""

from __future__ import annotations

from ortools.sat.python import cp_model

from cpn.scheduler.cpsat import PlacementModel
from cpn.scheduler.patterns.bound import Prices, integer_prices
from cpn.scheduler.patterns.pricing import best_pattern
from cpn.scheduler.patterns.problem import PatternProblem

#: Bits of the largest term of a cut: enough to keep the prices' shape, small enough for
#: CP-SAT's LP to stay well conditioned.
CUT_BITS = 30


def add_cuts(model: PlacementModel, problem: PatternProblem, prices: Prices) -> int:
    """Add one cut per site for `prices`; returns how many were added."""
    q = integer_prices(problem, prices, CUT_BITS)
    stay, shard, use = q.stay, q.shard, q.use
    m = model.m
    added = 0
    for cls in problem.classes:
        cap = best_pattern(cls, stay, shard, use).value
        for s in cls.sites:
            terms: list[cp_model.LinearExprT] = []
            for p in range(problem.pp):
                if (p, s) in model.n:
                    terms.append(shard[p] * model.n[(p, s)] + use[p] * model.y[(p, s)])
                if (p, s) in model.stay:
                    terms.append(stay * model.stay[(p, s)])
            if terms:
                m.add(sum(terms) <= int(cap))
                added += 1
    return added
