"""The orchestration loop's queue, one tick at a time, on SQLite and PostgreSQL: jobs behind
a head that does not fit wait behind it, and a blocked queue is not planned again for
every newcomer — only when a job comes ahead of the head or capacity changes."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from cpn import scheduler
from cpn.contracts import JobSpec
from cpn.control.settings import ControlSettings
from cpn.orchestration import JobService, Principal, loop
from cpn.orchestration.loop import Orchestrator
from cpn.orchestration.tenants import create_key
from cpn.registry import Registry
from cpn.registry.models import Job, JobState, Role, Tenant
from tests.control_harness import control_server
from tests.registry_factories import node, register
from tests.service_harness import tiny_job


def _state(registry: Registry, job_id: str) -> tuple[JobState, str]:
    with registry.read() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job.state, job.state_reason


def test_a_blocked_queue_is_planned_again_only_when_something_changes(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No periodic retry inside this test: only what happens may trigger planning.
    monkeypatch.setattr(loop, "ADMISSION_RETRY_S", 1e9)
    register(registry, "a", nodes=(node("a0", gpus=4, memory_gb=16),), probe_address="10.0.0.1:1")
    with registry.write() as s:
        create_key(s, "t")
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == "t"))
    assert tenant_id is not None
    principal = Principal(tenant_id, "t", Role.USER)
    settings = ControlSettings(database_url=registry.url, plan_time_limit_s=2.0)
    service: JobService | None = None

    def submit(name: str, priority: int = 0) -> str:
        spec = JobSpec.model_validate(tiny_job(name, priority=priority))  # 4 GPUs each
        assert service is not None
        return service.submit(principal, spec)[0].job.id

    with control_server(registry.url, migrate=False) as server:
        orchestrator = Orchestrator(server.server, registry)
        service = JobService(registry, settings, wake=orchestrator.wake)  # as `cpn serve` does

        def attempts() -> float:
            value = orchestrator.metrics.prometheus.get_sample_value("cpn_admission_seconds_count")
            return value or 0.0

        first, second = submit("first"), submit("second")
        orchestrator.tick()
        assert _state(registry, first)[0] is JobState.SCHEDULED
        state, reason = _state(registry, second)
        assert state is JobState.PENDING and reason.startswith("waiting: ")
        tried = attempts()

        # Newcomers behind the blocked head: their reasons are set, nothing is planned.
        later = [submit(f"later-{i}") for i in range(3)]
        orchestrator.tick()
        assert attempts() == tried
        assert _state(registry, second)[1] == reason
        for job_id in later:
            assert _state(registry, job_id) == (
                JobState.PENDING,
                f"queued behind job {second} (second, priority 0)",
            )

        # A job ahead of the head is tried at once, and becomes what the others wait for.
        urgent = submit("urgent", priority=5)
        orchestrator.tick()
        assert attempts() == tried + 1
        assert _state(registry, urgent)[1].startswith("waiting: ")
        assert _state(registry, second)[1] == f"queued behind job {urgent} (urgent, priority 5)"

        # Capacity freed: the head is admitted, in priority order.
        service.cancel(principal, first)
        orchestrator.tick()  # the cancelled job's GPUs are freed, then the queue admitted
        assert _state(registry, urgent)[0] is JobState.SCHEDULED
        assert _state(registry, second)[0] is JobState.PENDING
        assert _state(registry, later[0])[1] == f"queued behind job {second} (second, priority 0)"


def test_a_job_whose_planning_raises_unexpectedly_fails_and_the_queue_goes_on(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    register(registry, "a", nodes=(node("a0", gpus=4, memory_gb=16),), probe_address="10.0.0.1:1")
    with registry.write() as s:
        create_key(s, "t")
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == "t"))
    assert tenant_id is not None
    principal = Principal(tenant_id, "t", Role.USER)
    settings = ControlSettings(database_url=registry.url, plan_time_limit_s=2.0)

    def plan_job(topology: Any, spec: JobSpec, *args: Any, **kwargs: Any) -> Any:
        if spec.name == "cursed":  # a planner bug that only this job's input triggers
            raise ZeroDivisionError("division by zero")
        return scheduler.plan_job(topology, spec, *args, **kwargs)

    monkeypatch.setattr("cpn.orchestration.admission.plan_job", plan_job)
    with control_server(registry.url, migrate=False) as server:
        orchestrator = Orchestrator(server.server, registry)
        service = JobService(registry, settings, wake=orchestrator.wake)
        jobs = [
            service.submit(principal, JobSpec.model_validate(tiny_job(name, priority=p)))[0]
            for name, p in (("cursed", 5), ("fine", 0))
        ]
        orchestrator.tick()  # no exception: the tick goes on past the cursed job
        state, reason = _state(registry, jobs[0].job.id)
        assert state is JobState.FAILED
        assert reason == (
            "cpn could not plan it: internal error (ZeroDivisionError: division by zero); "
            "the control plane's log has the details"
        )
        assert _state(registry, jobs[1].job.id)[0] is JobState.SCHEDULED
