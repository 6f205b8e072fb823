"""A proven lower bound on the predicted iteration time of any placement of an instance.

The cost model's iteration time is (m + pp − 1)·S + D with S = max_p(compute_p +
boundary_p) the pipeline slot and D = max_p dp_sync_p the exposed data-parallel sync
(`cpn.costmodel.evaluate`). Each part is bounded from below by what *any* placement must
pay on the given links, and the two ways a placement can treat the pipeline are bounded
apart, because they trade slot against sync:

  (A) no replica crosses the WAN between stages. Then every site holds whole replicas,
      so all stages sit on the same K sites, K at least the fewest sites whose
      whole-replica room covers dp; the sync of every stage spans K sites, and some site
      carries ⌈dp / K⌉ replicas' activations through its fabric. Bound: the least over
      such K of (m + pp − 1)·S_A(K) + max_p D_p(K).
  (B) some replica crosses. Then some boundary pays at least the cheapest WAN hop of one
      replica, and each stage's sync is at least its least over the k it can have.

and the bound is the smaller of the two. Its parts:
  - compute: the least t such that every stage's dp shards fit in slots whose compute
    time for that stage is ≤ t (a max-flow check over the node groups), and per stage the
    dp-th fastest slot that fits it;
  - sync of stage p over k sites: the in-site phase wherever a site must hold two replicas
    (k < dp), plus the WAN phase, `Workload.dp_wan_seconds`, whose slowest pair among k
    sites is at least, for the best site a, the (k − 1)-th cheapest pair from a (a has
    k − 1 partners in the set; the most expensive is no cheaper than that).

Pair costs come from `Route.seconds` (the cost model's one formula), evaluated for all
pairs at once with numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx
import numpy as np
import numpy.typing as npt

from cpn.scheduler.instance import Instance
from cpn.scheduler.patterns.classes import site_classes

#: Relative margin taken off the bound for floating-point rounding.
FLOAT_MARGIN = 1e-9


@dataclass(frozen=True)
class TimeBound:
    seconds: float  # the bound on the predicted iteration time
    crossing_free: float  # the least time of placements without a WAN crossing (A)
    crossing: float  # the least time of placements with one (B); inf if pp = 1
    compute: float  # the least slowest compute per micro-batch any placement has


def _compute_floor(inst: Instance) -> tuple[float, list[float]]:
    """(joint least slowest compute, per-stage dp-th fastest fitting slot)."""
    dp, pp = inst.dp, inst.pp
    per_stage = []
    for p in range(pp):
        times = sorted(
            (inst.compute[p][g.index], g.slots) for g in inst.groups if inst.fits[p][g.index]
        )
        acc = 0
        for t, slots in times:
            acc += slots
            if acc >= dp:
                per_stage.append(t)
                break
        else:  # build_instance guarantees room for every stage
            per_stage.append(math.inf)
    candidates = sorted(
        {inst.compute[p][g.index] for p in range(pp) for g in inst.groups if inst.fits[p][g.index]}
    )

    def fits_under(limit: float) -> bool:
        graph = nx.DiGraph()
        for p in range(pp):
            graph.add_edge("source", ("stage", p), capacity=dp)
            for g in inst.groups:
                if inst.fits[p][g.index] and inst.compute[p][g.index] <= limit:
                    graph.add_edge(("stage", p), ("group", g.index))
        for g in inst.groups:
            graph.add_edge(("group", g.index), "sink", capacity=g.slots)
        if "sink" not in graph or "source" not in graph:
            return False
        return bool(nx.maximum_flow_value(graph, "source", "sink") >= dp * pp)

    lo, hi = 0, len(candidates) - 1
    joint = max(per_stage)
    while lo <= hi:  # the least candidate under which every stage fits
        mid = (lo + hi) // 2
        if fits_under(candidates[mid]):
            joint = candidates[mid]
            hi = mid - 1
        else:
            lo = mid + 1
    return max(joint, *per_stage), per_stage


def _pair_costs(inst: Instance) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Per pair of candidate sites: seconds per message and per byte (inf: no route)."""
    n = len(inst.sites)
    per_msg = np.full((n, n), np.inf)
    per_byte = np.full((n, n), np.inf)
    for i, a in enumerate(inst.sites):
        for j, b in enumerate(inst.sites):
            if i != j and (route := inst.graph.route(a, b)) is not None:
                per_msg[i, j] = route.seconds(0, 1)
                per_byte[i, j] = route.seconds(1, 0)
    return per_msg, per_byte


