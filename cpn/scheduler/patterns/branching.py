"""Branching on the number of sites per stage: closing what the LP leaves open.

The master LP's weakness is fractional k_p: a site used "two thirds" by stage p lets the
convex data-parallel cost c_p(k) be interpolated between k and k + 1 (on the 16-site
heterogeneous top-k instance the LP says 5.89 GB where every placement needs 6.32 GB, all
of it in that interpolation). So the bound is refined by a best-first branch and bound on
the k_p alone: a node restricts lo ≤ k ≤ hi, its bound is the Lagrangian computed with
those limits (valid for every placement inside them, at every iteration), children split
the most fractional k_p into k_p ≤ ⌊k⌋ and k_p ≥ ⌈k⌉, and the proven bound is the least
bound of the open nodes (or the incumbent, once every node is pruned by it). Columns are
patterns, valid in every node, so all nodes share one LP and its columns.

It stops when its effort is spent, when the best open node has integral k (branching on
k cannot raise it further), or when every node is pruned (the incumbent is optimal).
Node bounds are compared in floating point while searching; the bound returned is
recomputed exactly (`exact_bound`) for the open nodes that could set it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from cpn.scheduler.patterns.bound import Prices, exact_bound
from cpn.scheduler.patterns.colgen import INTEGRAL, Generated, MasterLP, generate
from cpn.scheduler.patterns.effort import Effort


@dataclass
class Branching:
    bound: int  # proven, bytes, a multiple of the unit
    nodes: int  # nodes solved, the root included
    proved: bool  # every node pruned by the incumbent: it is optimal
    #: The k limits of the open node with the least bound: where a better plan most
    #: likely lies (its LP, re-solved, is the residual master's guide).
    best_lo: list[int] | None = None
    best_hi: list[int] | None = None


@dataclass(order=True)
class _Node:
    value: float
    order: int
    lo: list[int] = field(compare=False)
    hi: list[int] = field(compare=False)
    ks: list[float] = field(compare=False)
    prices: Prices = field(compare=False)


def branch_on_sites(
    master: MasterLP, root: Generated, incumbent: int | None, effort: Effort
) -> Branching:
    """Best-first branch and bound on k from the root's column generation."""
    problem = master.problem
    assert root.best_prices is not None
    cutoff = math.inf if incumbent is None else float(incumbent)
    heap: list[_Node] = []
    counter = 0
    if root.best < cutoff:
        lo, hi = list(problem.kmin), list(problem.kmax)
        heap.append(_Node(root.best, 0, lo, hi, master.sites_per_stage(), root.best_prices))
    nodes = 1
    while heap and effort.left:
        node = heap[0]
        fractional = [
            (abs(k - round(k)), p) for p, k in enumerate(node.ks) if abs(k - round(k)) > INTEGRAL
        ]
        if not fractional:
            break
        heapq.heappop(heap)
        _, p = max(fractional)
        for down in (True, False):
            lo, hi = list(node.lo), list(node.hi)
            if down:
                hi[p] = math.floor(node.ks[p])
            else:
                lo[p] = math.ceil(node.ks[p])
            if lo[p] > hi[p]:
                continue
            got = generate(master, effort, lo, hi, stop_at=cutoff)
            nodes += 1
            # A child's bound is at least its parent's: both bound the same placements.
            if got.best_prices is not None and got.best > node.value:
                value, prices = got.best, got.best_prices
            else:
                value, prices = node.value, node.prices
            if value < cutoff:
                counter += 1
                heapq.heappush(
                    heap, _Node(value, counter, lo, hi, master.sites_per_stage(), prices)
                )
    master.set_k_bounds(problem.kmin, problem.kmax)
    if not heap:
        assert incumbent is not None
        return Branching(incumbent, nodes, True)
    lowest = min(heap)
    # The least exact bound over the open nodes; a node whose float bound is clearly above
    # the least exact one found so far cannot lower it.
    best: int | None = None
    for node in sorted(heap):
        if best is not None and node.value - 1e-6 * abs(node.value) > best:
            break
        value = exact_bound(problem, node.prices, node.lo, node.hi)
        best = value if best is None else min(best, value)
    assert best is not None
    if incumbent is not None and best >= incumbent:
        return Branching(incumbent, nodes, True)
    return Branching(best, nodes, False, lowest.lo, lowest.hi)
