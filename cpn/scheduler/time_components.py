"""Part (K) of the iteration-time bound: stages kept apart by slow pairs must cross.

Every placement, crossing or not (`time_bound` takes the larger of this and its other
parts). Its argument, for a placement with exposed sync D:

  1. A pair of sites a, b whose WAN phase, for any stage and any k ≥ 2 sites, costs more
     than D cannot share a stage (the phase is the slowest of all the stage's pairs,
     `costmodel.evaluate`). So each stage's sites are a clique, hence connected, in the
     graph of pairs whose least phase c(a, b) is ≤ D, and each stage lies inside one of
     its connected components. The components change only at the weights of a minimum
     spanning tree of c: at the largest of them d ≤ D they are those of D, and
     max(d, the shared sync floor) ≤ D.
  2. A component C holds at most ⌊slots(C) / dp⌋ stages (each needs dp slots of its
     own), none if its sites' room for a stage is below dp.
  3. Consecutive stages in different components send all dp replicas from one to the
     other: the boundary is at least H(C, C′), the least hop time at which dp replicas fit
     on the pairs C × C′, each pair carrying at most ⌊(T − α)/β⌋ and at most the rooms of
     its sites, each site at most its room (a relaxation of the transportation problem).
  4. The stages' components, joined by the boundaries between them, hold all pp stages:
     so some group of components joined by pairs with H ≤ S − (least compute) has
     ⌊slots / dp⌋ summed ≥ pp — the least such threshold is a bottleneck spanning tree
     over the components (Kruskal). If one component holds pp stages, no claim.

The bound is the least over the levels d of (m + pp − 1)·slot(d) + max(d, shared).
Measured on the heterogeneous bench instances with dense sync (a research helper,
2026-11-28): 16 sites 10.9 → 21.4 s, 64 sites 23.4 → 35.4 s; no gain with top-k or on
the homogeneous network, where at a low d one component already holds every stage.
"""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import numpy.typing as npt

from cpn.scheduler.instance import Instance
from cpn.scheduler.time_flows import _capacities, hop_coefficients, pair_costs

#: Bisection steps of `_crossing_hop` (it returns the lower end: never above the least).
HOP_STEPS = 50


def _crossing_hop(
    alpha: npt.NDArray[np.float64],
    beta: npt.NDArray[np.float64],
    senders: list[int],
    takers: list[int],
    room: npt.NDArray[np.int64],
    dp: int,
) -> float:
    """A floor on the hop of a boundary whose dp replicas all go from `senders` to
    `takers` (disjoint): the least T at which the pairs can carry them (inf: never)."""
    al, be = alpha[np.ix_(senders, takers)], beta[np.ix_(senders, takers)]
    send, take = room[senders], room[takers]
    pair_room = np.minimum(send[:, None], take[None, :])
    finite = np.isfinite(al) & np.isfinite(be)
    if not finite.any():
        return math.inf

    def carries(t: float) -> bool:
        count = np.minimum(_capacities(al, be, t, dp), pair_room)  # a tie counts as carried
        rows = np.minimum(count.sum(axis=1), send).sum()
        cols = np.minimum(count.sum(axis=0), take).sum()
        return bool(min(rows, cols) >= dp)

    hi = float(np.max((al + be * dp)[finite]))
    if not carries(hi):
        return math.inf  # the rooms cannot take dp replicas this way
    lo = float(np.min((al + be)[finite])) * (1 - 1e-9)
    if carries(lo):
        return lo  # one replica on the cheapest pair: the floor of any hop here
    for _ in range(HOP_STEPS):
        mid = 0.5 * (lo + hi)
        if carries(mid):
            hi = mid
        else:
            lo = mid
    return lo


