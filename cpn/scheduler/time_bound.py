"""A proven lower bound on the predicted iteration time of any placement of an instance.

The cost model's iteration time is (m + pp − 1)·S + D with S = max_p(compute_p +
boundary_p) the pipeline slot and D = max_p dp_sync_p the exposed data-parallel sync
(`cpn.costmodel.evaluate`). Each part is bounded from below by what *any* placement must
pay on the given links, and the two ways a placement can treat the pipeline are bounded
apart, because they trade slot against sync:

  (A) no replica crosses the WAN between stages. Then every site holds whole replicas,
      so all stages sit on the same K sites, K at least the fewest sites whose
      whole-replica room covers dp; the sync of every stage spans K sites whose
      whole-replica rooms hold dp, and some site carries ⌈dp / K⌉ replicas' activations
      through its fabric. Bound: the least over such K of (m + pp − 1)·S_A(K) +
      max_p D_p(K).
  (B) some replica crosses. Then some boundary pays at least the cheapest WAN hop of one
      replica, and each stage's sync is at least its least over the k it can have.

and the bound is the smaller of the two, raised to (C) (the trade between sync and
crossings by sites per stage, `_sites_per_stage_bound`) and to (K) (stages kept apart by
slow pairs must cross between them, `time_components`) where those are larger, every
sync term being at least (S) (`_shared_sync_floor`). Its parts:
  - compute: the least t such that every stage's dp shards fit in slots whose compute
    time for that stage is ≤ t (a max-flow check over the node groups), and per stage the
    dp-th fastest slot that fits it;
  - sync of stage p over k sites: the in-site phase wherever a site must hold two replicas
    (k < dp), plus the WAN phase, `Workload.dp_wan_seconds`, whose slowest pair among k
    sites is at least, for the best site a, the cheapest c such that a's partners costing
    ≤ c include k − 1 that hold, with a, room for dp replicas of the stage (a has k − 1
    partners in the set, the set holds the stage, and its most expensive pair from a is
    no cheaper than that); raised by the clique floor (`_clique_floor`: the k sites
    are pairwise within the phase, not only within it of one site).

Pair costs come from `Route.seconds` (the cost model's one formula), evaluated for all
pairs at once with numpy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import networkx as nx
import numpy as np
import numpy.typing as npt
from ortools.graph.python import max_flow
from ortools.sat.python import cp_model

from cpn.scheduler.instance import Instance
from cpn.scheduler.patterns.classes import site_classes
from cpn.scheduler.time_components import component_bound
from cpn.scheduler.time_flows import hop_coefficients, pair_costs

#: Relative margin taken off the bound for floating-point rounding.
FLOAT_MARGIN = 1e-9
#: Max-clique searches one bound may make for the clique floor (`_clique_floor`): a count,
#: not a clock, so the bound is the same on any machine. The homogeneous bench instances
#: need 6 (16 sites) and 11 (64 sites, 0.3 s); on the heterogeneous ones, where a pair's
#: rank changes with k, the searches never lifted the floor (2 094 of them, 50 s, measured)
#: and stop at the cap.
CLIQUE_SEARCHES = 24
#: Deterministic units one CP-SAT clique search may take (`_clique_upper_bound`): the
#: 128-site graphs measured took at most 0.09.
CLIQUE_DTIME = 0.5

#: What a stage's pair costs over k sites depend on: sync volume, steps, host group, k.
StarKey = tuple[float, int, int, int]


@dataclass(frozen=True)
class TimeBound:
    seconds: float  # the bound on the predicted iteration time
    crossing_free: float  # the least time of placements without a WAN crossing (A)
    crossing: float  # the least time of placements with one (B); inf if pp = 1
    compute: float  # the least slowest compute per micro-batch any placement has
    sites_per_stage: float = 0.0  # (C): sync against crossings, by sites per stage
    shared_sync: float = 0.0  # (S): the sync every placement pays, stages sharing slots
    components: float = 0.0  # (K): stages kept apart by slow pairs (`time_components`)


def _largest_cliques(
    near: npt.NDArray[np.bool_], room: npt.NDArray[np.int64], equal_rooms: bool
) -> tuple[int, int]:
    """(most sites, most room) of any clique of the graph `near` (diagonal ignored), or
    an upper bound on each: either way no clique exceeds them, which is all a floor needs.

    Two exact searches, by density, because each is fast where the other is slow:
    networkx's branch and bound takes milliseconds on sparse graphs (the pairs within a
    low cost) but up to 4 s on a 128-site graph missing five of its 8 128 pairs (its
    colouring bound is weak when nearly every pair is an edge: measured, 24 searches took
    24 s at 128 sites); CP-SAT, one worker, on the *missing* pairs (at most one site of
    each) settles those in a few hundredths of a deterministic unit but spends 0.2–0.5 s
    building the constraints of a sparse graph. Above half the pairs, CP-SAT, whose
    deterministic-time cap bounds the search by a count rather than a clock (the bound
    stays the same on every machine; when the cap binds, its proven objective bound is
    still an upper bound)."""
    n = len(room)
    rows, cols = np.nonzero(np.triu(near, 1))
    if 4 * len(rows) > n * (n - 1):
        size = _clique_upper_bound(near, np.ones(n, dtype=np.int64))
        if equal_rooms:
            return size, size * int(room[0]) if n else 0
        return size, _clique_upper_bound(near, room)
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    graph.add_edges_from(zip(rows.tolist(), cols.tolist(), strict=True))
    _, size = nx.max_weight_clique(graph, weight=None)
    if equal_rooms:
        return int(size), int(size * room[0]) if n else 0
    for i, r in enumerate(room.tolist()):
        graph.nodes[i]["room"] = int(r)
    _, most = nx.max_weight_clique(graph, weight="room")
    return int(size), int(most)


def _clique_upper_bound(near: npt.NDArray[np.bool_], weight: npt.NDArray[np.int64]) -> int:
    """The largest weight of a clique of `near` (CP-SAT, one worker, at most
    `CLIQUE_DTIME` deterministic units), or CP-SAT's proven upper bound on it."""
    model = cp_model.CpModel()
    pick = [model.new_bool_var(f"site{i}") for i in range(len(weight))]
    rows, cols = np.nonzero(np.triu(~near, 1))
    for a, b in zip(rows.tolist(), cols.tolist(), strict=True):
        model.add_bool_or([pick[a].Not(), pick[b].Not()])  # a missing pair: not both
    model.maximize(sum(int(w) * x for w, x in zip(weight.tolist(), pick, strict=True)))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = CLIQUE_DTIME
    solver.solve(model)
    return math.floor(solver.best_objective_bound + 1e-6)