def iteration_time_bound(inst: Instance) -> TimeBound:
    """No placement of `inst` has a predicted iteration time below `.seconds`."""
    w = inst.workload
    dp, pp, m = inst.dp, inst.pp, w.micro_batches
    sites = inst.sites
    fabric = {s: inst.intra_site_gbps(s) for s in sites}
    caps = {(p, s): min(dp, inst.site_slots(s, p)) for p in range(pp) for s in sites}
    per_msg, per_byte = _pair_costs(inst)

    joint, per_stage = _compute_floor(inst)

    hosts_of = [tuple(i for i, s in enumerate(sites) if caps[(p, s)] > 0) for p in range(pp)]
    best_fabric = max(fabric.values())
    wan_cache: dict[tuple[float, int, tuple[int, ...], int], float] = {}

    def wan(volume: float, steps: int, hosts: tuple[int, ...], k: int) -> float:
        """Least slowest pair of any k of `hosts` for this volume and message count."""
        key = (volume, steps, hosts, k)
        if key not in wan_cache:
            idx = np.ix_(hosts, hosts)
            cost = steps * per_msg[idx] + volume * per_byte[idx]
            np.fill_diagonal(cost, np.inf)
            # The (k − 1)-th cheapest partner of each site; the best site bounds every set.
            kth = np.partition(cost, k - 2, axis=1)[:, k - 2]
            wan_cache[key] = float(kth.min())
        return wan_cache[key]

    def sync(p: int, k: int) -> float:
        """Least sync of stage p over exactly k sites."""
        intra = 0.0
        if k < dp:  # some site holds two replicas: its in-site reduce and broadcast
            roomy = [fabric[s] for s in sites if caps[(p, s)] >= 2]
            intra = w.dp_intra_seconds(p, max(roomy)) if roomy else math.inf
        if k <= 1:
            return intra
        if len(hosts_of[p]) < k:
            return math.inf
        return intra + wan(w.dp_wan_per_leader(p, k), w.dp_wan_steps(k), hosts_of[p], k)

    kmin = []
    for p in range(pp):
        room = sorted((caps[(p, s)] for s in sites if caps[(p, s)] > 0), reverse=True)
        acc, k = 0, 0
        while acc < dp:
            acc += room[k]
            k += 1
        kmin.append(k)
    kmax = [min(dp, sum(1 for s in sites if caps[(p, s)] > 0)) for p in range(pp)]

    # (A) whole replicas per site: K sites hold every stage.
    classes = site_classes(inst)
    whole = []
    for cls in classes:
        r = 0
        while r < dp and cls.holds((r + 1,) * pp):
            r += 1
        whole += [r] * cls.size
    whole.sort(reverse=True)
    best_a = math.inf
    acc, k0 = 0, 0
    while k0 < len(whole) and acc < dp:
        acc += whole[k0]
        k0 += 1
    if acc >= dp:
        usable = min(dp, sum(1 for r in whole if r > 0))
        for k in range(max(k0, *kmin), usable + 1):
            hop = w.hop_seconds(None, math.ceil(dp / k), best_fabric) if pp > 1 else 0.0
            with_hop = [c + (hop if p < pp - 1 else 0.0) for p, c in enumerate(per_stage)]
            slot = max(joint, *with_hop)
            total = (m + pp - 1) * slot + max(sync(p, k) for p in range(pp))
            best_a = min(best_a, total)

    # (B) some replica crosses the WAN at some boundary.
    best_b = math.inf
    if pp > 1:
        act = w.activation_bytes
        cheapest_hop = 2 * float(np.min(per_msg + act * per_byte))
        crossing_slot = min(per_stage[q] + cheapest_hop for q in range(pp - 1))
        slot = max(joint, crossing_slot)
        least_sync = max(min(sync(p, k) for k in range(kmin[p], kmax[p] + 1)) for p in range(pp))
        best_b = (m + pp - 1) * slot + least_sync

    bound = min(best_a, best_b)
    if not math.isfinite(bound):
        bound = (m + pp - 1) * joint
    return TimeBound(
        seconds=bound * (1 - FLOAT_MARGIN),
        crossing_free=best_a,
        crossing=best_b,
        compute=joint,
    )
