"""Pipeline flows that minimise the slowest hop, for counts that are already fixed.

Given how many shards of each stage every site holds, the cost model's pipeline slot
depends on the flows only through boundary_p = the slowest pair of sites at boundary p,
where c replicas crossing from a to b take hop(a, b, c) = α_ab + β_ab·c per micro-batch
(`Workload.hop_seconds`: twice the route's latency plus both directions' bytes over its
bandwidth; inside a site, the fabric). Boundaries do not interact, so the least slot for
the counts is reached by minimising each boundary's slowest hop on its own: a bottleneck
transportation problem. For a candidate time T a pair can carry ⌊(T − α) / β⌋ replicas,
and T is feasible iff a max-flow moves all dp replicas; the least feasible T is one of
the values α + β·c, found by binary search over them. At that T a min-cost flow (cost:
one replica's hop) picks, among the flows meeting it, the one that keeps the most
replicas in their site and uses the fastest routes, so WAN bytes do not grow for nothing.

`complete_flows` (the greedy transportation plan) fills the fastest route first, which
is right for bytes and can pile eight replicas onto one pair of sites; this spreads them.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import numpy.typing as npt
from ortools.graph.python import max_flow, min_cost_flow

from cpn.scheduler.instance import Instance
from cpn.scheduler.realize import Counts

#: Hop costs are integer nanoseconds in the min-cost flow.
NS = 1e9


def hop_coefficients(
    inst: Instance,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(α, β) per pair of candidate sites: c replicas' hop takes α + β·c (inf: no route).

    Computed once per instance (`Instance.cache`).
    """
    cached = inst.cache.get("hop_coefficients")
    if cached is not None:
        return cast(tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]], cached)
    w = inst.workload
    n = len(inst.sites)
    alpha = np.full((n, n), np.inf)
    beta = np.full((n, n), np.inf)
    for i, a in enumerate(inst.sites):
        fabric = inst.intra_site_gbps(a)
        for j, b in enumerate(inst.sites):
            route = None if i == j else inst.graph.route(a, b)
            if i != j and route is None:
                continue
            alpha[i, j] = w.hop_seconds(route, 0, fabric)
            beta[i, j] = w.hop_seconds(route, 1, fabric) - alpha[i, j]
    inst.cache["hop_coefficients"] = (alpha, beta)
    return alpha, beta


def pair_costs(inst: Instance) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Per pair of candidate sites: seconds per message and per byte of its route (inf: no
    route, or the same site). Computed once per instance (`Instance.cache`)."""
    cached = inst.cache.get("pair_costs")
    if cached is not None:
        return cast(tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]], cached)
    n = len(inst.sites)
    per_msg = np.full((n, n), np.inf)
    per_byte = np.full((n, n), np.inf)
    for i, a in enumerate(inst.sites):
        for j, b in enumerate(inst.sites):
            if i != j and (route := inst.graph.route(a, b)) is not None:
                per_msg[i, j] = route.seconds(0, 1)
                per_byte[i, j] = route.seconds(1, 0)
    inst.cache["pair_costs"] = (per_msg, per_byte)
    return per_msg, per_byte


def _capacities(
    alpha: npt.NDArray[np.float64], beta: npt.NDArray[np.float64], limit: float, most: int
) -> npt.NDArray[np.int64]:
    with np.errstate(invalid="ignore", divide="ignore"):
        c = np.floor((limit - alpha) / beta * (1 + 1e-12) + 1e-9)
    c = np.where(np.isfinite(c), np.clip(c, 0, most), 0)
    return c.astype(np.int64)


def _full_flow(
    cap: npt.NDArray[np.int64], supply: npt.NDArray[np.int64], demand: npt.NDArray[np.int64]
) -> bool:
    """Can all of `supply` reach `demand` with at most cap[i, j] on each pair?"""
    na, nb = cap.shape
    rows, cols = np.nonzero(cap)
    flow = max_flow.SimpleMaxFlow()
    s, t = na + nb, na + nb + 1
    flow.add_arcs_with_capacity(
        np.concatenate([np.full(na, s), rows, na + np.arange(nb)]),
        np.concatenate([np.arange(na), na + cols, np.full(nb, t)]),
        np.concatenate([supply, cap[rows, cols], demand]),
    )
    return bool(flow.solve(s, t) == flow.OPTIMAL and flow.optimal_flow() == int(supply.sum()))


def boundary_flows(
    alpha: npt.NDArray[np.float64],
    beta: npt.NDArray[np.float64],
    supply: npt.NDArray[np.int64],
    demand: npt.NDArray[np.int64],
) -> list[tuple[int, int, int]] | None:
    """(i, j, replicas) moving supply i → demand j with the least slowest hop."""
    total = int(supply.sum())
    most = np.minimum.outer(supply, demand)
    # Every time a pair reaches with some count: the least feasible one is among them.
    reach = np.arange(1, int(most.max()) + 1) if most.size else np.arange(0)
    levels = (alpha[:, :, None] + beta[:, :, None] * reach[None, None, :])[
        reach[None, None, :] <= most[:, :, None]
    ]
    levels = np.unique(levels[np.isfinite(levels)])
    lo, hi, best = 0, len(levels) - 1, -1
    while lo <= hi:
        mid = (lo + hi) // 2
        cap = np.minimum(_capacities(alpha, beta, float(levels[mid]), total), most)
        if _full_flow(cap, supply, demand):
            best, hi = mid, mid - 1
        else:
            lo = mid + 1
    if best < 0:
        return None
    cap = np.minimum(_capacities(alpha, beta, float(levels[best]), total), most)
    rows, cols = np.nonzero(cap)
    na = len(supply)
    mcf = min_cost_flow.SimpleMinCostFlow()
    arcs = mcf.add_arcs_with_capacity_and_unit_cost(
        rows,
        na + cols,
        cap[rows, cols],
        np.round((alpha[rows, cols] + beta[rows, cols]) * NS).astype(np.int64),
    )
    mcf.set_nodes_supplies(
        np.arange(na + len(demand)), np.concatenate([supply, -demand]).astype(np.int64)
    )
    if mcf.solve() != mcf.OPTIMAL:
        return None
    moved = mcf.flows(arcs)
    return [(int(r), int(c), int(v)) for r, c, v in zip(rows, cols, moved, strict=True) if v]


def balanced_flows(
    inst: Instance,
    counts: Counts,
    coefficients: tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None = None,
) -> Counts | None:
    """`counts` with flows minimising every boundary's slowest hop; None if none exist."""
    alpha, beta = coefficients or hop_coefficients(inst)
    per_site = counts.per_site(inst)
    sites = inst.sites
    flows: dict[tuple[int, str, str], int] = {}
    for p in range(inst.pp - 1):
        supply = np.array([per_site.get((p, s), 0) for s in sites], dtype=np.int64)
        demand = np.array([per_site.get((p + 1, s), 0) for s in sites], dtype=np.int64)
        src, dst = np.flatnonzero(supply), np.flatnonzero(demand)
        idx = np.ix_(src, dst)
        moves = boundary_flows(alpha[idx], beta[idx], supply[src], demand[dst])
        if moves is None:
            return None
        for i, j, v in moves:
            flows[(p, sites[src[i]], sites[dst[j]])] = v
    return Counts(counts.shards, flows)
