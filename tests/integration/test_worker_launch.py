"""Orders through the whole path: the control layer's dispatcher → WatchAssignments → a real
`cpn agent` process → real worker processes with the torch.distributed environment →
status lines → ReportTaskStatus → the registry."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from cpn.contracts import Plan
from cpn.listen_ports import free_port
from cpn.registry.models import Task, TaskState
from tests.control_harness import ServerThread, control_server
from tests.processes import Proc, agent_argv, wait_until

WORKER = Path(__file__).resolve().parents[1] / "workers" / "report_worker.py"
Setup = tuple[ServerThread, Proc, Path]


def _plan() -> Plan:
    # dp=2 × tp=2, both replicas on this agent's node: ranks 0-3, one launcher.
    return Plan.model_validate(
        {
            "job": "tiny",
            "parallel": {"dp": 2, "tp": 2, "pp": 1},
            "micro_batches": 1,
            "shards": [
                {"replica": 0, "stage": 0, "site": "a", "node": "a-node", "gpus": [2, 3]},
                {"replica": 1, "stage": 0, "site": "a", "node": "a-node", "gpus": [0, 1]},
            ],
            "bytes_per_iteration": {"intra_node": 0, "intra_site": 0, "wan": 1},
            "predicted_iteration_seconds": 1.0,
            "breakdown": {"compute": 1.0, "pipeline": 0, "dp_sync": 0, "bubble": 0},
            "price_per_hour": 0,
            "solver": {"status": "OPTIMAL", "seconds": 0, "objective": 1, "bound": 1, "gap": 0},
        }
    )


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[ServerThread, Proc, Path]]:
    with control_server(
        f"sqlite:///{tmp_path}/cpn.db", lease_ttl_s=10.0, heartbeat_interval_s=0.5
    ) as srv:
        command = f"{{python}} {WORKER} {{plan}}"
        agent = Proc(
            agent_argv(
                "a", srv.server.port, tmp_path, "--virtual-gpus", "4", "--worker-command", command
            ),
            tmp_path / "agent.log",
        )
        try:
            leases = srv.server.leases
            registered = lambda: srv.on_loop(lambda: leases.for_agent("a", "a-a-node"))  # noqa: E731
            wait_until(registered, 60, "the agent to register", agent)
            yield srv, agent, tmp_path / "work-a"
        finally:
            agent.stop()


def _tasks(srv: ServerThread, job: str) -> dict[int, Task]:
    with srv.registry.read() as s:
        return {t.rank: t for t in s.scalars(select(Task).where(Task.job_id == job))}


def _states(srv: ServerThread, job: str) -> set[TaskState]:
    return {t.state for t in _tasks(srv, job).values()}


def _launch(srv: ServerThread, job: str, mode: str) -> None:
    srv.server.dispatcher.launch(
        "a",
        "a-a-node",
        job_id=job,
        plan=_plan(),
        job_yaml="name: tiny\n",
        master_addr="127.0.0.1",
        master_port=free_port(),
        env={"WORKER_MODE": mode},
    )


def test_a_launch_runs_this_agents_ranks_and_reports_them(
    setup: tuple[ServerThread, Proc, Path],
) -> None:
    srv, agent, work = setup
    _launch(srv, "job-ok", "ok")

    def done() -> bool:
        tasks = _tasks(srv, "job-ok")
        return sorted(tasks) == [0, 1, 2, 3] and all(
            t.state == TaskState.SUCCEEDED for t in tasks.values()
        )

    wait_until(done, 90, "every rank to succeed", agent)
    for rank, task in _tasks(srv, "job-ok").items():
        assert (task.site, task.agent_id, task.step, task.exit_code) == ("a", "a-a-node", 3, 0)
        assert task.loss == pytest.approx(1 / 3) and task.checkpoint_id == "ckpt-3"
        assert (task.bytes_intra_node, task.bytes_intra_site, task.bytes_wan) == (3, 30, 300)
        env = json.loads((work / "job-ok" / f"env-rank-{rank}.json").read_text())
        assert env == {
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(rank),
            "CPN_PLAN_RANKS": "0,1,2,3",
            "CPN_JOB_ID": "job-ok",
            "CPN_SITE": "a",
            "CPN_NODE": "a-node",
            "CPN_RUN_DIR": str(work / "job-ok"),
            "WORKER_MODE": "ok",
            "plan_exists": "True",
            "has_store": "True",
        }
    assert Plan.model_validate_json((work / "job-ok" / "plan.json").read_text()) == _plan()


def test_a_stop_order_ends_running_workers(setup: Setup) -> None:
    srv, agent, _ = setup
    _launch(srv, "job-long", "sleep")

    def steps() -> list[int]:
        return [t.step for t in _tasks(srv, "job-long").values()]

    wait_until(lambda: steps() == [3] * 4, 90, "every rank to report step 3", agent)
    assert {t.state for t in _tasks(srv, "job-long").values()} == {TaskState.RUNNING}
    srv.server.dispatcher.stop("a", "a-a-node", job_id="job-long", reason="cancelled by test")
    wait_until(
        lambda: _states(srv, "job-long") == {TaskState.STOPPED},
        60,
        "every rank to be stopped",
        agent,
    )
    assert {t.message for t in _tasks(srv, "job-long").values()} == {"cancelled by test"}


def test_a_failing_worker_is_reported_with_its_exit_code(
    setup: tuple[ServerThread, Proc, Path],
) -> None:
    srv, agent, _ = setup
    _launch(srv, "job-bad", "fail")
    ended = {TaskState.FAILED, TaskState.STOPPED}

    def all_ended() -> bool:
        tasks = _tasks(srv, "job-bad")
        return len(tasks) == 4 and {t.state for t in tasks.values()} <= ended

    wait_until(all_ended, 90, "every rank to end", agent)
    tasks = _tasks(srv, "job-bad").values()
    failed = [t for t in tasks if t.state == TaskState.FAILED]
    # The launcher ends the node's other workers as soon as one fails; those that had
    # failed by themselves by then are reported failed too, each with its status.
    assert failed, "the failing worker is reported FAILED"
    for t in failed:
        assert (t.exit_code, t.message) == (3, "exited with 3: the worker was told to fail")
    for t in tasks:
        if t.state == TaskState.STOPPED:
            assert t.message.startswith("ended because worker")
