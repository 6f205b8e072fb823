"""The control plane and the runtime together: two agents (real processes, one virtual GPU
each) register; the scheduler plans a tiny job on the topology built from the registry;
the plan's GPUs are allocated; launch orders go to both agents, which run the real
`cpn worker` for their ranks through the runtime's launcher (one node each, meeting at
the c10d rendezvous the orders name); the workers' per-step metrics come back through
ReportTaskStatus."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select

from cpn.contracts import JobSpec, Reservations, Topology
from cpn.listen_ports import free_port
from cpn.registry import allocate_gpus, build_topology, create_job
from cpn.registry.models import Task, TaskState
from cpn.scheduler import plan_job
from tests.control_harness import ServerThread, control_server
from tests.processes import Proc, agent_argv, wait_until

STEPS = 4
JOB = {
    "name": "tiny",
    "model": {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 128},
    "train": {"global_batch": 4, "micro_batch": 1, "dtype": "fp32", "steps": STEPS, "lr": 0.001},
    "parallel": {"dp": 2, "tp": 1, "pp": 1},
    "compression": {"wan": "none"},
}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[ServerThread, list[Proc]]]:
    with control_server(f"sqlite:///{tmp_path}/cpn.db", lease_ttl_s=10.0) as srv:
        agents = [
            Proc(
                agent_argv(
                    site,
                    srv.server.port,
                    tmp_path,
                    "--virtual-gpus",
                    "1",
                    "--gpu-memory-gb",
                    "16",
                    "--gpu-tflops",
                    "10",
                ),
                tmp_path / f"agent-{site}.log",
            )
            for site in ("a", "b")
        ]
        try:
            yield srv, agents
        finally:
            for agent in agents:
                agent.stop()


def test_a_plan_from_the_registry_runs_on_the_agents(
    cluster: tuple[ServerThread, list[Proc]],
) -> None:
    srv, agents = cluster

    def topology() -> tuple[Topology, Reservations] | None:
        with srv.registry.read() as s:
            try:
                topo, held = build_topology(s)
            except Exception:
                return None
        return (topo, held) if len(topo.sites) == 2 and topo.links else None

    topo, held = wait_until(topology, 60, "two live sites and a measured link", agents[0])
    job = JobSpec.model_validate(JOB)
    plan = plan_job(topo, job, held)
    assert {s.site for s in plan.shards} == {"a", "b"}  # one GPU per site: both are needed
    with srv.registry.write() as s:
        create_job(s, "job-1", "tiny", JOB)
        wanted: dict[str, dict[str, list[int]]] = {}
        for shard in plan.shards:
            wanted.setdefault(shard.site, {}).setdefault(shard.node, []).extend(shard.gpus)
        assert allocate_gpus(s, "job-1", wanted) == 2
    port = free_port()
    for site in ("a", "b"):
        srv.server.dispatcher.launch(
            site,
            f"{site}-{site}-node",
            job_id="job-1",
            plan=plan,
            job_yaml=yaml.safe_dump(JOB),
            master_addr="127.0.0.1",
            master_port=port,
        )

    def finished() -> dict[int, Task] | None:
        with srv.registry.read() as s:
            tasks = {t.rank: t for t in s.scalars(select(Task).where(Task.job_id == "job-1"))}
        states = {t.state for t in tasks.values()}
        if TaskState.FAILED in states:
            raise AssertionError(f"a worker failed: {[t.message for t in tasks.values()]}")
        return tasks if len(tasks) == 2 and states == {TaskState.SUCCEEDED} else None

    tasks = wait_until(finished, 180, "both workers to finish", agents[0])
    for rank, task in tasks.items():
        assert task.step == STEPS, rank
        assert task.loss is not None and task.loss > 0
        assert task.bytes_wan > 0  # the two replicas sync gradients across the WAN
        assert task.site == plan.ranks()[rank].site
