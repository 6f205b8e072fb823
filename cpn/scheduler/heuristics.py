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

from collections.abc import Iterator
from functools import partial

import numpy as np

from cpn.contracts.plan import ShardPlacement
from cpn.scheduler.instance import Instance
from cpn.scheduler.pool import FreeGpus
from cpn.scheduler.time_flows import hop_coefficients, pair_costs


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


def cluster_replicas(inst: Instance) -> list[ShardPlacement] | None:
    """Whole replicas on the tightest cluster of sites: for iteration time.

    With no replica crossing the WAN between stages, a plan's pipeline runs at compute
    speed and its time is the data-parallel sync among the sites it uses, whose slowest
    pair sets the pace (`Workload.dp_wan_seconds`). So sites are added one at a time to
    the one that keeps the slowest pair fastest, from every possible first site, until
    their whole-replica room covers dp; the cluster with the fastest slowest pair wins.
    """
    w = inst.workload
    dp, pp = inst.dp, inst.pp
    room = {s: _whole_replicas(inst, s) for s in inst.sites}
    hosts = [s for s in inst.sites if room[s] > 0]
    if sum(room[s] for s in hosts) < dp:
        return None
    n = len(hosts)
    # Pair costs of a typical sync: the middle stage over as many sites as replicas need.
    k_guess = max(2, min(n, -(-dp // max(room.values()))))
    volume, steps = w.dp_wan_per_leader(pp // 2, k_guess), w.dp_wan_steps(k_guess)
    cost = np.full((n, n), np.inf)
    for i, a in enumerate(hosts):
        for j, b in enumerate(hosts):
            route = inst.graph.route(a, b)
            if i == j:
                cost[i, j] = 0.0
            elif route is not None:
                cost[i, j] = route.seconds(volume, steps)
    best: tuple[float, list[int]] | None = None
    capacity = np.array([room[s] for s in hosts])
    for slowest, chosen in _grown_clusters(cost, capacity, dp):
        if best is None or slowest < best[0]:
            best = (slowest, chosen)
    if best is None:
        return None
    free = FreeGpus(inst)
    out: list[ShardPlacement] = []
    replica = 0
    for i in sorted(best[1], key=lambda i: -capacity[i]):
        site = hosts[i]
        for _ in range(room[site]):
            if replica == dp:
                break
            for p in range(pp):
                got = free.take(site, p)
                if got is None:
                    return None
                out.append(
                    ShardPlacement(replica=replica, stage=p, site=site, node=got[0], gpus=got[1])
                )
            replica += 1
    return _sorted(out) if replica == dp else None


def _grown_clusters(
    cost: np.ndarray, capacity: np.ndarray, dp: int
) -> Iterator[tuple[float, list[int]]]:
    """From every first site, sites added one at a time to the one whose slowest pair to
    the cluster is fastest, until their room covers `dp`: each cluster that does, with its
    slowest pair (`cost[i, j]`: seconds between sites i and j, inf if unreachable)."""
    for first in range(len(capacity)):
        chosen, worst = [first], cost[first].copy()  # slowest pair from each site to it
        have, slowest = int(capacity[first]), 0.0
        while have < dp:
            masked = worst.copy()
            masked[chosen] = np.inf
            nxt = int(np.argmin(masked))
            if not np.isfinite(masked[nxt]):
                break
            slowest = max(slowest, float(masked[nxt]))
            chosen.append(nxt)
            worst = np.maximum(worst, cost[nxt])
            have += int(capacity[nxt])
        if have >= dp:
            yield slowest, chosen


def _whole_replicas(inst: Instance, site: str) -> int:
    """How many whole replicas (one shard of every stage) fit in `site`."""
    free = FreeGpus(inst)
    count = 0
    while count < inst.dp:
        if any(free.take(site, p) is None for p in range(inst.pp)):
            break
        count += 1
    return count


def cluster_blocks(inst: Instance, length: int, near: bool = True) -> list[ShardPlacement] | None:
    """Blocks of `length` stages, each block position on its own tight cluster: for time.

    `cluster_replicas` keeps every replica in one site, so every stage syncs over the
    same sites, which on a network with slow links may have to include slow pairs. Here
    the stages are cut into blocks of `length` consecutive stages; for each block
    position in turn, the sites with room for whole blocks are grown into the cluster
    whose slowest pair is fastest (as `cluster_replicas` does, on what earlier block
    positions left free), and dp blocks are placed there. Replicas cross the WAN between
    block positions (their flows are spread afterwards by `time_flows`); each stage syncs
    only inside its block position's cluster. With `near`, a cluster's score also counts
    the hop from the block position before (`_arrival_hop`), so consecutive clusters sit
    close; without it, only the sync counts (better where sync dominates).
    """
    w = inst.workload
    dp, pp = inst.dp, inst.pp
    if length >= pp or pp % length:
        return None
    free = FreeGpus(inst)
    out: list[ShardPlacement] = []
    slots = w.micro_batches + pp - 1
    per_msg, per_byte = pair_costs(inst)
    previous: list[str] = []  # the sites of the block position before
    for first in range(0, pp, length):
        stages = range(first, first + length)
        room = {s: blocks_room(free, s, stages, dp) for s in inst.sites}
        hosts = [s for s in inst.sites if room[s] > 0]
        if sum(room[s] for s in hosts) < dp:
            return None
        n = len(hosts)
        k_guess = max(2, min(n, -(-dp // max(room.values()))))
        volume, steps = w.dp_wan_per_leader(first, k_guess), w.dp_wan_steps(k_guess)
        at = [inst.site_index[s] for s in hosts]
        idx = np.ix_(at, at)
        cost = steps * per_msg[idx] + volume * per_byte[idx]
        np.fill_diagonal(cost, 0.0)
        capacity = np.array([room[s] for s in hosts])
        best: tuple[float, list[int]] | None = None
        for slowest, chosen in _grown_clusters(cost, capacity, dp):
            # The replicas arriving from the block position before pay its slowest hop in
            # every pipeline slot: count it, spread over the pairs.
            score = slowest
            if near:
                score += slots * _arrival_hop(inst, previous, [hosts[i] for i in chosen])
            if best is None or score < best[0]:
                best = (score, chosen)
        if best is None:
            return None
        previous = [hosts[i] for i in best[1]]
        replica = 0
        for i in sorted(best[1], key=lambda i: -capacity[i]):
            site = hosts[i]
            count = min(room[site], dp - replica)
            if not take_blocks(free, site, stages, count, replica, out):
                return None
            replica += count
        if replica < dp:
            return None
    return _sorted(out)


def take_blocks(
    free: FreeGpus,
    site: str,
    stages: range,
    count: int,
    replica: int,
    out: list[ShardPlacement],
) -> bool:
    """Place `count` whole blocks of `stages` at `site`, replicas numbered from `replica`,
    onto `out`; False if some shard finds no GPUs that fit it."""
    for r in range(replica, replica + count):
        for p in stages:
            got = free.take(site, p)
            if got is None:
                return False
            out.append(ShardPlacement(replica=r, stage=p, site=site, node=got[0], gpus=got[1]))
    return True


def blocks_room(free: FreeGpus, site: str, stages: range, most: int) -> int:
    """Whole blocks of `stages` that fit in what `free` has left at `site` (up to `most`)."""
    taken: list[tuple[str, list[int]]] = []
    count = 0
    while count < most:
        got = [free.take(site, p) for p in stages]
        taken += [g for g in got if g is not None]
        if any(g is None for g in got):
            break
        count += 1
    for node, gpus in reversed(taken):
        free.give_back(site, node, gpus)
    return count


def _arrival_hop(inst: Instance, before: list[str], after: list[str]) -> float:
    """Estimated slowest hop of dp replicas from sites `before` to sites `after`.

    Each arriving site takes its share of dp from its nearest site before, the replicas
    spread evenly over the pairs (`time_flows` spreads them); 0 for the first block.
    """
    if not before:
        return 0.0
    per_pair = max(1, -(-inst.dp // (len(before) * len(after))))
    alpha, beta = hop_coefficients(inst)
    idx = np.ix_([inst.site_index[s] for s in before], [inst.site_index[s] for s in after])
    hop = alpha[idx] + beta[idx] * per_pair
    return float(hop.min(axis=0).max())