def _clique_floor(
    cost: npt.NDArray[np.float64],
    room: npt.NDArray[np.int64],
    k: int,
    need: int,
    start: float,
    searches: list[int],
    seen: dict[bytes, tuple[int, int]] | None = None,
) -> float:
    """A floor on the slowest pair of any k sites holding `need`, at least `start`.

    The WAN phase of a stage is its slowest pair among *all* its sites' pairs
    (`costmodel.evaluate`), so its k sites are pairwise within that cost c: a clique of
    the graph of pairs costing ≤ c, with k sites and room ≥ `need`. The least pair cost
    at which the graph has a clique of k sites and one of room ≥ `need` (both necessary)
    is a floor; it only grows with c, so a galloping then binary search over the costs
    from `start` (a floor already proved) finds it. `searches` counts the clique
    searches left; when they run out the search stops, and the least cost not yet shown
    too small is still a floor (every cost below it was). `seen` keeps the answers per
    graph and rooms: stages and k of the same costs meet the same graphs, searched once."""
    values = np.unique(cost[np.isfinite(cost)])
    values = values[values >= start]
    equal = len(set(room.tolist())) <= 1

    known = {} if seen is None else seen

    def holds(c: float) -> bool:
        near = cost <= c
        key = np.packbits(near).tobytes() + room.tobytes()
        if key not in known:
            searches[0] -= 1
            known[key] = _largest_cliques(near, room, equal)
        size, most = known[key]
        return size >= k and most >= need

    lo, hi = 0, len(values) - 1
    step = 1  # gallop: the answer is usually a few values above `start`
    while lo + step - 1 < hi and searches[0] > 0 and not holds(float(values[lo + step - 1])):
        lo, step = lo + step, step * 2
    found = None
    hi = min(hi, lo + step - 1)  # values[lo + step − 1] holds, unless searches ran out
    while lo <= hi and searches[0] > 0:
        mid = (lo + hi) // 2
        if holds(float(values[mid])):
            found, hi = float(values[mid]), mid - 1
        else:
            lo = mid + 1
    if lo > hi:  # searched to the end: the least that holds, or none does
        return max(start, found) if found is not None else math.inf
    return max(start, float(values[lo])) if lo < len(values) else math.inf


