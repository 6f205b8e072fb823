"""The search over sync levels (cpn/scheduler/time_levels.py) and the decision model it
solves (cpn/scheduler/time_decision.py)."""

from __future__ import annotations

import dataclasses
from collections import Counter

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from cpn.contracts import JobSpec, SolverReport, Topology
from cpn.costmodel import GIB, Workload
from cpn.scheduler import Objective, heuristics
from cpn.scheduler.bruteforce import brute_force
from cpn.scheduler.instance import Instance, build_instance
from cpn.scheduler.realize import Counts, counts_of, evaluate_shards, realize, to_plan
from cpn.scheduler.solve import objective_key
from cpn.scheduler.time_decision import Decision, decision_model
from cpn.scheduler.time_flows import balanced_flows
from cpn.scheduler.time_levels import (
    ATTEMPT_DTIME,
    ATTEMPT_OVERHEAD,
    DTIME_PER_SECOND,
    STEP,
    level_search,
    placement,
    start_hint,
)
from cpn.synthetic import benchmark_job, generate_topology
from tests.factories import job, link, site, topology
from tests.plan_checks import assert_valid_plan
from tests.scheduler_cases import instance_or_reject, tiny_cases

_HEURISTIC = SolverReport(status="HEURISTIC", seconds=0, objective=0, bound=0, gap=0)


def _seconds(inst: Instance, counts: Counts) -> float:
    return evaluate_shards(inst, realize(inst, counts)).iteration_seconds


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_cases())
def test_a_placement_is_a_solution_at_its_own_level_in_the_hint_s_names(
    case: tuple[Topology, JobSpec],
) -> None:
    # The decision model claims every placement with sync ≤ d and time ≤ B is one of its
    # solutions; the level search starts its local search from the start's values under
    # the model's variable names. Fixing every hinted variable to its value must leave the
    # model feasible at the placement's own sync and time: the names match, and the
    # relaxation (Hall's condition over node kinds included) admits the placement.
    inst = instance_or_reject(case)
    best = brute_force(inst, objective_key(Objective.ITERATION_TIME))
    assume(best is not None)
    assert best is not None
    counts = counts_of(inst, best[0])
    ev = best[1]
    decision = decision_model(
        inst, ev.dp_sync * (1 + 1e-9), ev.iteration_seconds * (1 + 1e-6), range(inst.pp)
    )
    model = decision.model
    names = {v.name: i for i, v in enumerate(model.proto.variables) if v.name}
    hint = start_hint(inst, counts)
    assert set(hint) <= set(names), set(hint) - set(names)
    for name, value in hint.items():
        model.add(model.get_int_var_from_proto_index(names[name]) == value)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    assert solver.solve(model) == cp_model.OPTIMAL


