"""`compression: {wan: auto}`: the scheduler picks the WAN sync from the links the site
agents measured (registry heartbeats → `build_topology` → `plan_job`), on SQLite and
PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest

from cpn.contracts import JobSpec, Plan, WanCompression
from cpn.costmodel import Workload
from cpn.registry import Registry, apply_heartbeats, build_topology
from cpn.registry.leases import HeartbeatRecord, LinkSample
from cpn.registry.models import utcnow
from cpn.scheduler import SolverSettings, plan_job
from cpn.wan_schedule import rung_of
from tests.factories import link, site, topology
from tests.registry_factories import node, register

FAST = SolverSettings(time_limit=3)


def _job(wan: str = "auto", steps: int = 10, **extra: object) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "auto",
            # 13.6 M parameters, 0.5 M tokens per replica and iteration: on A100s a dense
            # bf16 ring over 10 Gbit/s takes about 7 % of the compute, over 50 Mbit/s 14×.
            "model": {"layers": 4, "hidden": 512, "heads": 8, "seq_len": 1024, "vocab": 1000},
            "train": {"global_batch": 1024, "micro_batch": 8, "dtype": "bf16", "steps": steps},
            "parallel": {"dp": 2, "tp": 1, "pp": 1},
            "compression": {"wan": wan, **extra},
        }
    )


def _plan_on_measured_link(registry: Registry, gbps: float, rtt_ms: float) -> Plan:
    # One GPU per site: the two replicas must be at two sites, across the measured link.
    a = register(registry, "a", nodes=(node("a0", gpus=1),))
    register(registry, "b", nodes=(node("b0", gpus=1),))
    now = utcnow()
    with registry.write() as s:
        apply_heartbeats(s, [HeartbeatRecord(
            agent_pk=a.agent_pk, lease_pk=a.lease_pk, site_id=a.site_id, agent_id="a-agent",
            at=now, expires_at=now + timedelta(hours=1), health="ok",
            links=(LinkSample("b", gbps, rtt_ms, now),),
        )])  # fmt: skip
    with registry.read() as s:
        topology, held = build_topology(s)
    [link] = topology.links
    assert (link.bandwidth_gbps, link.latency_ms) == (gbps, rtt_ms / 2)
    return plan_job(topology, _job(), held, settings=FAST)


@pytest.mark.parametrize(("gbps", "rtt_ms"), [(10.0, 2.0), (0.05, 40.0)])
def test_auto_follows_the_measured_link(registry: Registry, gbps: float, rtt_ms: float) -> None:
    plan = _plan_on_measured_link(registry, gbps, rtt_ms)
    auto = plan.wan_auto
    assert auto is not None
    assert plan.compression == auto.compression
    assert plan.compression.wan is not WanCompression.AUTO
    assert plan.problem_with(_job()) is None  # bound to the job as submitted (wan: auto)
    assert auto.wan_gbps == gbps and f"{gbps:g} Gbit/s" in auto.reason
    rung = rung_of(auto.compression)
    # The WAN bytes the plan predicts are those of the chosen sync.
    chosen = Workload.of(_job().model_copy(update={"compression": auto.compression}))
    assert plan.bytes_per_iteration.wan == chosen.dp_wan_bytes(0, 2)
    if gbps == 10.0:
        # A fast link carries a precise per-step sync within 10 % of the compute time...
        assert rung <= 1 and auto.share is not None and auto.share <= 0.1, auto
    else:
        # ... a 50 Mbit/s one needs outer steps (and the choice says how much it costs).
        assert auto.compression.wan is WanCompression.OUTER, auto
        assert rung >= 3, auto


def test_a_tighter_target_is_more_aggressive_and_auto_needs_a_fixed_layout() -> None:
    topo = topology([site("a", gpus=1), site("b", gpus=1)], [link("a", "b", 1, 10)])
    loose = plan_job(topo, _job(target=1.0), settings=FAST)
    tight = plan_job(topo, _job(target=0.001), settings=FAST)
    assert loose.wan_auto is not None and tight.wan_auto is not None
    assert rung_of(tight.compression) > rung_of(loose.compression)
    with pytest.raises(ValueError, match=r"compression\.wan: auto needs a fixed layout"):
        JobSpec.model_validate({**_job().model_dump(mode="json"), "parallel": "auto", "gpus": 2})
    with pytest.raises(ValueError, match="target: only meaningful with wan: auto"):
        _job("fp16", target=0.5)


def test_the_plan_carries_a_schedule_that_the_launch_checks() -> None:
    # 100,000 steps over 1 Gbit/s: a dense fp16 warm-up the budget affords, then outer steps.
    job = _job(steps=100_000)
    topo = topology([site("a", gpus=1), site("b", gpus=1)], [link("a", "b", 1, 10)])
    plan = plan_job(topo, job, settings=FAST)
    auto = plan.wan_auto
    assert auto is not None
    warm, steady = auto.schedule()
    assert (warm.start, warm.compression.wan) == (0, WanCompression.FP16)
    assert 0 < steady.start <= 10_000 and steady.compression == plan.compression
    assert f"after {steady.start} dense fp16 warm-up steps" in auto.reason
    assert (auto.sites, auto.target) == (2, 0.1) and auto.compute_s > 0
    assert plan.derived_problem(job) is None
    # A schedule whose phase starts past the run is refused at launch.
    late = auto.model_copy(update={"phases": [warm, steady.model_copy(update={"start": 100_000})]})
    problem = plan.model_copy(update={"wan_auto": late}).derived_problem(job)
    assert problem is not None and problem.startswith("wan_auto.phases: a phase starts at")
