"""DT-FM's genetic algorithm as a baseline: its parts are exact, its plans valid, and cpn's
plans are never worse than its plans on small DT-FM-like instances."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpn.contracts import JobSpec, Topology
from cpn.costmodel import Workload
from cpn.scheduler import Objective, SolverSettings, plan_job
from cpn.scheduler.dtfm import Decoder, GaSettings, _open_path, dtfm_ga
from cpn.scheduler.instance import build_instance
from cpn.scheduler.realize import to_plan
from cpn.scheduler.solve import _report, objective_key
from cpn.synthetic import benchmark_job, dtfm_topology, generate_topology
from tests.factories import job
from tests.plan_checks import assert_valid_plan

#: The time model's rounding (cpn.scheduler.solve.TIME_MODEL_TOLERANCE).
TIME_SLACK = 2e-3


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_open_path_is_the_cheapest_allowed_order(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 5))
    edge = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            edge[i, j] = edge[j, i] = data.draw(st.integers(0, 20))
    allowed = [[data.draw(st.booleans()) for _ in range(n)] for _ in range(n)]
    costs = [
        sum(edge[p[q], p[q + 1]] for q in range(n - 1))
        for p in itertools.permutations(range(n))
        if all(allowed[q][p[q]] for q in range(n))
    ]
    order = _open_path(edge, allowed)
    if not costs:
        assert order is None
        return
    assert order is not None and sorted(order) == list(range(n))
    assert all(allowed[q][order[q]] for q in range(n))
    assert sum(edge[order[q], order[q + 1]] for q in range(n - 1)) == min(costs)


def _decoder() -> Decoder:
    topo = dtfm_topology("regional", sites_per_region=1, nodes_per_site=1)
    inst = build_instance(topo, Workload.of(job(4, 1, 4, layers=8)))
    return Decoder(inst, objective_key(Objective.ITERATION_TIME))


DECODER = _decoder()


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_bottleneck_is_the_least_bottleneck_of_any_perfect_matching(data: st.DataObject) -> None:
    d = DECODER
    k = data.draw(st.integers(1, 5))
    chosen = data.draw(
        st.lists(st.integers(0, len(d.devices) - 1), min_size=2 * k, max_size=2 * k, unique=True)
    )
    a, b = np.array(chosen[:k]), np.array(chosen[k:])
    cost = d.hop[np.ix_(d.site[a], d.site[b])]
    brute = min(max(cost[i, p[i]] for i in range(k)) for p in itertools.permutations(range(k)))
    value, mate = d._matching(a, b)
    assert d._bottleneck(a, b) == value == brute
    assert sorted(mate) == list(range(k))
    assert max(cost[i, mate[i]] for i in range(k)) == value


def _cases() -> list[tuple[str, Topology, JobSpec]]:
    return [
        # DT-FM's regional scenario, 4 regions × 8 GPUs, a dp 4 × pp 4 job as in its setting.
        ("dtfm-regional", dtfm_topology("regional"), job(4, 1, 4, layers=8, micro_batches=4)),
        # Its world-wide one (8 regions), dp 2 × pp 4 on 64 GPUs.
        ("dtfm-worldwide", dtfm_topology("worldwide"), job(2, 1, 4, layers=8, micro_batches=4)),
        # The scheduler bench's smallest heterogeneous instance.
        (
            "bench-4-sites",
            generate_topology(4, 64, heterogeneous=True, seed=4 * 7 + 64),
            benchmark_job(64),
        ),
    ]


@pytest.mark.parametrize("objective", [Objective.WAN_BYTES, Objective.ITERATION_TIME])
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_cpn_is_no_worse_than_the_dtfm_ga(
    case: tuple[str, Topology, JobSpec], objective: Objective
) -> None:
    _, topo, spec = case
    inst = build_instance(topo, Workload.of(spec))
    key = objective_key(objective)
    # Bounded by trials, not by time: the same seed gives the same GA run on any machine.
    ga = dtfm_ga(inst, key, GaSettings(population=12, trials=40, time_limit=600, seed=1))
    assert ga is not None
    assert ga.trials == 40
    again = dtfm_ga(inst, key, GaSettings(population=12, trials=40, time_limit=600, seed=1))
    assert again is not None and again.key == ga.key
    # The GA's plan is a plan like any other: every constraint holds.
    report = _report(None, objective, ga.evaluation, ga.seconds)
    assert_valid_plan(to_plan(inst, ga.shards, report, objective.value), topo, spec)
    plan = plan_job(topo, spec, objective=objective, settings=SolverSettings(time_limit=10))
    assert plan.solver.seconds <= 10.5
    if objective is Objective.WAN_BYTES:
        assert plan.bytes_per_iteration.wan <= ga.evaluation.wan
    else:
        assert plan.predicted_iteration_seconds <= ga.evaluation.iteration_seconds * (
            1 + TIME_SLACK
        )
    assert math.isfinite(ga.key[0])
