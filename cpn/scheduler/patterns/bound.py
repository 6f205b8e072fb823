"""The bound of the pattern formulation: the Lagrangian, valid for any dual prices.

For *any* prices (π, μ), relaxing the coverage and k rows of the master gives

    L(π, μ) = B·(pp − 1)·dp + Σ_p π_p·dp − Σ_c |c|·max_a [B·v(a) + π·a + μ·[a ≥ 1]]
              + Σ_p min_{lo_p ≤ k ≤ hi_p, k integer} (c_p(k) + μ_p·k)

which is at most the WAN bytes of every placement with lo ≤ k ≤ hi (each site's pattern is
one of the maximised-over ones, and c_p is exact at the integer k). The maxima are exact
(the programme), so every column-generation iteration's L is a proven bound, and a time
cap is safe. At the LP optimum L equals the LP value. The bound reported is recomputed in
integers (`exact_bound`), so no floating point stands between the prices and it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cpn.scheduler.patterns.pricing import Priced, best_pattern
from cpn.scheduler.patterns.problem import PatternProblem


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