def _placed_solutions(inst: Instance, decision: Decision, most: int | None = None) -> list[bool]:
    """For each solution of the decision model (up to `most`): whether it goes onto the
    nodes."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.enumerate_all_solutions = True
    seen: list[bool] = []

    class Check(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            seen.append(placement(inst, decision, self) is not None)
            if most is not None and len(seen) >= most:
                self.stop_search()

    solver.solve(decision.model, Check())
    return seen


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_cases(), st.sampled_from([1.0, 2.0]))
def test_every_solution_of_the_decision_model_goes_onto_the_nodes(
    case: tuple[Topology, JobSpec], slack: float
) -> None:
    # Sites with several kinds of node (GPUs of different memory): a solution's pattern per
    # site must fit the kinds, which Hall's condition in the model ensures (per-stage caps
    # and the site's slots alone let a site hold two stages that fit only its big nodes
    # beyond their room).
    inst = instance_or_reject(case)
    best = brute_force(inst, objective_key(Objective.ITERATION_TIME))
    assume(best is not None)
    assert best is not None
    ev = best[1]
    decision = decision_model(
        inst, ev.dp_sync * slack + 1e-9, ev.iteration_seconds * slack * 1.01, range(inst.pp)
    )
    seen = _placed_solutions(inst, decision, most=50)
    assert seen and all(seen)


def test_a_site_s_big_nodes_are_not_promised_to_two_stages() -> None:
    """Two sites, each with two GPUs that hold any stage and three that hold only the
    middle one (the first and last carry the embedding and the head). Per-stage room and
    the site's slots allow a site both outer stages' two shards each; Hall's condition
    does not, and every solution must go onto the nodes."""
    spec = job(2, 1, 3, layers=6, hidden=64, heads=4, seq_len=32, vocab=50_000)
    w = Workload.of(spec)
    small = 1.01
    assert w.memory_bytes(1) / GIB < small < min(w.memory_bytes(p) / GIB for p in (0, 2))
    docs = []
    for name in ("a", "b"):
        doc = site(name, gpus=2, memory_gb=80)
        doc["nodes"].append(
            {
                "name": f"{name}-small",
                "count": 1,
                "gpu": {"model": "S", "count": 3, "memory_gb": small, "tflops": 100},
                "intra_node_gbps": 4800,
            }
        )
        docs.append(doc)
    inst = build_instance(topology(docs, [link("a", "b")]), w)
    decision = decision_model(inst, 1e6, 1e7, range(inst.pp))  # every placement's level
    seen = _placed_solutions(inst, decision)
    assert len(seen) > 1 and all(seen), seen


def _clustered_start(inst: Instance) -> Counts:
    shards = heuristics.cluster_blocks(inst, 1)
    assert shards is not None
    counts = balanced_flows(inst, Counts(counts_of(inst, shards).shards))
    assert counts is not None
    return counts


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([(12, 512), (20, 512)]),
    st.booleans(),
    st.sampled_from(["none", "topk"]),
    st.integers(0, 1000),
)
def test_level_plans_are_valid_faster_than_the_start_and_within_the_budget(
    size: tuple[int, int], heterogeneous: bool, compression: str, seed: int
) -> None:
    sites, gpus = size
    topo = generate_topology(sites, gpus, heterogeneous=heterogeneous, seed=seed)
    spec = benchmark_job(gpus, compression=compression)
    inst = build_instance(topo, Workload.of(spec))
    start = _clustered_start(inst)
    budget = 0.5
    result = level_search(inst, start, seconds=budget, wall=60)
    spent = sum(a.counted for a in result.attempts)
    # Each attempt's search is capped by what is left (CP-SAT checks its limit every few
    # steps); its overhead is charged after it.
    most = max((a.counted - a.dtime for a in result.attempts), default=0.0)
    assert all(a.counted - a.dtime >= ATTEMPT_OVERHEAD for a in result.attempts)
    assert spent <= budget * DTIME_PER_SECOND + most + 0.1
    assert all(a.dtime <= ATTEMPT_DTIME + 0.1 for a in result.attempts)
    if result.counts is None:
        assert result.seconds == _seconds(inst, start)
        return
    shards = realize(inst, result.counts)
    assert_valid_plan(to_plan(inst, shards, _HEURISTIC, "iteration_time"), topo, spec)
    # The time it reports is the cost model's, exactly, and below the start's.
    assert result.seconds == evaluate_shards(inst, shards).iteration_seconds
    assert result.seconds < _seconds(inst, start)
    assert result.seconds == min(a.seconds for a in result.attempts if a.seconds is not None)


def test_the_search_is_the_same_on_every_run_and_finds_what_blocks_miss() -> None:
    """The 16-site heterogeneous bench network with dense sync: whole replicas on tight
    clusters (`cluster_blocks`) take 382 s an iteration; every stage on its own sites at
    a lower sync level takes under a third of that, found in a fixed number of attempts
    whose effort is counted, not timed."""
    topo = generate_topology(16, 4096, heterogeneous=True, seed=16 * 7 + 4096)
    inst = build_instance(topo, Workload.of(benchmark_job(4096, compression="none")))
    start = _clustered_start(inst)
    first = level_search(inst, start, seconds=1.0, wall=120)
    again = level_search(inst, start, seconds=1.0, wall=120)
    assert first.counts is not None
    assert first.seconds < _seconds(inst, start) / 3
    # A level that gave a faster plan is tried again at once (the continuation).
    best = _seconds(inst, start)
    for attempt, after in zip(first.attempts, first.attempts[1:], strict=False):
        if attempt.seconds is not None and attempt.seconds < best:
            best = attempt.seconds
            if best * (1 - STEP) > attempt.sync:  # else no target fits the level
                assert after.sync == attempt.sync
    assert max(Counter(a.sync for a in first.attempts).values()) >= 3  # it continued
    assert [dataclasses.astuple(a) for a in first.attempts] == [
        dataclasses.astuple(a) for a in again.attempts
    ]
    # No target is set below a proven floor: with the floor at the start's time, nothing.
    none = level_search(inst, start, seconds=1.0, wall=120, floor=_seconds(inst, start))
    assert none.counts is None and none.attempts == []
