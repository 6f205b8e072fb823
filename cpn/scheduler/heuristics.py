"""Constructive placements that give the solver a good start on large instances.

Good placements for WAN bytes are made of *blocks*: a block is L consecutive stages of
one replica inside one site. L = pp is whole replicas per site (no pipeline traffic on
the WAN, but every stage syncs gradients over every site used); L = 1 is stage-major (each
stage's gradients stay in a site or two, but every replica crosses the WAN at every stage
boundary). In between, a site holding r replicas × L stages trades the two: a replica
crosses pp/L − 1 times and each stage spans about dp/r sites. Which L wins depends on the
model, the batch and the compression, so every L dividing pp is tried, together with
`chain_fill` and the baselines, and the best one (by the cost model) hints the solver.
"""

from __future__ import annotations

from functools import partial

from cpn.contracts.plan import ShardPlacement
from cpn.scheduler.instance import Instance
from cpn.scheduler.pool import FreeGpus


def _by_size(inst: Instance) -> list[str]:
    return sorted(inst.sites, key=lambda s: (-inst.site_slots(s), inst.site_index[s]))


def _room_for(room: FreeGpus, site: str, stage: int) -> int:
    return room.slots(site, stage)


def _sorted(out: list[ShardPlacement]) -> list[ShardPlacement]:
    return sorted(out, key=lambda s: (s.stage, s.replica))


def blocks(inst: Instance, length: int) -> list[ShardPlacement] | None:
    """Blocks of `length` consecutive stages, block by block, into the largest sites.

    All replicas' first block, then all replicas' second block, …, each block placed whole
    in the current site if it has room for all its stages, else in the next site. What
    cannot be placed whole is placed stage by stage in the roomiest sites.
    """
    room = FreeGpus(inst)
    sites = _by_size(inst)
    out: list[ShardPlacement] = []
    starts = range(0, inst.pp, length)
    cursor = 0
    for first in starts:
        stages = range(first, min(first + length, inst.pp))
        for r in range(inst.dp):
            for step in range(len(sites)):
                site = sites[(cursor + step) % len(sites)]
                got = [room.take(site, p) for p in stages]
                if all(g is not None for g in got):
                    for p, g in zip(stages, got, strict=True):
                        assert g is not None
                        out.append(
                            ShardPlacement(replica=r, stage=p, site=site, node=g[0], gpus=g[1])
                        )
                    cursor = (cursor + step) % len(sites)
                    break
                for g in got:
                    if g is not None:
                        room.give_back(site, *g)
            else:
                for p in stages:
                    site = max(sites, key=partial(_room_for, room, stage=p))
                    g = room.take(site, p)
                    if g is None:
                        return None
                    out.append(ShardPlacement(replica=r, stage=p, site=site, node=g[0], gpus=g[1]))
    return _sorted(out)


def chain_fill(inst: Instance) -> list[ShardPlacement] | None:
    """Replicas laid end to end through the largest sites: few sites, few crossings.

    Like the naive greedy but over sites sorted by size, so the job touches as few sites
    as its size allows and a replica crosses the WAN only where a site fills up.
    """
    room = FreeGpus(inst)
    out: list[ShardPlacement] = []
    sites = _by_size(inst)
    for r in range(inst.dp):
        for p in range(inst.pp):
            for site in sites:
                got = room.take(site, p)
                if got:
                    out.append(
                        ShardPlacement(replica=r, stage=p, site=site, node=got[0], gpus=got[1])
                    )
                    break
            else:
                return None
    return _sorted(out)


def block_lengths(pp: int) -> list[int]:
    return [d for d in range(1, pp + 1) if pp % d == 0]
