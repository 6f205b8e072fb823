"""Baseline placements that every benchmark compares cpn against.

- `greedy`: what a naive operator does: take replicas one by one, each stage on the first
  site (in file order) with a node that still has room.
- `round_robin`: deal shards out to sites in turn, one shard per site.

Both respect the same constraints as the solver (capacity, a tensor-parallel group inside
one node, memory per stage, allowed sites and GPU model) and return None when their order
of filling paints them into a corner.
"""

from __future__ import annotations

from cpn.contracts.plan import ShardPlacement
from cpn.scheduler.instance import Instance
from cpn.scheduler.pool import FreeGpus


def greedy(inst: Instance) -> list[ShardPlacement] | None:
    pool = FreeGpus(inst)
    out = []
    for r in range(inst.dp):
        for p in range(inst.pp):
            for site in inst.sites:
                got = pool.take(site, p)
                if got:
                    out.append(
                        ShardPlacement(replica=r, stage=p, site=site, node=got[0], gpus=got[1])
                    )
                    break
            else:
                return None
    return sorted(out, key=lambda s: (s.stage, s.replica))


def round_robin(inst: Instance) -> list[ShardPlacement] | None:
    pool = FreeGpus(inst)
    out = []
    turn = 0
    sites = inst.sites
    for r in range(inst.dp):
        for p in range(inst.pp):
            for step in range(len(sites)):
                site = sites[(turn + step) % len(sites)]
                got = pool.take(site, p)
                if got:
                    out.append(
                        ShardPlacement(replica=r, stage=p, site=site, node=got[0], gpus=got[1])
                    )
                    turn = (turn + step + 1) % len(sites)
                    break
            else:
                return None
    return sorted(out, key=lambda s: (s.stage, s.replica))
