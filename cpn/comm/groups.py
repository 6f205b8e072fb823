"""Process groups for site-aware gradient sync, derived from a rank → site map.

For each data-parallel group (all ranks, for a plain DDP job; one per (stage, tensor-
parallel index) in the 3D runtime):
  - one *site group* per site: the group's ranks at that site, lowest rank first (the
    *site leader*);
  - one *leader group*: the leaders, in the order of each site's first rank (the cost
    model's ring order, so per-link byte predictions line up);
  - for the *sharded* hierarchy (Horovod's hierarchical all-reduce), one *shard group* per
    local index: the j-th rank of every site. It needs the same number of ranks at every
    site, because each local rank owns one shard of the gradient across sites.
`torch.distributed.new_group` is collective over the whole world: every process creates
every group in the same order, member or not, so `build_site_groups` and `new_groups` must
be called by all ranks with the same arguments.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Member:
    """A process group as one of its members sees it."""

    handle: dist.ProcessGroup | None  # None when the group is this rank alone
    ranks: tuple[int, ...]  # global ranks, in group order
    position: int  # this rank's index in `ranks`

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def backend(self) -> str:
        """ "gloo" or "nccl": what really goes on the wire depends on it (`cpn.wire`)."""
        if self.handle is None:
            return "none"
        return str(dist.get_backend(self.handle))

    def group_rank(self, position: int) -> int:
        """The global rank at `position` (what `dist.reduce(dst=…)` expects)."""
        return self.ranks[position]


@dataclass(frozen=True)
class SiteGroups:
    """The groups one rank uses to sync its data-parallel group."""

    ranks: tuple[int, ...]  # the data-parallel group, global ranks in order
    site_of: tuple[str, ...]  # the site of each of `ranks`
    sites: tuple[str, ...]  # the group's sites, in order of their first rank
    site: str  # this rank's site
    flat: Member  # the whole data-parallel group (the flat ring)
    local: Member  # this rank's site; position 0 is the site leader
    leaders: Member | None  # the site leaders; None on ranks that are not leaders
    shard: Member | None  # sharded hierarchy: the same local index at every site

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def even(self) -> bool:
        """Every site holds the same number of the group's ranks."""
        counts = {self.site_of.count(s) for s in self.sites}
        return len(counts) == 1

    def site_of_rank(self, rank: int) -> str:
        return self.site_of[self.ranks.index(rank)]


def _check_map(site_of_rank: Sequence[str], world: int) -> list[str]:
    sites = list(site_of_rank)
    if len(sites) != world:
        raise ValueError(
            f"site_of_rank: gives a site for {len(sites)} ranks, but the world has {world}"
        )
    for rank, site in enumerate(sites):
        if not isinstance(site, str) or not site:
            raise ValueError(f"site_of_rank[{rank}]: must be a non-empty site name, got {site!r}")
    return sites


def _check_members(members: Sequence[Sequence[int]], world: int) -> list[tuple[int, ...]]:
    out = [tuple(int(r) for r in group) for group in members]
    seen: set[int] = set()
    for i, group in enumerate(out):
        if not group:
            raise ValueError(f"groups[{i}]: is empty")
        for r in group:
            if not 0 <= r < world:
                raise ValueError(f"groups[{i}]: rank {r} is outside the world of {world}")
            if r in seen:
                raise ValueError(f"groups[{i}]: rank {r} is in more than one group")
            seen.add(r)
    return out


def _new(ranks: Sequence[int], timeout: datetime.timedelta | None) -> dist.ProcessGroup | None:
    if len(ranks) <= 1:
        return None
    group: dist.ProcessGroup = dist.new_group(list(ranks), timeout=timeout)
    return group


def new_groups(
    groups: Sequence[Sequence[int]], *, timeout: datetime.timedelta | None = None
) -> Member:
    """Create every group of a partition of the world (collectively); return this rank's.

    `groups` lists disjoint groups of global ranks that cover this rank (tensor-parallel
    groups, say). Every rank calls it with the same arguments.
    """
    if not dist.is_initialized():
        raise RuntimeError("new_groups: torch.distributed is not initialised")
    world, me = dist.get_world_size(), dist.get_rank()
    mine: Member | None = None
    for ranks in _check_members(groups, world):
        handle = _new(ranks, timeout)
        if me in ranks:
            mine = Member(handle, ranks, ranks.index(me))
    if mine is None:
        raise ValueError(f"groups: rank {me} is in none of the groups")
    return mine


def build_site_groups(
    site_of_rank: Sequence[str],
    groups: Sequence[Sequence[int]] | None = None,
    *,
    timeout: datetime.timedelta | None = None,
) -> SiteGroups:
    """Create the site-aware groups of every data-parallel group; return this rank's.

    `site_of_rank[r]` is the site of global rank r and must cover the whole world.
    `groups` lists the data-parallel groups (disjoint lists of global ranks); by default
    the whole world is one group. Collective: every rank calls it with the same arguments.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_site_groups: torch.distributed is not initialised")
    world, me = dist.get_world_size(), dist.get_rank()
    sites_by_rank = _check_map(site_of_rank, world)
    members = _check_members(groups if groups is not None else [range(world)], world)
    mine: SiteGroups | None = None
    for ranks in members:
        site_of = tuple(sites_by_rank[r] for r in ranks)
        order = tuple(dict.fromkeys(site_of))
        at_site = {
            s: tuple(r for r, rs in zip(ranks, site_of, strict=True) if rs == s) for s in order
        }
        flat = _new(ranks, timeout)
        local = {s: _new(at_site[s], timeout) for s in order}
        leader_ranks = tuple(at_site[s][0] for s in order)
        leaders = _new(leader_ranks, timeout)
        counts = {len(v) for v in at_site.values()}
        shards: list[tuple[tuple[int, ...], dist.ProcessGroup | None]] = []
        if len(counts) == 1 and len(order) > 1:
            for j in range(counts.pop()):
                shard_ranks = tuple(at_site[s][j] for s in order)
                shards.append((shard_ranks, _new(shard_ranks, timeout)))
        if me not in ranks:
            continue
        site = sites_by_rank[me]
        local_ranks = at_site[site]
        pos = local_ranks.index(me)
        shard = next(
            (Member(h, sr, sr.index(me)) for sr, h in shards if me in sr),
            None,
        )
        mine = SiteGroups(
            ranks=ranks,
            site_of=site_of,
            sites=order,
            site=site,
            flat=Member(flat, ranks, ranks.index(me)),
            local=Member(local[site], local_ranks, pos),
            leaders=Member(leaders, leader_ranks, leader_ranks.index(me)) if pos == 0 else None,
            shard=shard,
        )
    if mine is None:
        raise ValueError(f"groups: rank {me} is in none of the data-parallel groups")
    return mine