def _compute_floor(inst: Instance) -> tuple[float, list[float]]:
    """(joint least slowest compute, per-stage dp-th fastest fitting slot).

    Computed once per instance (`Instance.cache`): the sync-level search builds a decision
    model, which needs it, dozens of times.
    """
    cached = inst.cache.get("compute_floor")
    if cached is None:
        cached = inst.cache["compute_floor"] = _least_compute(inst)
    joint, per_stage = cast(tuple[float, list[float]], cached)
    return joint, list(per_stage)


def _least_compute(inst: Instance) -> tuple[float, list[float]]:
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


def iteration_time_bound(inst: Instance) -> TimeBound:
    """No placement of `inst` has a predicted iteration time below `.seconds`."""
    w = inst.workload
    dp, pp, m = inst.dp, inst.pp, w.micro_batches
    sites = inst.sites
    fabric = {s: inst.intra_site_gbps(s) for s in sites}
    caps = {(p, s): min(dp, inst.site_slots(s, p)) for p in range(pp) for s in sites}
    per_msg, per_byte = pair_costs(inst)

    joint, per_stage = _compute_floor(inst)

    hosts_of = [tuple(i for i, s in enumerate(sites) if caps[(p, s)] > 0) for p in range(pp)]
    best_fabric = max(fabric.values())
    # Whole replicas a site can hold (every stage of each at the site, memory fit
    # included): what the sites of a crossing-free placement hold (part A).
    whole_room: dict[str, int] = {}
    for cls in site_classes(inst):
        r = 0
        while r < dp and cls.holds((r + 1,) * pp):
            r += 1
        whole_room |= dict.fromkeys(cls.sites, r)
    whole_hosts = tuple(i for i, s in enumerate(sites) if whole_room[s] > 0)
    # Stages with the same hosts and rooms meet the same pairs: one id for each such group,
    # so the caches below key on (volume, steps, group, k) rather than hashing a tuple of
    # every host on each lookup (at 128 sites that hashing took a tenth of the bound).
    group_ids: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    groups: dict[tuple[int, bool], tuple[int, tuple[int, ...], tuple[int, ...]]] = {}
    for p in range(pp):
        for of_whole in (False, True):
            g_hosts = whole_hosts if of_whole else hosts_of[p]
            if of_whole:
                g_room = tuple(whole_room[sites[i]] for i in g_hosts)
            else:
                g_room = tuple(caps[(p, sites[i])] for i in g_hosts)
            gid = group_ids.setdefault((g_hosts, g_room), len(group_ids))
            groups[(p, of_whole)] = (gid, g_hosts, g_room)
    cost_cache: dict[StarKey, tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]] = {}

    def star_key(p: int, k: int, whole: bool = False) -> StarKey:
        """What stage p's pairs cost over k sites depends on: its sync volume and steps,
        and its hosts and their rooms (with `whole`, those of whole replicas)."""
        return (w.dp_wan_per_leader(p, k), w.dp_wan_steps(k), groups[(p, whole)][0], k)

    def pair_cost(
        p: int, k: int, whole: bool = False
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
        """(WAN phase of each pair of stage p's hosts if the stage spans k sites, their
        rooms). A pair costs its cheaper direction: the plan's ring order picks which one
        is paid. The diagonal is inf."""
        key = star_key(p, k, whole)
        if key not in cost_cache:
            volume, steps, _, _ = key
            _, hosts, room_of = groups[(p, whole)]
            idx = np.ix_(hosts, hosts)
            cost = steps * per_msg[idx] + volume * per_byte[idx]
            cost = np.minimum(cost, cost.T)
            np.fill_diagonal(cost, np.inf)
            cost_cache[key] = (cost, np.array(room_of, dtype=np.int64))
        return cost_cache[key]

    star_cache: dict[StarKey, npt.NDArray[np.float64]] = {}

    def star(p: int, k: int, whole: bool = False) -> npt.NDArray[np.float64]:
        """Per host of stage p (in the order of its hosts; with `whole`, the hosts of whole
        replicas): the least slowest pair of any k sites that include it and can hold
        the stage's dp replicas.

        Such a set Σ ∋ a gives a k − 1 partners that all cost at most the phase and hold,
        with a, dp replicas: so the phase is at least the least cost c such that a's
        partners costing ≤ c include k − 1 whose room with a's is ≥ dp. The k − 1 roomiest
        of a prefix have room Σ_v (v − v⁻)·min(k − 1, #partners with room ≥ v) over the
        distinct room values v (layer cake).
        """
        key = star_key(p, k, whole)
        if key in star_cache:
            return star_cache[key]
        cost, room = pair_cost(p, k, whole)
        order = np.argsort(cost, axis=1, kind="stable")
        ranked = np.take_along_axis(cost, order, axis=1)  # partners, cheapest first
        partner_room = room[order]
        values = np.unique(room)
        steps_v = np.diff(np.concatenate([[0], values]))
        # at_least[a, j, v]: partners among a's j + 1 cheapest with room ≥ values[v]. In
        # int32 (counts of sites; (k − 1)·dp per term), half the memory traffic of int64:
        # this cumsum was the bound's largest cost at 128 sites.
        at_least = np.cumsum(
            partner_room[:, :, None] >= values[None, None, :], axis=1, dtype=np.int32
        )
        np.minimum(at_least, k - 1, out=at_least)
        top = (at_least * steps_v.astype(np.int32)[None, None, :]).sum(axis=2, dtype=np.int64)
        enough = (top >= (dp - room)[:, None]) & (np.arange(len(room)) >= k - 2)[None, :]
        enough &= np.isfinite(ranked)
        first = enough.argmax(axis=1)
        ecc = np.where(enough.any(axis=1), ranked[np.arange(len(room)), first], np.inf)
        star_cache[key] = ecc
        return ecc

    clique_cache: dict[StarKey, float] = {}
    # Part A's searches have their own count, so they take none from the other parts'.
    searches = {False: [CLIQUE_SEARCHES], True: [CLIQUE_SEARCHES]}
    cliques_seen: dict[bytes, tuple[int, int]] = {}

    def wan(p: int, k: int, whole: bool = False) -> float:
        """Least slowest pair of any k sites of stage p that can hold its dp replicas
        (with `whole`, dp whole replicas): the star floor, raised by the clique floor
        (the star sees a site's partners, not that they must also be close to each
        other)."""
        ecc = star(p, k, whole)
        floor = float(ecc.min()) if ecc.size else math.inf
        if k < 3 or not math.isfinite(floor):  # two sites: the star is the pair
            return floor
        key = star_key(p, k, whole)
        if key not in clique_cache:
            cost, room = pair_cost(p, k, whole)
            clique_cache[key] = _clique_floor(
                cost, room, k, dp, floor, searches[whole], cliques_seen
            )
        return clique_cache[key]

    def sync(p: int, k: int, whole: bool = False) -> float:
        """Least sync of stage p over exactly k sites (with `whole`, k sites holding
        whole replicas)."""
        intra = 0.0
        if k < dp:  # some site holds two replicas: its in-site reduce and broadcast
            if whole:
                roomy = [fabric[s] for s in sites if whole_room[s] >= 2]
            else:
                roomy = [fabric[s] for s in sites if caps[(p, s)] >= 2]
            intra = w.dp_intra_seconds(p, max(roomy)) if roomy else math.inf
        if k <= 1:
            return intra
        if len(whole_hosts if whole else hosts_of[p]) < k:
            return math.inf
        return intra + wan(p, k, whole)

    kmin = []
    for p in range(pp):
        room = sorted((caps[(p, s)] for s in sites if caps[(p, s)] > 0), reverse=True)
        acc, k = 0, 0
        while acc < dp:
            acc += room[k]
            k += 1
        kmin.append(k)
    kmax = [min(dp, sum(1 for s in sites if caps[(p, s)] > 0)) for p in range(pp)]

    shared = _shared_sync_floor(inst, star, pair_cost, sync, hosts_of, kmin, kmax, caps)

    # (A) whole replicas per site: K sites hold every stage, each whole replicas only, so
    # each stage's sync is over K sites whose whole rooms hold dp.
    whole = sorted(whole_room.values(), reverse=True)
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
            syncs = (sync(p, k, whole=True) for p in range(pp))
            total = (m + pp - 1) * slot + max(shared, *syncs)
            best_a = min(best_a, total)

    # (B) some replica crosses the WAN at some boundary.
    best_b = math.inf
    if pp > 1:
        act = w.activation_bytes
        cheapest_hop = 2 * float(np.min(per_msg + act * per_byte))
        crossing_slot = min(per_stage[q] + cheapest_hop for q in range(pp - 1))
        slot = max(joint, crossing_slot)
        least_sync = max(min(sync(p, k) for k in range(kmin[p], kmax[p] + 1)) for p in range(pp))
        least_sync = max(least_sync, shared)
        best_b = (m + pp - 1) * slot + least_sync

    best_c, best_bc = _sites_per_stage_bound(
        inst, sync, kmin, kmax, joint, per_stage, caps, fabric, shared
    )
    best_b = max(best_b, best_bc)  # both hold when some replica crosses

    best_k = component_bound(inst, joint, per_stage, shared)
    bound = max(min(best_a, best_b), best_c, best_k)
    if not math.isfinite(bound):
        bound = (m + pp - 1) * joint
    return TimeBound(
        seconds=bound * (1 - FLOAT_MARGIN),
        crossing_free=best_a,
        crossing=best_b,
        compute=joint,
        sites_per_stage=best_c,
        shared_sync=shared,
        components=best_k,
    )


def _sites_per_stage_bound(
    inst: Instance,
    sync: Callable[[int, int], float],
    kmin: list[int],
    kmax: list[int],
    joint: float,
    per_stage: list[float],
    caps: dict[tuple[int, str], int],
    fabric: dict[str, float],
    shared: float = 0.0,
) -> tuple[float, float]:
    """(C) The trade between few sites per stage (cheap sync) and crossings (slow hops).

    Say stage p spans k_p sites. Its sync is at least sync(p, k_p), so D ≥ d :=
    max_p sync(p, k_p), and every k_p lies in K_p(d) = {k : sync(p, k) ≤ d}. At boundary
    p, replicas stay in a site only where it holds both stages: at most min(k_p, k_p+1)
    sites, each keeping at most u_s = min(⌊slots_s / 2⌋, room of p, room of p + 1) (the
    two stages share its slots); and a site holding n of stage p keeps at most slots − n
    for stage p + 1, so the stays are also at most (slots of the k_p roomiest sites that
    can host p) − dp, and likewise from p + 1. So at least x = dp − (the least of these)
    replicas cross, over at most k_p·k_p+1 pairs of sites: some pair carries
    ⌈x / (k_p·k_p+1)⌉ of them, and c replicas on a WAN pair take at least α + β·c per
    micro-batch with α, β the least over pairs (`time_flows.hop_coefficients`) — and, from
    the pairs' own α, β, at least the floor of `_carried_hop` (what k_p sites can send to
    k_p+1 sites within a hop time, each over its own fastest pairs); with no
    crossing, some site still moves ⌈dp / min(k_p, k_p+1)⌉ through its fabric. Boundary p
    is therefore at least H_p(d), the least of that over k_p ∈ K_p(d), k_p+1 ∈ K_p+1(d),
    and no placement is faster than min over d of (m + pp − 1)·max(joint compute,
    max_p(compute_p + H_p(d))) + d, d ranging over the values sync(p, k) (the true d is
    one of them).

    Returns (C, C_B): C_B is the same bound for the placements in which some replica
    crosses the WAN at some boundary q, whose hop is then also at least one replica's
    α + β (case B); the least over q of that is added to the slot.
    """
    w = inst.workload
    dp, pp, m = inst.dp, inst.pp, w.micro_batches
    if pp < 2:
        return 0.0, 0.0
    alpha, beta = hop_coefficients(inst)
    off = ~np.eye(len(inst.sites), dtype=bool) & np.isfinite(alpha)
    if not off.any():
        return 0.0, 0.0
    a_min, b_min = float(alpha[off].min()), float(beta[off].min())
    best_fabric = max(fabric.values())
    ks = range(1, dp + 1)
    table = {(p, k): sync(p, k) for p in range(pp) for k in range(kmin[p], kmax[p] + 1)}
    # H[p][i, j]: least boundary-p hop with k_p = i + 1 sites and k_p+1 = j + 1.
    hops = []
    # top[p][k]: slots of the k roomiest sites that can host stage p (see the docstring).
    top = []
    for p in range(pp):
        room = sorted((inst.site_slots(s) for s in inst.sites if caps[(p, s)] > 0), reverse=True)
        top.append(np.cumsum([0, *room]))
    caps_p = [np.array([caps[(p, s)] for s in inst.sites], dtype=np.int64) for p in range(pp)]
    for p in range(pp - 1):
        keep = sorted(
            (min(inst.site_slots(s) // 2, caps[(p, s)], caps[(p + 1, s)]) for s in inst.sites),
            reverse=True,
        )
        stays = np.cumsum([0, *keep])  # stays[c]: most replicas staying in c sites
        i = np.arange(1, dp + 1)[:, None]  # k_p
        j = np.arange(1, dp + 1)[None, :]  # k_p+1
        common = np.minimum(i, j)
        most = np.minimum(
            stays[np.minimum(common, len(keep))],
            np.minimum(
                top[p][np.minimum(i, len(top[p]) - 1)] - dp,
                top[p + 1][np.minimum(j, len(top[p + 1]) - 1)] - dp,
            ),
        )
        cross = dp - np.maximum(0, most)
        # Inside a site: some site moves ⌈dp / common⌉ replicas through its fabric.
        local = np.array([w.hop_seconds(None, -(-dp // c), best_fabric) for c in range(1, dp + 1)])
        spread = a_min + b_min * np.ceil(np.maximum(cross, 0) / (i * j))
        carried = _carried_hop(alpha, beta, caps_p[p], caps_p[p + 1], cross)
        # No crossing forced is not none made: a placement may still send some replicas
        # over the WAN (a WAN link can beat a slow site fabric), so the hop is then at
        # least the cheaper of the in-site one and one replica's cheapest WAN hop.
        h = np.where(
            cross > 0, np.maximum(spread, carried), np.minimum(local[common - 1], a_min + b_min)
        )
        hops.append(h)
    one_hop = a_min + b_min
    best, best_crossing = math.inf, math.inf
    for d in sorted({v for v in table.values() if math.isfinite(v)}):
        allowed = [np.array([table.get((p, k), math.inf) <= d for k in ks]) for p in range(pp)]
        if not all(a.any() for a in allowed):
            continue
        least = [float(hops[p][np.ix_(allowed[p], allowed[p + 1])].min()) for p in range(pp - 1)]
        slot = max(joint, *(per_stage[p] + least[p] for p in range(pp - 1)))
        crossing = min(per_stage[q] + max(least[q], one_hop) for q in range(pp - 1))
        sync_floor = max(d, shared)  # D ≥ d and D ≥ the shared floor
        best = min(best, (m + pp - 1) * slot + sync_floor)
        best_crossing = min(best_crossing, (m + pp - 1) * max(slot, crossing) + sync_floor)
    return best, best_crossing


#: Hop levels tried by `_carried_hop`, geometrically spaced (the bound may fall short of
#: the least feasible level by one step of the grid, never exceed it).
HOP_GRID = 96


def _carried_hop(
    alpha: npt.NDArray[np.float64],
    beta: npt.NDArray[np.float64],
    room_from: npt.NDArray[np.int64],
    room_to: npt.NDArray[np.int64],
    cross: npt.NDArray[np.int64],
) -> npt.NDArray[np.float64]:
    """[i − 1, j − 1]: a floor on the slowest WAN hop when `cross[i − 1, j − 1]` replicas
    cross from a stage on i sites to the next on j (0 where nothing is claimed).

    At hop time h a pair a ≠ b carries at most cap_ab(h) = ⌊(h − α_ab)/β_ab⌋ replicas
    within h. A site a of the first stage sends to at most j sites of the next, so at
    most min(room_a, the sum of its j largest caps); the i sites of the stage send at
    most the sum of the i largest of those, and likewise from the receiving side. If
    that is below the crossing replicas, every placement with those counts has a hop
    above h; the largest such h of a geometric grid is the floor.
    """
    n = len(room_from)
    dp_i, dp_j = cross.shape
    off = ~np.eye(n, dtype=bool) & np.isfinite(alpha)
    out = np.zeros(cross.shape)
    if not off.any() or not (cross > 0).any():
        return out
    most = int(max(room_from.max(), room_to.max(), 1))
    lo = float((alpha[off] + beta[off]).min())
    hi = float((alpha[off] + beta[off] * most).max())
    if not hi > lo:
        return out
    ks_i = np.minimum(np.arange(1, dp_i + 1), n)
    ks_j = np.minimum(np.arange(1, dp_j + 1), n)
    for h in np.geomspace(lo, hi, HOP_GRID):
        with np.errstate(invalid="ignore", divide="ignore"):
            cap = np.floor((h - alpha) / beta * (1 + 1e-12) + 1e-9)
        cap = np.where(off & np.isfinite(cap), np.clip(cap, 0, most), 0)
        rows = np.cumsum(-np.sort(-cap, axis=1), axis=1)  # [a, j − 1]: top j of row a
        cols = np.cumsum(-np.sort(-cap, axis=0), axis=0)  # [i − 1, b]: top i of column b
        send = np.minimum(room_from[:, None], rows)  # [a, j − 1]
        take = np.minimum(room_to[None, :], cols)  # [i − 1, b]
        by_senders = np.cumsum(-np.sort(-send, axis=0), axis=0)  # [i − 1, j − 1]
        by_takers = np.cumsum(-np.sort(-take, axis=1), axis=1)  # [i − 1, j − 1]
        total = np.minimum(
            by_senders[np.ix_(ks_i - 1, ks_j - 1)], by_takers[np.ix_(ks_i - 1, ks_j - 1)]
        )
        short = total < cross
        if not short.any():
            break
        out = np.where(short, h, out)
    return out


def peel(
    near: npt.NDArray[np.bool_],
    room: npt.NDArray[np.int64],
    alive: npt.NDArray[np.bool_],
    k: int,
    need: int,
    equal_rooms: bool = False,
) -> npt.NDArray[np.bool_]:
    """The sites of `alive` that may belong to k sites, pairwise `near`, holding `need`.

    Drops, until none is dropped, every site without k − 1 surviving `near` partners
    whose k − 1 roomiest hold, with it, `need`. A member of such a set always keeps its
    k − 1 fellow members (never dropped, by induction), so it is never dropped.
    `equal_rooms`: every room is the same and k of them hold `need` (the caller's k ≥
    kmin), so only the partner count is checked.
    """
    n = len(room)
    while True:
        linked = near & alive[None, :] & alive[:, None]
        np.fill_diagonal(linked, False)
        keep: npt.NDArray[np.bool_] = alive & (linked.sum(axis=1) >= k - 1)
        if not equal_rooms and k >= 2:
            rooms = np.where(linked, room[None, :], 0)
            top = np.partition(rooms, n - (k - 1), axis=1)[:, n - (k - 1) :]
            keep &= top.sum(axis=1) + room >= need
        elif not equal_rooms:
            keep &= room >= need
        if (keep == alive).all():
            return keep
        alive = keep


def _shared_sync_floor(
    inst: Instance,
    star: Callable[[int, int], npt.NDArray[np.float64]],
    pair_cost: Callable[[int, int], tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]],
    sync: Callable[[int, int], float],
    hosts_of: list[tuple[int, ...]],
    kmin: list[int],
    kmax: list[int],
    caps: dict[tuple[int, str], int],
) -> float:
    """(S) A floor on the exposed sync D of every placement, with the stages sharing slots.

    The per-stage parts bound each stage's sync as if it had every site to itself. But a
    site's slots serve all stages. In a placement with D ≤ d, stage p spans a set Σ of
    k sites whose slowest pair costs at most c = d − (its in-site phase, as in `sync`):
    Σ is a clique of the graph G_c of the pairs costing ≤ c, and holds dp replicas. So
    every member of Σ has k − 1 neighbours in G_c that are members too, and its room
    with theirs is ≥ dp. Peeling G_c — dropping, until none is left to drop, every site
    without k − 1 remaining neighbours whose k − 1 roomiest hold, with it, dp — never
    drops a member of Σ (by induction: its partners are never dropped either). Call the
    survivors, over every k, *eligible* for p at d (k = 1: the site holds all dp alone;
    `star(p, k)` is the first round of the peeling, computed once). Every shard then
    sits on a node group of a site eligible for its stage, so a max-flow (stage → node
    groups that fit it at eligible sites → group slots) carries all dp·pp shards. The
    least d at which it does is a floor on D. Eligibility only grows with d and changes
    only at a pair's cost plus its in-site part, so a binary search over those values
    finds it: first with the first round alone (cheap; its change points are the
    `star` values), then, from that answer up, with the peeling.
    """
    dp, pp = inst.dp, inst.pp
    n = len(inst.sites)
    site_index = {s: i for i, s in enumerate(inst.sites)}
    # in_site[p][k] + star(p, k): the least d at which a host survives the first round.
    first = np.full((pp, n), np.inf)
    rounds: list[list[tuple[int, float, npt.NDArray[np.float64]]]] = []
    for p in range(pp):
        hosts = np.array(hosts_of[p], dtype=np.int64)
        in_site = sync(p, 1)  # with one site, the sync is its in-site phase alone
        mine = []
        for k in range(kmin[p], kmax[p] + 1):
            if k == 1:
                whole = [i for i in hosts_of[p] if caps[(p, inst.sites[i])] >= dp]
                first[p, whole] = np.minimum(first[p, whole], in_site)
                continue
            extra = in_site if k < dp else 0.0  # the in-site part `sync` adds
            at = extra + star(p, k)
            first[p, hosts] = np.minimum(first[p, hosts], at)
            if np.isfinite(at).any():
                mine.append((k, extra, at))
        rounds.append(mine)
    values = np.unique(first[np.isfinite(first)])
    groups = [g for g in inst.groups if g.slots > 0]
    uniform = [len({caps[(p, inst.sites[i])] for i in hosts_of[p]}) <= 1 for p in range(pp)]

    def eligible(d: float) -> npt.NDArray[np.bool_]:
        out = np.zeros((pp, n), dtype=bool)
        for p in range(pp):
            hosts = np.array(hosts_of[p], dtype=np.int64)
            whole = [i for i in hosts_of[p] if caps[(p, inst.sites[i])] >= dp]
            if whole and sync(p, 1) <= d:
                out[p, whole] = True
            for k, extra, at in rounds[p]:
                if out[p, hosts].all():
                    break  # every host is eligible already
                alive = at <= d
                if not alive.any():
                    continue
                cost, room = pair_cost(p, k)
                # extra + cost, as the change points are computed: d − extra may round
                # below a cost whose sum with extra is exactly d, and drop its pair.
                alive = peel(extra + cost <= d, room, alive, k, dp, uniform[p])
                out[p, hosts[alive]] = True
        return out

    def carries_all(d: float, peeled: bool) -> bool:
        ok = eligible(d) if peeled else first <= d
        flow = max_flow.SimpleMaxFlow()
        source, sink = pp + len(groups), pp + len(groups) + 1
        for p in range(pp):
            flow.add_arc_with_capacity(source, p, dp)
        for j, g in enumerate(groups):
            flow.add_arc_with_capacity(pp + j, sink, g.slots)
            for p in range(pp):
                if inst.fits[p][g.index] and ok[p, site_index[g.site]]:
                    flow.add_arc_with_capacity(p, pp + j, g.slots)
        return bool(flow.solve(source, sink) == flow.OPTIMAL and flow.optimal_flow() == dp * pp)

    def least_carrying(
        points: npt.NDArray[np.float64], peeled: bool, gallop: bool = False
    ) -> float | None:
        """The least of the sorted `points` at which the flow carries all (None: none).

        `gallop`: the answer is expected near the start, so brackets 1, 2, 4, … first.
        """
        lo, hi, found = 0, len(points) - 1, None
        if gallop:
            step = 1
            while lo + step - 1 < hi and not carries_all(float(points[lo + step - 1]), peeled):
                lo, step = lo + step, step * 2
            hi = min(hi, lo + step - 1)
        while lo <= hi:
            mid = (lo + hi) // 2
            if carries_all(float(points[mid]), peeled):
                found, hi = float(points[mid]), mid - 1
            else:
                lo = mid + 1
        return found

    # The first round changes only at the `first` values and the peeling only at some
    # pair's cost plus its in-site part: searching each among its own change points keeps
    # the answer a floor (a placement with D is carried at the last change point ≤ D).
    # First-round eligibility contains the peeled one, so its answer starts the second.
    best = least_carrying(values, peeled=False)
    if best is None:
        return 0.0  # nothing carries: no claim
    changes = [values]
    for p in range(pp):
        for k, extra, _ in rounds[p]:
            cost, _ = pair_cost(p, k)
            changes.append(extra + np.unique(cost[np.isfinite(cost)]))
    points = np.unique(np.concatenate(changes))
    peeled_best = least_carrying(points[points >= best], peeled=True, gallop=True)
    if peeled_best is not None:
        best = peeled_best
    return best
