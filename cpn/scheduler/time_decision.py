"""The decision version of the iteration-time problem, relaxed so that INFEASIBLE is a proof.

For a sync level `d` and a target `B` the model asks for a placement of some consecutive
stages in which every stage's sync is at most `d` and every boundary between them is at
most `(B − d) / (m + pp − 1)` less the stage's least compute (the cost model's iteration
time is `(m + pp − 1)·S + D`, `costmodel.evaluate`). Its variables: the shards of each stage
per site, whether the site holds the stage, the number of sites per stage, and the replicas
each pair of sites carries across each boundary (a bottleneck transportation problem per
boundary, as in `time_flows`). It is the integer argument about which clusters of sites can
follow which that docs/scheduler.md §7 ("Known limit") says the bound lacks. What it
relaxes, each an over-approximation of what placements can do:

  - a site's node groups are pooled: per stage the slots that fit it, and Hall's condition
    over the kinds of node (`SiteClass.holds`), which the site's nodes may still not meet
    when the stages' fit sets are not nested;
  - a stage's compute is its least possible (`time_bound._compute_floor`, per stage), and
    the slot's other terms (the last stage's compute, the joint compute) are dropped;
  - a pair of sites may share a stage spanning k sites when its cheaper direction's WAN
    phase for k sites, plus the in-site phase when k < dp (some site then holds two
    replicas), is ≤ d — the terms of `time_bound`'s `sync`; a stage on one site is not
    checked against d;
  - a boundary pair may carry c replicas when α + β·c ≤ the limit up to a relative 1e-9
    (ties allowed);
  - stages outside the chosen range are dropped (they would only take slots).

So a placement with D ≤ d and slot ≤ (B − d)/(m + pp − 1) is a solution. Placements whose
D lies in [d, d'), d' the next value at which some pair's allowed sizes change, have the
allowed pairs of d exactly, so INFEASIBLE at (d, B) shows each of them has a slot above
(B − d)/(m + pp − 1), hence an iteration time above B.

Not used by the bound: on the 64-site bench instances CP-SAT cannot decide the model over
all stages in 40 s beyond a target 1 s above today's bound, and the two-stage models,
though decided in seconds, cannot lift the homogeneous dense bound past 12.4 s (plan
19.89 s) and need tens of solves for about 10.7 s (bench/README.md). Its solutions are
plans, though: `time_levels` searches it for placements faster than the other searches
find, and `bench/time_decision.py` runs it alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from ortools.sat.python import cp_model

from cpn.scheduler.instance import Instance
from cpn.scheduler.patterns.classes import site_classes
from cpn.scheduler.time_bound import _compute_floor, peel
from cpn.scheduler.time_flows import hop_coefficients, pair_costs


def largest_sizes(inst: Instance, stage: int, sync: float) -> npt.NDArray[np.int64]:
    """Per pair of sites: the largest k for which the pair may share the stage over k sites
    with sync ≤ `sync` (0: none). A pair counts at its cheaper direction (the ring order
    picks which one a plan pays)."""
    w = inst.workload
    per_msg, per_byte = pair_costs(inst)
    fabric = [inst.intra_site_gbps(s) for s in inst.sites if inst.site_slots(s, stage) >= 2]
    in_site = w.dp_intra_seconds(stage, max(fabric)) if fabric else np.inf
    n = len(inst.sites)
    largest = np.zeros((n, n), dtype=np.int64)
    for k in range(2, inst.dp + 1):
        cost = w.dp_wan_steps(k) * per_msg + w.dp_wan_per_leader(stage, k) * per_byte
        cost = np.minimum(cost, cost.T) + (in_site if k < inst.dp else 0.0)
        largest = np.where(cost <= sync, k, largest)
    np.fill_diagonal(largest, 0)
    return largest


def _members(
    largest: npt.NDArray[np.int64], room: npt.NDArray[np.int64], kmax: int, dp: int
) -> npt.NDArray[np.bool_]:
    """The sites that can belong to some set the model allows a stage: k sites, pairwise
    `largest ≥ k`, holding dp together (or one site holding all dp).

    `time_bound.peel` keeps every member of such a set; fixing the others to zero only
    states what the pair constraints already imply, but CP-SAT cannot find it alone (on the
    64-site bench it did not see in 90 s that no six sites were pairwise close enough).
    """
    out: npt.NDArray[np.bool_] = room >= dp
    for k in range(2, min(kmax, len(room)) + 1):  # a set of k sites needs k sites
        out |= peel(largest >= k, room, room > 0, k, dp)
    return out


@dataclass
class Decision:
    """The decision model and its shards per (stage, site index), to read a solution."""

    model: cp_model.CpModel
    held: dict[tuple[int, int], cp_model.IntVar]


def decision_model(inst: Instance, sync: float, bound: float, stages: range) -> Decision:
    """Feasible if some placement of `stages` has sync ≤ `sync` and a slot ≤ (bound −
    sync) / (m + pp − 1); see the module docstring for what is relaxed."""
    w = inst.workload
    dp, pp, m = inst.dp, inst.pp, w.micro_batches
    n = len(inst.sites)
    _, per_stage = _compute_floor(inst)
    alpha, beta = hop_coefficients(inst)
    slot = (bound - sync) / (m + pp - 1)
    model = cp_model.CpModel()
    held: dict[tuple[int, int], cp_model.IntVar] = {}
    there: dict[tuple[int, int], cp_model.IntVar] = {}
    for p in stages:
        largest = largest_sizes(inst, p, sync)
        kmax = max(int(largest.max()), 1)
        room = np.array([min(dp, inst.site_slots(site, p)) for site in inst.sites])
        useful = _members(largest, room, kmax, dp)
        hosts = []
        for s in range(n):
            cap = int(room[s])
            if cap == 0:
                continue
            if not useful[s]:  # implied by the pair constraints below; CP-SAT cannot see it
                cap = 0
            hosts.append(s)
            held[p, s] = model.new_int_var(0, cap, f"n{p}_{s}")
            there[p, s] = model.new_bool_var(f"y{p}_{s}")
            model.add(held[p, s] <= cap * there[p, s])
            model.add(held[p, s] >= there[p, s])
        model.add(sum(held[p, s] for s in hosts) == dp)
        k = model.new_int_var(1, kmax, f"k{p}")
        model.add(sum(there[p, s] for s in hosts) == k)
        for i, a in enumerate(hosts):
            for b in hosts[i + 1 :]:
                if largest[a, b] < 2:
                    model.add_bool_or([there[p, a].Not(), there[p, b].Not()])
                elif largest[a, b] < kmax:
                    model.add(k <= int(largest[a, b])).only_enforce_if([there[p, a], there[p, b]])
    for cls in site_classes(inst):
        # Hall's condition (`SiteClass.holds`): every placement meets it, and so does every
        # solution's pattern, so `time_levels` can place it on the nodes.
        for limited, slots in cls.hall_limits():
            for site in cls.sites:
                s = inst.site_index[site]
                mine = [held[p, s] for p in limited if p in stages and (p, s) in held]
                if mine:
                    model.add(sum(mine) <= slots)
    for s, site in enumerate(inst.sites):
        mine = [held[p, s] for p in stages if (p, s) in held]
        if mine:
            model.add(sum(mine) <= inst.site_slots(site))
    for p in stages:
        if p + 1 not in stages:
            continue
        limit = slot - per_stage[p]
        with np.errstate(invalid="ignore", divide="ignore"):
            most = np.floor((limit - alpha) / beta * (1 + 1e-9) + 1e-9)  # allow ties: a relaxation
        most = np.where(np.isfinite(most), np.clip(most, 0, dp), 0).astype(np.int64)
        out: dict[int, list[cp_model.IntVar]] = {s: [] for s in range(n)}
        into: dict[int, list[cp_model.IntVar]] = {s: [] for s in range(n)}
        for a in range(n):
            for b in range(n):
                if (p, a) in held and (p + 1, b) in held and most[a, b] >= 1:
                    x = model.new_int_var(0, int(most[a, b]), f"x{p}_{a}_{b}")
                    out[a].append(x)
                    into[b].append(x)
        for s in range(n):
            if (p, s) in held:
                model.add(sum(out[s]) == held[p, s])
            if (p + 1, s) in held:
                model.add(sum(into[s]) == held[p + 1, s])
    return Decision(model, held)
