"""Independent checks that a plan respects every constraint of its topology and job."""

from __future__ import annotations

from collections import defaultdict

from cpn.contracts import JobSpec, Plan, Reservations, Topology
from cpn.costmodel import GIB, Workload


def assert_valid_plan(
    plan: Plan, topo: Topology, job: JobSpec, held: Reservations | None = None
) -> None:
    held = held or Reservations()
    par = plan.parallel
    w = Workload(job, par)
    nodes = {(n.site, n.name): n.spec for n in topo.nodes()}
    used: dict[tuple[str, str], list[int]] = defaultdict(list)
    assert len(plan.shards) == par.dp * par.pp
    assert {(s.replica, s.stage) for s in plan.shards} == {
        (r, p) for r in range(par.dp) for p in range(par.pp)
    }
    for s in plan.shards:
        spec = nodes[(s.site, s.node)]  # the node exists in that site
        assert len(s.gpus) == par.tp, "a tensor-parallel group has tp GPUs in one node"
        assert all(0 <= g < spec.gpu.count for g in s.gpus)
        assert not set(s.gpus) & held.held(s.site, s.node), "GPUs held by other jobs"
        assert w.memory_bytes(s.stage) <= spec.gpu.memory_gb * GIB, "stage memory fits"
        c = job.constraints
        if c.sites:
            assert s.site in c.sites
        if c.gpu_model:
            assert spec.gpu.model.lower() == c.gpu_model.lower()
        if c.min_gpu_memory_gb:
            assert spec.gpu.memory_gb >= c.min_gpu_memory_gb
        used[(s.site, s.node)].extend(s.gpus)
    for key, gpus in used.items():
        assert len(gpus) == len(set(gpus)), f"GPU handed out twice on {key}"
        assert len(gpus) <= nodes[key].gpu.count
    assert len({r.rank for r in plan.ranks()}) == par.world_size
