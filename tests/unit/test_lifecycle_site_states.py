"""A job's ranks ended by their site's engine (Slurm, Kubernetes), on SQLite and PostgreSQL:
judged at once — no settling time, the site said who ended them — and by the cause: a
preemption or a lost node is a loss of infrastructure (RESCHEDULING, not a restart), a
cancel at the site goes to the job's recovery policy; the workers' failures beside them
(their peers vanished) never decide. A rank the engine still queues is not an end."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from agents.agent import FENCED_REASON
from cpn.contracts import JobSpec
from cpn.control.settings import ControlSettings
from cpn.orchestration import JobService, Principal, lifecycle
from cpn.orchestration.tenants import create_key
from cpn.registry import Registry
from cpn.registry.allocations import allocate_gpus, create_job
from cpn.registry.leases import mark_lost
from cpn.registry.models import Job, JobState, Role, Task, TaskState, Tenant, utcnow
from tests.registry_factories import node, register
from tests.service_harness import tiny_job

#: Long enough that a test would notice a judgement that waited for it.
SETTLE_S = 3600.0


def _running_job(registry: Registry, **spec: Any) -> str:
    """A RUNNING job of 4 ranks (dp 2 × pp 2) in epoch 1, as the loop leaves it."""
    with registry.write() as s:
        create_key(s, "t")
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == "t"))
    assert tenant_id is not None
    settings = ControlSettings(database_url=registry.url)
    service = JobService(registry, settings)
    job_spec = JobSpec.model_validate(tiny_job("site-ended", **spec))
    job_id = service.submit(Principal(tenant_id, "t", Role.USER), job_spec)[0].job.id
    with registry.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.state, job.epoch = JobState.RUNNING, 1
        job.plan = {"parallel": {"dp": 2, "tp": 1, "pp": 2}}
    return job_id


def _judge(
    registry: Registry,
    job_id: str,
    ranks: dict[int, tuple[TaskState, str]],
    settle_s: float = SETTLE_S,
) -> Job:
    """Ranks 0 and 1 at site b, 2 and 3 at site a, in the given states; one advance."""
    with registry.write() as s:
        for rank, (state, message) in ranks.items():
            s.add(
                Task(
                    job_id=job_id, rank=rank, epoch=1, site="b" if rank < 2 else "a",
                    agent_id="x", state=state, message=message, exit_code=1,
                )
            )  # fmt: skip
        s.flush()
        job = s.get(Job, job_id)
        assert job is not None
        settings = ControlSettings(database_url=registry.url)
        lifecycle.advance(s, job, settings, settle_s)
    with registry.read() as s:
        job = s.get(Job, job_id)
        assert job is not None
        s.expunge(job)
        return job


PEERS_FAILED = (TaskState.FAILED, "exited with 1: the collective's peer closed the connection")


@pytest.mark.parametrize("lost", [TaskState.PREEMPTED, TaskState.NODE_LOST])
def test_a_preemption_or_a_lost_node_is_planned_again_at_once(
    registry: Registry, lost: TaskState
) -> None:
    job_id = _running_job(registry)
    said = f"{lost.name}: Slurm job 7 {lost.name}"
    job = _judge(
        registry,
        job_id,
        {0: (lost, said), 1: (lost, said), 2: PEERS_FAILED, 3: PEERS_FAILED},
    )
    assert job.state is JobState.RESCHEDULING
    assert job.state_reason.startswith(f"rank 0 (b): the site ended it: {said}; epoch 1 fenced")
    assert (job.losses, job.restarts) == (1, 0)


def test_a_loss_of_infrastructure_outweighs_a_cancel_beside_it(registry: Registry) -> None:
    job_id = _running_job(registry)
    job = _judge(
        registry,
        job_id,
        {
            0: (TaskState.CANCELLED, "CANCELLED: Slurm job 7 CANCELLED"),
            1: (TaskState.NODE_LOST, "NODE_LOST: Slurm job 7 NODE_FAIL"),
            2: PEERS_FAILED,
        },
    )
    assert job.state is JobState.RESCHEDULING and "rank 1 (b)" in job.state_reason


@pytest.mark.parametrize(
    ("recovery", "expected", "restarts"),
    [
        ({}, JobState.FAILED, 0),
        ({"max_restarts": 2, "on_worker_error": "restart"}, JobState.RESCHEDULING, 1),
    ],
)
def test_a_cancel_at_the_site_goes_to_the_recovery_policy_at_once(
    registry: Registry, recovery: dict[str, Any], expected: JobState, restarts: int
) -> None:
    job_id = _running_job(registry, recovery=recovery)
    said = "CANCELLED: Slurm job 7 CANCELLED"
    job = _judge(
        registry,
        job_id,
        {2: PEERS_FAILED, 0: (TaskState.CANCELLED, said), 1: (TaskState.CANCELLED, said)},
    )
    assert job.state is expected
    assert said in job.state_reason and job.state_reason.startswith("rank 0 (b)")
    assert (job.losses, job.restarts) == (0, restarts)
    if expected is JobState.FAILED:
        assert job.failure is not None
        assert (job.failure["rank"], job.failure["site"]) == (0, "b")


def test_a_worker_failure_alone_still_waits_to_see_whether_a_site_was_lost(
    registry: Registry,
) -> None:
    job_id = _running_job(registry)
    job = _judge(registry, job_id, {2: PEERS_FAILED, 3: PEERS_FAILED})
    assert job.state is JobState.RUNNING


def test_ranks_the_engine_still_queues_are_live_and_not_an_end(registry: Registry) -> None:
    job_id = _running_job(registry)
    queued = (TaskState.PENDING, "PENDING: Slurm job 7 PENDING (Resources)")
    running = (TaskState.RUNNING, "")
    job = _judge(registry, job_id, {0: queued, 1: queued, 2: running, 3: running})
    assert job.state is JobState.RUNNING
    with registry.read() as s:
        row = s.get(Job, job_id)
        assert row is not None
        assert lifecycle.live_tasks(s, row) == 4


@pytest.mark.parametrize("how", ["registered away", "agent lost"])
@pytest.mark.parametrize(
    ("b_ranks", "ended"),
    [
        ({}, False),  # nothing reported at b: its node's loss is the job's
        ({2: TaskState.SUCCEEDED}, False),  # one of b's two ranks still to finish
        ({2: TaskState.SUCCEEDED, 3: TaskState.RUNNING}, False),
        ({2: TaskState.SUCCEEDED, 3: TaskState.SUCCEEDED}, True),
        ({2: TaskState.FAILED, 3: TaskState.STOPPED}, True),
    ],
)
def test_a_node_registered_away_after_its_sites_ranks_all_ended_is_no_loss(
    registry: Registry, b_ranks: dict[int, TaskState], ended: bool, how: str
) -> None:
    """A site engine's agent registers a drained node away once the launch on it ended,
    while the other sites' ranks may still be finishing: the job keeps going (or is
    judged by how the ranks ended). An agent lost is a loss whatever its ranks said."""
    register(registry, "a", nodes=(node("a-n0", gpus=2),))
    b = register(registry, "b", nodes=(node("b-n0", gpus=2),))
    with registry.write() as s:
        create_job(s, "j", "j").epoch = 1
        allocate_gpus(s, "j", {"a": {"a-n0": [0, 1]}, "b": {"b-n0": [0, 1]}})
        for rank in (0, 1):  # a's ranks run on
            s.add(Task(job_id="j", rank=rank, epoch=1, site="a", agent_id="x",
                       state=TaskState.RUNNING))  # fmt: skip
        for rank, state in b_ranks.items():
            s.add(Task(job_id="j", rank=rank, epoch=1, site="b", agent_id="x", state=state))
        # A rank of b that ended in an earlier epoch does not count.
        s.add(Task(job_id="j", rank=9, epoch=0, site="b", agent_id="x",
                   state=TaskState.SUCCEEDED))  # fmt: skip
        if how == "agent lost":
            mark_lost(s, b.agent_pk, b.lease_id, utcnow(), "test")
    if how == "registered away":  # the same agent, alive, without the node
        register(registry, "b", nodes=(node("b-n1", gpus=2),))
    with registry.write() as s:
        found = lifecycle.lost_gpus(s, ["j"])
    assert found == ({} if ended and how == "registered away" else {"j": "b/b-n0"})


@pytest.mark.parametrize(
    ("b_stopped", "expected", "losses"),
    [
        # b's agent fenced its ranks (cut off for a lease TTL); a's failed on their broken
        # collectives before their own agent's fence: b's loss, not a's failure.
        ("fenced: no contact with the control plane for 4 s", JobState.RESCHEDULING, 1),
        # The same failures beside ranks stopped otherwise are the job's (default policy).
        ("stopped: the launcher ended", JobState.FAILED, 0),
    ],
)
def test_failures_beside_a_fenced_rank_are_its_consequences(
    registry: Registry, b_stopped: str, expected: JobState, losses: int
) -> None:
    job_id = _running_job(registry)
    if b_stopped.startswith("fenced"):  # what a fenced agent really says
        b_stopped = FENCED_REASON.format(silent=4.2)
    b = (TaskState.STOPPED, b_stopped)
    job = _judge(registry, job_id, {0: b, 1: b, 2: PEERS_FAILED, 3: PEERS_FAILED}, settle_s=0.0)
    assert job.state is expected, job.state_reason
    assert (job.losses, job.restarts) == (losses, 0)
    if expected is JobState.RESCHEDULING:
        assert job.state_reason.startswith("rank 0 (b) was stopped by its agent: fenced:")