def component_bound(inst: Instance, joint: float, per_stage: list[float], shared: float) -> float:
    """Part (K): no placement is faster (see the module docstring). `joint` and
    `per_stage` are the compute floors of `time_bound._compute_floor`, `shared` its
    shared sync floor (S)."""
    w = inst.workload
    dp, pp, m = inst.dp, inst.pp, w.micro_batches
    n = len(inst.sites)
    if pp < 2 or n < 2:
        return 0.0
    slots = np.array([inst.site_slots(s) for s in inst.sites], dtype=np.int64)
    room = np.array(
        [max(min(dp, inst.site_slots(s, p)) for p in range(pp)) for s in inst.sites],
        dtype=np.int64,
    )
    per_msg, per_byte = pair_costs(inst)
    alpha, beta = hop_coefficients(inst)
    least = np.full((n, n), np.inf)  # c(a, b): the least WAN phase of the pair
    for p in range(pp):
        for k in range(2, dp + 1):
            cost = w.dp_wan_steps(k) * per_msg + w.dp_wan_per_leader(p, k) * per_byte
            least = np.minimum(least, np.minimum(cost, cost.T))
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    rows, cols = np.nonzero(np.triu(np.isfinite(least), 1))
    graph.add_weighted_edges_from(
        (int(a), int(b), float(least[a, b])) for a, b in zip(rows, cols, strict=True)
    )
    # The threshold graph of c ≤ d and the tree's edges of weight ≤ d have the same
    # components (Kruskal): the tree's edges are added level by level, not the graph
    # rebuilt from all pairs at each (at 128 sites that rebuilding took 1.4 s).
    tree = sorted(
        (float(c["weight"]), int(a), int(b))
        for a, b, c in nx.minimum_spanning_edges(graph, algorithm="kruskal", data=True)
    )
    levels = sorted({0.0, *(c for c, _, _ in tree)})
    fastest = max(joint, *per_stage)
    least_compute = min(per_stage[:-1])
    hops: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}
    best = math.inf
    near = nx.Graph()
    near.add_nodes_from(range(n))
    added = 0
    for d in levels:
        while added < len(tree) and tree[added][0] <= d:
            near.add_edge(tree[added][1], tree[added][2])
            added += 1
        comps = [tuple(sorted(c)) for c in nx.connected_components(near)]
        holds = [
            int(slots[list(c)].sum()) // dp if int(room[list(c)].sum()) >= dp else 0 for c in comps
        ]
        if max(holds) >= pp:
            # No claim on the slot here, nor at any higher level, where the total only
            # grows with d: the least of them is this one.
            best = min(best, (m + pp - 1) * fastest + max(d, shared))
            break
        live = [i for i, h in enumerate(holds) if h > 0]
        joins = []
        for x, i in enumerate(live):
            for y in range(x + 1, len(live)):
                a, b = comps[i], comps[live[y]]
                if (a, b) not in hops:
                    there = _crossing_hop(alpha, beta, list(a), list(b), room, dp)
                    back = _crossing_hop(alpha, beta, list(b), list(a), room, dp)
                    hops[(a, b)] = min(there, back)
                joins.append((hops[(a, b)], x, y))
        slot = max(fastest, least_compute + _joining_hop(joins, [holds[i] for i in live], pp))
        best = min(best, (m + pp - 1) * slot + max(d, shared))
    # Some level always admits the placements build_instance found room for; inf would be
    # a defect here, so it claims nothing rather than everything.
    return best if math.isfinite(best) else 0.0


def _joining_hop(joins: list[tuple[float, int, int]], holds: list[int], pp: int) -> float:
    """The least hop H at which components joined by pairs with hop ≤ H hold pp stages
    (Kruskal on the joins, cheapest first); inf if never."""
    groups = nx.utils.UnionFind(range(len(holds)))
    total = dict(enumerate(holds))  # by each group's representative
    for hop, x, y in sorted(joins):
        rx, ry = groups[x], groups[y]
        if rx == ry:
            continue
        groups.union(rx, ry)
        total[groups[x]] = total[rx] + total[ry]
        if total[groups[x]] >= pp:
            return hop
    return math.inf
