"""Constructive placements that give the solver a good start on large instances.

Two shapes are good for WAN bytes, and which one wins depends on the job:
  - *whole replicas*: every stage of a replica in one site, the largest sites first.
    No pipeline traffic crosses the WAN; gradients are synced over as few sites as can
    hold dp replicas. Best when gradient sync is cheap (top-k) or models are small.
  - *stage-major*: all replicas of stage 0, then stage 1, … poured into the largest sites
    in turn. Each stage's gradients stay in one or two sites; replicas cross the WAN only
    where a site fills up. Best when dense gradients dominate.
The solver is hinted with the better of these and the baselines, then improves on it.
"""

from __future__ import annotations

from cpn.contracts.plan import ShardPlacement
from cpn.scheduler.instance import Instance
from cpn.scheduler.pool import FreeGpus


def _by_size(inst: Instance) -> list[str]:
    return sorted(inst.sites, key=lambda s: (-inst.site_slots(s), inst.site_index[s]))


def whole_replicas(inst: Instance) -> list[ShardPlacement] | None:
    room = FreeGpus(inst)
    out: list[ShardPlacement] = []
    sites = _by_size(inst)
    pp = inst.pp
    placed = 0
    for site in sites:
        while placed < inst.dp:
            # A replica fits if every stage finds a slot (stages may need different GPUs).
            slots = [room.take(site, p) for p in range(pp)]
            if any(x is None for x in slots):
                for x in slots:
                    if x is not None:
                        room.give_back(site, *x)
                break
            for p, x in enumerate(slots):
                assert x is not None
                out.append(ShardPlacement(replica=placed, stage=p, site=site, node=x[0], gpus=x[1]))
            placed += 1
    # What no single site could hold whole: stage by stage, into the roomiest sites.
    for r in range(placed, inst.dp):
        for p in range(pp):
            best = max(sites, key=lambda s: room.slots(s, p))
            got = room.take(best, p)
            if got is None:
                return None
            out.append(ShardPlacement(replica=r, stage=p, site=best, node=got[0], gpus=got[1]))
    return sorted(out, key=lambda s: (s.stage, s.replica))


def stage_major(inst: Instance) -> list[ShardPlacement] | None:
    room = FreeGpus(inst)
    out: list[ShardPlacement] = []
    sites = _by_size(inst)
    cursor = 0
    for p in range(inst.pp):
        for r in range(inst.dp):
            for step in range(len(sites)):
                site = sites[(cursor + step) % len(sites)]
                got = room.take(site, p)
                if got:
                    cursor = (cursor + step) % len(sites)
                    out.append(
                        ShardPlacement(replica=r, stage=p, site=site, node=got[0], gpus=got[1])
                    )
                    break
            else:
                return None
    return sorted(out, key=lambda s: (s.stage, s.replica))


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
    return sorted(out, key=lambda s: (s.stage, s.replica))
