"""Site classes: sites that are interchangeable for the WAN-bytes objective.

What a site can hold is a *pattern*: how many shards of each stage it takes. For WAN bytes
two sites differ only in which patterns they can hold. Where a site's shards go on the WAN
does not matter (the instance is one WAN component, a crossing replica costs its boundary
bytes whatever its route, and the data-parallel bytes depend on the number of sites only),
so sites whose node kinds offer the same slots to the same stages form one class, and the
formulation counts how many sites of a class use each pattern instead of deciding site by
site. On the benchmark networks this turns 64 sites into 1 class (homogeneous) or about 20
(heterogeneous): identical sites no longer make the search branch on which is which.

Which stages a node fits depends on its GPU memory only (`Workload.fits`), so the sets of
stages the node kinds of a site fit are nested: the stages a small GPU fits are a subset of
what a larger one fits. That keeps the exact capacity check (`SiteClass.holds`) small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from cpn.scheduler.instance import Instance

Pattern = tuple[int, ...]
#: The stages a kind of node fits (one flag per stage) and the slots those nodes offer.
Level = tuple[tuple[bool, ...], int]


def stays(pattern: Sequence[int]) -> int:
    """Replicas that stay in the site between consecutive stages: Σ min(a_p, a_{p+1})."""
    return sum(min(a, b) for a, b in pairwise(pattern))


@dataclass(frozen=True)
class SiteClass:
    index: int
    sites: tuple[str, ...]
    levels: tuple[Level, ...]
    #: Shards of stage p one site of the class can hold: its slots that fit p, at most dp.
    caps: tuple[int, ...]
    #: Shards of all stages together one site can hold.
    slots: int

    @property
    def size(self) -> int:
        return len(self.sites)

    @property
    def exact(self) -> bool:
        """Whether `caps` and `slots` describe the patterns exactly (one kind of node).

        With several kinds (GPUs of different memory), pricing works on the patterns that
        satisfy `caps` and `slots` only: a superset of what the site can really hold, so
        every bound and cut computed from it stays valid (a relaxation), and `holds`
        filters what the integer master may choose.
        """
        return len(self.levels) <= 1

    def holds(self, pattern: Sequence[int]) -> bool:
        """Whether one site of the class can hold `pattern` (Hall's condition).

        With nested fit sets, the condition for the most constrained stage sets suffices:
        for every stage q, the shards of the stages that fit only where q fits (or in
        less) must fit in the slots that fit q.
        """
        if any(a > c for a, c in zip(pattern, self.caps, strict=True)):
            return False
        if sum(pattern) > self.slots:
            return False
        return all(sum(pattern[p] for p in stages) <= room for stages, room in self.hall_limits())

    def hall_limits(self) -> list[tuple[tuple[int, ...], int]]:
        """(stages, slots) pairs: the stages that fit only on the kinds of node where some
        stage q fits (q's fit set or a subset of it) hold at most those kinds' slots."""
        pp = len(self.caps)
        fitsets = [
            frozenset(i for i, (fits, _) in enumerate(self.levels) if fits[p]) for p in range(pp)
        ]
        return [
            (
                tuple(p for p in range(pp) if fitsets[p] <= where),
                sum(self.levels[i][1] for i in where),
            )
            for where in sorted(set(fitsets), key=sorted)
        ]


def site_classes(inst: Instance) -> list[SiteClass]:
    """The classes of the instance's candidate sites, in the order of their first site."""
    dp, pp = inst.dp, inst.pp
    by_key: dict[tuple[Level, ...], list[str]] = {}
    for site in inst.sites:
        slots: dict[tuple[bool, ...], int] = {}
        for g in inst.groups_of(site):
            fits = tuple(inst.fits[p][g.index] for p in range(pp))
            if any(fits):
                slots[fits] = slots.get(fits, 0) + g.slots
        key = tuple(sorted(slots.items()))
        by_key.setdefault(key, []).append(site)
    out = []
    for i, (levels, sites) in enumerate(by_key.items()):
        caps = tuple(min(dp, sum(n for fits, n in levels if fits[p])) for p in range(pp))
        slots_total = min(dp * pp, sum(n for _, n in levels))
        out.append(SiteClass(i, tuple(sites), levels, caps, slots_total))
    return out
