"""The WAN-bytes objective in terms of per-site patterns.

For shard counts n[p, s] (a pattern per site), with the replicas matched across stages so
that as many as possible stay in their site (what the flows do at the optimum), the WAN
bytes per iteration are exactly

    B·(pp − 1)·dp  −  B·Σ_s Σ_{p<pp−1} min(n[p, s], n[p+1, s])  +  Σ_p c_p(k_p)

with B = `Workload.boundary_bytes` (one replica crossing one stage boundary), k_p the sites
holding stage p and c_p(k) = `Workload.dp_wan_bytes(p, k)`, convex in k (linear dense, a
quadratic for top-k). Every crossing replica can reach its next stage's site because the
instance is one WAN component, and the bytes do not depend on the route.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from itertools import pairwise

from cpn.scheduler.instance import Instance
from cpn.scheduler.patterns.classes import Pattern, SiteClass, site_classes, stays
from cpn.scheduler.realize import Counts


@dataclass(frozen=True)
class PatternProblem:
    dp: int
    pp: int
    #: B: bytes one replica sends across one stage boundary per iteration.
    boundary: int
    #: c_p(k): data-parallel WAN bytes of stage p synced over k sites, k = 0 … kmax[p].
    sync: tuple[tuple[int, ...], ...]
    #: Fewest and most sites any placement can spread stage p over.
    kmin: tuple[int, ...]
    kmax: tuple[int, ...]
    classes: tuple[SiteClass, ...]
    #: gcd of every byte count in the objective: WAN bytes are always a multiple of it.
    unit: int

    @property
    def crossing_all(self) -> int:
        """B·(pp − 1)·dp: the pipeline bytes if no replica stayed in any site."""
        return self.boundary * (self.pp - 1) * self.dp

    def wan_bytes(self, patterns: Mapping[str, Sequence[int]]) -> int:
        """Exact WAN bytes of a placement given as one pattern per site."""
        staying = sum(stays(a) for a in patterns.values())
        k = [sum(1 for a in patterns.values() if a[p] > 0) for p in range(self.pp)]
        sync = sum(self.sync[p][k[p]] for p in range(self.pp))
        return self.crossing_all - self.boundary * staying + sync

    def sync_floor(self, p: int, per_site: float) -> float:
        """min over k in [kmin, kmax] of c_p(k) + per_site·k."""
        return min(self.sync[p][k] + per_site * k for k in range(self.kmin[p], self.kmax[p] + 1))


def pattern_problem(inst: Instance) -> PatternProblem:
    w = inst.workload
    dp, pp = inst.dp, inst.pp
    classes = tuple(site_classes(inst))
    caps = [c for cls in classes for c in [cls.caps] * cls.size]
    kmin, kmax, sync = [], [], []
    for p in range(pp):
        room = sorted((c[p] for c in caps if c[p] > 0), reverse=True)
        lo, acc = 0, 0
        while acc < dp and lo < len(room):
            acc += room[lo]
            lo += 1
        hi = min(dp, len(room))
        kmin.append(max(1, lo))
        kmax.append(max(1, hi))
        table = tuple(w.dp_wan_bytes(p, k) for k in range(hi + 1))
        steps = [b - a for a, b in pairwise(table)]
        if any(y < x for x, y in pairwise(steps)):
            raise ValueError(f"stage {p}: data-parallel WAN bytes are not convex in the sites")
        sync.append(table)
    unit = reduce(math.gcd, [w.boundary_bytes, *(v for t in sync for v in t)]) or 1
    return PatternProblem(
        dp, pp, w.boundary_bytes, tuple(sync), tuple(kmin), tuple(kmax), classes, unit
    )


def assign(
    problem: PatternProblem, per_class: Mapping[int, Sequence[Pattern]]
) -> dict[str, Pattern]:
    """One pattern per site from the patterns each class uses (as many as it has sites).

    Larger patterns go to the class's first sites: for WAN bytes any order is as good,
    and a fixed one keeps plans deterministic.
    """
    out: dict[str, Pattern] = {}
    for cls in problem.classes:
        chosen = sorted(per_class.get(cls.index, ()), key=lambda a: (-sum(a), a))
        chosen += [(0,) * problem.pp] * (cls.size - len(chosen))
        out.update(zip(cls.sites, chosen, strict=True))
    return out


def patterns_of(inst: Instance, counts: Counts) -> dict[str, Pattern]:
    """The pattern of every candidate site (all zeros where the placement puts nothing)."""
    per_site = counts.per_site(inst)
    return {s: tuple(per_site.get((p, s), 0) for p in range(inst.pp)) for s in inst.sites}


def counts_of(inst: Instance, patterns: Mapping[str, Sequence[int]]) -> Counts:
    """Shard counts per node group for one pattern per site (flows left to fill in).

    In a site with several kinds of node, the stages that fit the fewest kinds go first,
    each onto the least capable kind that fits it (then the fastest): with nested fit sets
    this succeeds whenever the pattern passes `SiteClass.holds`.
    """
    shards: dict[tuple[int, int], int] = {}
    for site, pattern in patterns.items():
        groups = inst.groups_of(site)
        room = {g.index: g.slots for g in groups}

        fitted = [sum(1 for g in groups if inst.fits[p][g.index]) for p in range(inst.pp)]
        for p in sorted(range(inst.pp), key=lambda q: (fitted[q], q)):
            need = pattern[p]
            kinds = [g for g in groups if inst.fits[p][g.index]]
            kinds.sort(
                key=lambda g: (
                    sum(inst.fits[q][g.index] for q in range(inst.pp)),
                    -g.spec.gpu.tflops,
                    g.index,
                )
            )
            for g in kinds:
                take = min(need, room[g.index])
                if take:
                    shards[(p, g.index)] = shards.get((p, g.index), 0) + take
                    room[g.index] -= take
                    need -= take
            if need:
                raise ValueError(f"site {site}: pattern {tuple(pattern)} does not fit its nodes")
    return Counts(shards)
