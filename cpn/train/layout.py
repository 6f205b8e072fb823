"""Where every worker of a plan sits, and which workers it talks to.

The rank layout is the plan's (`Plan.ranks()`: tensor-parallel index fastest, then
replica, then stage). From it:
  - a tensor-parallel group per (stage, replica): the tp workers of one shard, one node;
  - pipeline neighbours: the same replica and tp index one stage up or down;
  - a data-parallel group per (stage, tp index): that slice of every replica.
The process groups themselves are made by `cpn.comm` (`new_groups`, `build_site_groups`)
from these rank lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from cpn.comm import LinkClass
from cpn.contracts.plan import Plan, RankInfo, rank_of


@dataclass(frozen=True)
class Layout:
    plan: Plan
    rank: int

    @cached_property
    def workers(self) -> list[RankInfo]:
        return self.plan.ranks()

    @property
    def world(self) -> int:
        return self.plan.parallel.world_size

    @property
    def me(self) -> RankInfo:
        return self.workers[self.rank]

    @property
    def site_of_rank(self) -> list[str]:
        return [w.site for w in self.workers]

    @cached_property
    def tp_groups(self) -> list[tuple[int, ...]]:
        p = self.plan.parallel
        return [
            tuple(rank_of(p, r, s, t) for t in range(p.tp))
            for s in range(p.pp)
            for r in range(p.dp)
        ]

    @cached_property
    def dp_groups(self) -> list[tuple[int, ...]]:
        p = self.plan.parallel
        return [
            tuple(rank_of(p, r, s, t) for r in range(p.dp))
            for s in range(p.pp)
            for t in range(p.tp)
        ]

    @property
    def prev_rank(self) -> int | None:
        me = self.me
        if me.stage == 0:
            return None
        return rank_of(self.plan.parallel, me.replica, me.stage - 1, me.tp_index)

    @property
    def next_rank(self) -> int | None:
        me = self.me
        if me.stage == self.plan.parallel.pp - 1:
            return None
        return rank_of(self.plan.parallel, me.replica, me.stage + 1, me.tp_index)

    def pipeline_class(self, peer: int) -> LinkClass:
        """The cost model counts pipeline hops by site only (same node is intra-site)."""
        return "wan" if self.me.site != self.workers[peer].site else "intra_site"
