"""Annealing the block positions of clustered starts (cpn/scheduler/time_anneal.py)."""

from __future__ import annotations

from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from cpn.contracts import ShardPlacement, SolverReport
from cpn.costmodel import Workload
from cpn.scheduler import Objective, SolverSettings, heuristics
from cpn.scheduler.instance import Instance, build_instance
from cpn.scheduler.realize import (
    Counts,
    complete_flows,
    counts_of,
    evaluate_shards,
    realize,
    to_plan,
)
from cpn.scheduler.solve import solve_instance
from cpn.scheduler.time_anneal import anneal_blocks
from cpn.scheduler.time_flows import balanced_flows
from cpn.synthetic import benchmark_job, generate_topology
from tests.plan_checks import assert_valid_plan

_HEURISTIC = SolverReport(status="HEURISTIC", seconds=0, objective=0, bound=0, gap=0)


def _exact(inst: Instance, shards: list[ShardPlacement]) -> float:
    """The cost model's iteration time of these counts with their fastest flows."""
    counts = complete_flows(inst, Counts(counts_of(inst, shards).shards))
    counts = balanced_flows(inst, counts) or counts
    return evaluate_shards(inst, realize(inst, counts)).iteration_seconds


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([(12, 128), (20, 320)]),
    st.booleans(),
    st.sampled_from(["none", "topk"]),
    st.integers(0, 1000),
    st.booleans(),
)
def test_annealed_placements_are_valid_and_scored_by_the_cost_model(
    size: tuple[int, int], heterogeneous: bool, compression: str, seed: int, near: bool
) -> None:
    sites, gpus = size
    topo = generate_topology(sites, gpus, heterogeneous=heterogeneous, seed=seed)
    spec = benchmark_job(gpus, compression=compression)
    inst = build_instance(topo, Workload.of(spec))
    tried = 0
    for length in heuristics.block_lengths(inst.pp)[:-1]:
        start = heuristics.cluster_blocks(inst, length, near)
        if start is None:
            continue
        result = anneal_blocks(inst, length, start, seconds=30, seed=seed, max_moves=60)
        event(f"annealed: {result is not None}")
        if result is None:
            continue
        tried += 1
        assert result.moves <= 60
        assert_valid_plan(to_plan(inst, result.shards, _HEURISTIC, "iteration_time"), topo, spec)
        exact = _exact(inst, result.shards)
        # Its score is the cost model's formula. It may only overstate: it takes each
        # site's slowest node kind for a stage's compute, and keeps a block's replicas in
        # their site (the fastest flows may send some to another site instead).
        assert result.seconds >= exact * (1 - 1e-9)
        if not heterogeneous and length == 1:
            assert result.seconds <= exact * (1 + 1e-9)
    assume(tried)


def test_annealing_repairs_clusters_chosen_for_their_sync_alone() -> None:
    """Clusters grown for their own sync only (`near=False`) sit apart: moving whole
    sites between block positions shortens the hops, by a fixed number of moves (the
    same search on any machine)."""
    topo = generate_topology(24, 512, heterogeneous=False, seed=1)
    inst = build_instance(topo, Workload.of(benchmark_job(512, compression="none")))
    start = heuristics.cluster_blocks(inst, 1, near=False)
    assert start is not None
    result = anneal_blocks(inst, 1, start, seconds=120, max_moves=300)
    assert result is not None and result.moves == 300
    assert _exact(inst, result.shards) < 0.9 * _exact(inst, start)
    again = anneal_blocks(inst, 1, start, seconds=120, max_moves=300)
    assert again is not None and again.shards == result.shards


def test_the_time_search_on_a_large_network_is_no_slower_than_its_starts() -> None:
    """Above 16 sites the time search anneals its clustered starts first; its plan is
    valid and at least as fast as every start."""
    topo = generate_topology(24, 512, heterogeneous=False, seed=2)
    spec = benchmark_job(512, compression="none")
    inst = build_instance(topo, Workload.of(spec))
    solved = solve_instance(inst, Objective.ITERATION_TIME, SolverSettings(time_limit=4.0))
    assert_valid_plan(to_plan(inst, solved.shards, solved.report, "iteration_time"), topo, spec)
    starts = [
        heuristics.cluster_blocks(inst, n, near)
        for n in heuristics.block_lengths(inst.pp)[:-1]
        for near in (True, False)
    ]
    best_start = min(_exact(inst, s) for s in starts if s is not None)
    assert solved.evaluation.iteration_seconds <= best_start * (1 + 1e-9)
