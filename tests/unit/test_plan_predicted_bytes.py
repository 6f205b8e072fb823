"""The plan's prediction of a run prefix (`cpn.contracts.plan.predicted_bytes`, what the
job service shows beside the measured bytes) against the cost model's whole-run formula
for the phases run (`cpn.wan_schedule.run_wan_bytes`, which the runtime's counts equal —
tests/integration/test_train_outer.py, test_train_wan_auto.py), and step by step: under
`wan: outer` a whole exchange at every H-th step and at the last one, nothing between."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from cpn.contracts import JobSpec, Plan, Topology
from cpn.contracts.plan import predicted_bytes
from cpn.scheduler import SolverSettings, plan_job
from cpn.wan_schedule import run_wan_bytes
from tests.integration.runtime import TOPOLOGY, tiny_job

#: Three sites of one node with four GPUs: up to four replicas per site, so that the
#: in-site broadcast of an outer step is in the figures too.
THREE_SITES = copy.deepcopy(TOPOLOGY)
THREE_SITES["sites"] = [
    {**copy.deepcopy(TOPOLOGY["sites"][0]), "name": n} for n in ("east", "west", "north")
]
for site in THREE_SITES["sites"]:
    site["nodes"][0].update(count=1, gpu={**site["nodes"][0]["gpu"], "count": 4})
THREE_SITES["links"] = [
    {"a": a, "b": b, "bandwidth_gbps": 1, "latency_ms": 10, "transport": "tcp"}
    for a, b in (("east", "west"), ("west", "north"), ("east", "north"))
]


def _plan(dp: int, pp: int, steps: int, compression: dict[str, object]) -> tuple[JobSpec, Plan]:
    doc = tiny_job(dp, 1, pp, steps, **compression)
    doc["train"]["global_batch"] = dp * doc["train"]["micro_batch"] * 2
    job = JobSpec.model_validate(doc)
    topo = Topology.model_validate(THREE_SITES)
    return job, plan_job(topo, job, settings=SolverSettings(time_limit=2))


def _sites(plan: Plan) -> int:
    return len(plan.sites_used())


@settings(max_examples=12, deadline=None)
@given(
    dp=st.integers(2, 6),
    every=st.integers(1, 9),
    steps=st.integers(1, 30),
    values=st.sampled_from(["fp16", "int8", "int4"]),
)
def test_an_outer_plans_prefix_is_its_exchanges_whole(
    dp: int, every: int, steps: int, values: str
) -> None:
    job, plan = _plan(dp, 1, steps, {"wan": "outer", "every": every, "values": values})
    per = plan.bytes_per_iteration
    exchange = per.exchange
    assert exchange is not None and exchange.every == every

    def through(done: int) -> dict[str, int]:
        return predicted_bytes(per, None, done, steps)

    # The whole run: exactly the cost model's formula for the one stretch run.
    assert through(steps)["wan"] == run_wan_bytes(
        job, job.fixed_parallel, _sites(plan), [(job.compression, steps)]
    )
    # Step by step: every step's own bytes, plus the whole exchange where one ends.
    for step in range(steps):
        ends = (step + 1) % every == 0 or step == steps - 1
        wan = through(step + 1)["wan"] - through(step)["wan"]
        assert wan == exchange.step_wan + (exchange.wan if ends else 0), step
        in_site = through(step + 1)["intra_site"] - through(step)["intra_site"]
        assert in_site == exchange.step_intra_site + (exchange.intra_site if ends else 0)
    # Past the end nothing more; before the start nothing.
    assert through(steps + 5) == through(steps) and through(0) == dict.fromkeys(through(0), 0)


@settings(max_examples=8, deadline=None)
@given(dp=st.integers(1, 6), steps=st.integers(1, 30), wan=st.sampled_from(["none", "fp16"]))
def test_a_per_step_plans_prefix_is_steps_times_its_iteration(
    dp: int, steps: int, wan: str
) -> None:
    _, plan = _plan(dp, 1, steps, {"wan": wan})
    per = plan.bytes_per_iteration
    assert per.exchange is None
    for done in (0, 1, steps // 2, steps):
        assert predicted_bytes(per, None, done, steps) == {
            "intra_node": per.intra_node * done,
            "intra_site": per.intra_site * done,
            "wan": per.wan * done,
        }


def test_a_wan_auto_schedule_is_predicted_phase_by_phase() -> None:
    """A narrow link: a dense fp16 warm-up, then outer steps; each phase carries its own
    bytes on the plan's placement, and the prefix follows them."""
    steps = 40
    topo = copy.deepcopy(THREE_SITES)
    for site in topo["sites"]:
        site["nodes"][0]["gpu"]["tflops"] = 0.01
    for link in topo["links"]:
        link.update(bandwidth_gbps=0.05, latency_ms=1)
    job = JobSpec.model_validate(tiny_job(2, 1, 1, steps, wan="auto"))
    plan = plan_job(Topology.model_validate(topo), job, settings=SolverSettings(time_limit=2))
    assert plan.wan_auto is not None
    warm, steady = plan.wan_auto.schedule()
    assert warm.bytes_per_iteration is not None and steady.bytes_per_iteration is not None
    assert warm.bytes_per_iteration.exchange is None  # fp16 every step
    assert steady.bytes_per_iteration == plan.bytes_per_iteration  # the plan's own sync
    sites = _sites(plan)
    par = job.fixed_parallel
    expected = run_wan_bytes(
        job,
        par,
        sites,
        [(warm.compression, steady.start), (steady.compression, steps - steady.start)],
    )
    assert predicted_bytes(plan.bytes_per_iteration, plan.wan_auto, steps, steps)["wan"] == expected
    # Through the warm-up: fp16 steps only.
    assert predicted_bytes(plan.bytes_per_iteration, plan.wan_auto, steady.start, steps) == {
        k: v * steady.start
        for k, v in warm.bytes_per_iteration.model_dump(
            include={"intra_node", "intra_site", "wan"}
        ).items()
    }
    # A plan recorded without phase bytes falls back to its own figure throughout.
    bare = plan.wan_auto.model_copy(
        update={
            "phases": [
                p.model_copy(update={"bytes_per_iteration": None}) for p in plan.wan_auto.phases
            ]
        }
    )
    assert predicted_bytes(plan.bytes_per_iteration, bare, steps, steps) == predicted_bytes(
        plan.bytes_per_iteration, None, steps, steps
    )


def test_six_replicas_on_two_sites_exchange_in_the_site_and_across() -> None:
    """The case the property test must reach: several replicas per site (an in-site
    broadcast per outer step) and several sites (pseudo-gradients across)."""
    _, plan = _plan(6, 1, 10, {"wan": "outer", "every": 4, "values": "int8"})
    exchange = plan.bytes_per_iteration.exchange
    assert exchange is not None and _sites(plan) >= 2
    assert exchange.wan > 0 and exchange.intra_site > 0 and exchange.step_intra_site > 0
    test_an_outer_plans_prefix_is_its_exchanges_whole.hypothesis.inner_test(  # type: ignore[attr-defined]
        dp=6, every=4, steps=10, values="int8"
    )
