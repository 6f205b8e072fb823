"""Exact placement by enumeration, for tiny instances: the yardstick for the solver.

Every shard is tried on every node, independently of the solver's counting argument
(groups, slots, flows), and every complete placement is scored by the cost model. Only
for tests and benchmarks on a handful of shards and nodes: the work is nodes^shards.
"""

from __future__ import annotations

from collections.abc import Callable

from cpn.contracts.plan import ShardPlacement
from cpn.costmodel import Evaluation
from cpn.scheduler.instance import Instance
from cpn.scheduler.realize import evaluate_shards

#: Refuse instances larger than this many complete placements.
MAX_PLACEMENTS = 200_000


def brute_force(
    inst: Instance,
    key: Callable[[Evaluation], tuple[float, ...]],
    admit: Callable[[list[ShardPlacement]], bool] | None = None,
) -> tuple[list[ShardPlacement], Evaluation] | None:
    """The placement minimising `key(evaluation)` among those `admit` accepts (all by
    default), or None if none exists."""
    tp = inst.workload.tp
    nodes = [(g.index, g.site, n.name, n.free_gpus) for g in inst.groups for n in g.nodes]
    shards = [(r, p) for r in range(inst.dp) for p in range(inst.pp)]
    if len(nodes) ** len(shards) > MAX_PLACEMENTS:
        raise ValueError(f"{len(nodes)} nodes ^ {len(shards)} shards is too many to enumerate")
    used = [0] * len(nodes)
    choice: list[int] = []
    best: tuple[tuple[float, ...], list[ShardPlacement], Evaluation] | None = None

    def place() -> list[ShardPlacement]:
        taken = [0] * len(nodes)
        out = []
        for (r, p), i in zip(shards, choice, strict=True):
            _, site, name, free = nodes[i]
            gpus = free[taken[i] * tp : (taken[i] + 1) * tp]
            taken[i] += 1
            out.append(ShardPlacement(replica=r, stage=p, site=site, node=name, gpus=gpus))
        return out

    def walk(depth: int) -> None:
        nonlocal best
        if depth == len(shards):
            placed = place()
            if admit is not None and not admit(placed):
                return
            ev = evaluate_shards(inst, placed)
            score = key(ev)
            if best is None or score < best[0]:
                best = (score, placed, ev)
            return
        _, p = shards[depth]
        for i, (group, _, _, free) in enumerate(nodes):
            if inst.fits[p][group] and (used[i] + 1) * tp <= len(free):
                used[i] += 1
                choice.append(i)
                walk(depth + 1)
                choice.pop()
                used[i] -= 1

    walk(0)
    if best is None:
        return None
    return sorted(best[1], key=lambda s: (s.stage, s.replica)), best[2]
