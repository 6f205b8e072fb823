"""Where every worker of a plan sits, and the process groups built from that.

The rank layout is the plan's (`Plan.ranks()`: tensor-parallel index fastest, then
replica, then stage). From it:
  - a tensor-parallel group per (stage, replica): the tp workers of one shard, one node;
  - pipeline neighbours: the same replica and tp index one stage up or down;
  - a data-parallel group per (stage, tp index): that slice of every replica.
`torch.distributed.new_group` is collective over the whole world, so every worker creates
every group, in the same order, whether or not it is a member.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist

from cpn.contracts.plan import Plan, RankInfo, rank_of
from cpn.train.comms import Group


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

    def tp_ranks(self) -> tuple[int, ...]:
        return next(g for g in self.tp_groups if self.rank in g)

    def dp_ranks(self) -> tuple[int, ...]:
        return next(g for g in self.dp_groups if self.rank in g)

    def dp_index(self) -> int:
        return next(i for i, g in enumerate(self.dp_groups) if self.rank in g)

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

    def link_class(self, peer: int) -> str:
        """How bytes to `peer` travel: inside the node, inside the site, or over the WAN."""
        a, b = self.me, self.workers[peer]
        if a.site != b.site:
            return "wan"
        return "intra_node" if a.node == b.node else "intra_site"

    def pipeline_class(self, peer: int) -> str:
        """The cost model counts pipeline hops by site only (same node is intra-site)."""
        return "wan" if self.me.site != self.workers[peer].site else "intra_site"


def new_groups(groups: list[tuple[int, ...]], rank: int) -> Group:
    """Create every group (collectively) and return this worker's membership."""
    mine: Group | None = None
    for ranks in groups:
        handle = dist.new_group(list(ranks)) if len(ranks) > 1 else None
        if rank in ranks:
            mine = Group(handle, ranks, ranks.index(rank))
    assert mine is not None, f"rank {rank} is in none of the groups"
    return mine
