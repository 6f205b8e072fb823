"""From a placement to a Plan: concrete nodes and GPU indices, then the cost model.

The solver decides counts (shards of each stage per node group) and pipeline flows
(replicas whose stage p sits at site a and stage p+1 at site b). Here those become one
(replica, stage) → (site, node, GPUs) entry per shard, deterministically: sites in
topology order, nodes in file order, lowest free GPU indices first.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from cpn.contracts.plan import (
    Alternative,
    Binding,
    Breakdown,
    BytesPerIteration,
    ExchangeBytes,
    Plan,
    ShardPlacement,
    SolverReport,
    WanAutoChoice,
)
from cpn.costmodel import Evaluation, Placement, evaluate
from cpn.scheduler.instance import Instance


@dataclass
class Counts:
    """A placement as the solver sees it."""

    #: (stage, group index) -> shards of that stage on that group
    shards: dict[tuple[int, int], int]
    #: (stage p, site a, site b) -> replicas with stage p at a and stage p + 1 at b
    flows: dict[tuple[int, str, str], int] = field(default_factory=dict)

    def per_site(self, inst: Instance) -> dict[tuple[int, str], int]:
        out: dict[tuple[int, str], int] = defaultdict(int)
        for (p, g), c in self.shards.items():
            if c:
                out[(p, inst.groups[g].site)] += c
        return dict(out)


def counts_of(inst: Instance, shards: Sequence[ShardPlacement]) -> Counts:
    """The counts and flows of a concrete placement (to hint the solver with it)."""
    group_of = {(g.site, node.name): g.index for g in inst.groups for node in g.nodes}
    out: dict[tuple[int, int], int] = defaultdict(int)
    site = {}
    for sh in shards:
        out[(sh.stage, group_of[(sh.site, sh.node)])] += 1
        site[(sh.replica, sh.stage)] = sh.site
    flows: dict[tuple[int, str, str], int] = defaultdict(int)
    for p in range(inst.pp - 1):
        for r in range(inst.dp):
            flows[(p, site[(r, p)], site[(r, p + 1)])] += 1
    return Counts(dict(out), dict(flows))


def complete_flows(inst: Instance, counts: Counts) -> Counts:
    """Fill in pipeline flows for counts that only fix the stages' sites.

    Replicas stay in their site where both stages are there; the rest are matched to the
    remaining demand over the fastest routes first (a greedy transportation plan).
    """
    per_site = counts.per_site(inst)
    w = inst.workload
    flows: dict[tuple[int, str, str], int] = {}
    for p in range(inst.pp - 1):
        supply = {s: per_site.get((p, s), 0) for s in inst.sites}
        demand = {s: per_site.get((p + 1, s), 0) for s in inst.sites}
        for s in inst.sites:
            stay = min(supply[s], demand[s])
            if stay:
                flows[(p, s, s)] = stay
                supply[s] -= stay
                demand[s] -= stay
        arcs = []
        for a in inst.sites:
            for b in inst.sites:
                if a != b and supply[a] and demand[b]:
                    route = inst.graph.route(a, b)
                    if route is not None:
                        arcs.append((w.hop_seconds(route, 1, 1.0), a, b))
        for _, a, b in sorted(arcs):
            moved = min(supply[a], demand[b])
            if moved:
                flows[(p, a, b)] = flows.get((p, a, b), 0) + moved
                supply[a] -= moved
                demand[b] -= moved
        if any(supply.values()):
            raise ValueError(f"stage {p}: no WAN route for every replica to reach stage {p + 1}")
    return Counts(counts.shards, flows)


def realize(inst: Instance, counts: Counts) -> list[ShardPlacement]:
    """Concrete shards for counts with complete flows."""
    tp, pp, dp = inst.workload.tp, inst.pp, inst.dp
    # 1. Slots: for each stage and site, the (node, gpus) its shards get, in a stable order.
    free = {(g.index, n.name): list(n.free_gpus) for g in inst.groups for n in g.nodes}
    slots: dict[tuple[int, str], list[tuple[str, list[int]]]] = defaultdict(list)
    for g in inst.groups:
        for p in range(pp):
            need = counts.shards.get((p, g.index), 0)
            for node in g.nodes:
                pool = free[(g.index, node.name)]
                while need and len(pool) >= tp:
                    slots[(p, g.site)].append((node.name, pool[:tp]))
                    del pool[:tp]
                    need -= 1
            if need:
                raise ValueError(f"group {g.index} of site {g.site}: not enough free GPUs")
    # 2. Replica ids: stage 0 in site order, then along the flows.
    replicas_at: dict[tuple[int, str], list[int]] = defaultdict(list)
    next_id = 0
    for s in inst.sites:
        n = len(slots.get((0, s), []))
        replicas_at[(0, s)] = list(range(next_id, next_id + n))
        next_id += n
    if next_id != dp:
        raise ValueError(f"stage 0 has {next_id} shards, need {dp}")
    order = inst.site_index
    leaving: dict[tuple[int, str], list[tuple[str, int]]] = defaultdict(list)
    for (p, a, b), moved in counts.flows.items():
        if moved:
            leaving[(p, a)].append((b, moved))
    for p in range(pp - 1):
        for a in inst.sites:
            pending = sorted(replicas_at.get((p, a), []))
            # The replicas that stay go first (they keep the lowest ids in the site), then
            # the others in site order.
            for b, moved in sorted(leaving[(p, a)], key=lambda t: (t[0] != a, order[t[0]])):
                replicas_at[(p + 1, b)].extend(pending[:moved])
                pending = pending[moved:]
            if pending:
                raise ValueError(f"flows leave replicas of stage {p} at {a} without a next stage")
    # 3. Shards.
    out: list[ShardPlacement] = []
    for (p, s), places in slots.items():
        ids = sorted(replicas_at.get((p, s), []))
        if len(ids) != len(places):
            raise ValueError(f"stage {p} at {s}: {len(places)} slots for {len(ids)} replicas")
        for replica, (node_name, gpus) in zip(ids, places, strict=True):
            out.append(ShardPlacement(replica=replica, stage=p, site=s, node=node_name, gpus=gpus))
    out.sort(key=lambda sh: (sh.stage, sh.replica))
    return out


def evaluate_shards(inst: Instance, shards: Sequence[ShardPlacement]) -> Evaluation:
    return evaluate(
        inst.workload,
        inst.topology,
        inst.graph,
        [Placement(s.replica, s.stage, s.site, s.node) for s in shards],
    )


def bytes_of(ev: Evaluation) -> BytesPerIteration:
    """The plan's bytes per iteration (and, under `wan: outer`, per exchange) from an
    evaluation of its placement."""
    x = ev.exchange
    return BytesPerIteration(
        intra_node=ev.intra_node,
        intra_site=ev.intra_site,
        wan=ev.wan,
        wan_links=ev.wan_links,
        exchange=None
        if x is None
        else ExchangeBytes(
            every=x.every,
            step_intra_site=x.step_intra_site,
            step_wan=x.step_wan,
            intra_site=x.intra_site,
            wan=x.wan,
        ),
    )


def phase_bytes(
    inst: Instance, shards: Sequence[ShardPlacement], auto: WanAutoChoice
) -> WanAutoChoice:
    """`auto` with each phase's bytes on this placement: the warm-up's per-step sync sends
    other bytes than the steady rung's outer steps."""
    placements = [Placement(s.replica, s.stage, s.site, s.node) for s in shards]
    phases = []
    for phase in auto.schedule():
        job = inst.workload.job.model_copy(update={"compression": phase.compression})
        ev = evaluate(replace(inst.workload, job=job), inst.topology, inst.graph, placements)
        phases.append(phase.model_copy(update={"bytes_per_iteration": bytes_of(ev)}))
    return auto.model_copy(update={"phases": phases})


def to_plan(
    inst: Instance,
    shards: Sequence[ShardPlacement],
    solver: SolverReport,
    objective: str,
    runners_up: Sequence[Alternative] = (),
) -> Plan:
    ev = evaluate_shards(inst, shards)
    w = inst.workload
    return Plan(
        job=w.job.name,
        binding=Binding.of(w.job, inst.topology),
        objective=objective,
        parallel=w.parallel,
        compression=w.job.compression,
        micro_batches=w.micro_batches,
        shards=list(shards),
        bytes_per_iteration=bytes_of(ev),
        predicted_iteration_seconds=ev.iteration_seconds,
        breakdown=Breakdown(
            compute=ev.compute, pipeline=ev.pipeline, dp_sync=ev.dp_sync, bubble=ev.bubble
        ),
        price_per_hour=ev.price_per_hour,
        solver=solver,
        runners_up=list(runners_up),
    )
