"""A site behind Slurm, end to end: `cpn serve`, an agent with local processes (site a,
2 GPUs) and an agent with `--backend slurm` (site b: a real Slurm cluster of two nodes
with one GPU each, tests/slurm_cluster.py). A job of 4 GPUs needs both sites; its shard
on b runs as one Slurm job over two nodes (torch's elastic agent on each, node ranks
fixed by node name), it trains and SUCCEEDS with the same losses as the same plan run
on this machine alone. Then the Slurm agent is killed mid-run and restarted: it adopts
its running Slurm job (one Slurm job, not two) and the job still succeeds; a cancel
leaves no job of cpn's in `squeue` within 10 s. And the site's failures, each judged
by who caused it: an outside `scancel` fails the job by its recovery policy at once; a
preemption and a lost node are losses of infrastructure — planned again (without the
lost node) and resumed from the last checkpoint, not counted as restarts."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.job_schemas import JobPublic
from cpn.client import CpnClient
from cpn.listen_ports import free_port_block
from cpn.train.report import summarise
from tests.processes import CPN, wait_until
from tests.service_harness import Cluster, cluster, make_key, rescheduled, tiny_job
from tests.slurm_cluster import SlurmCluster, slurm_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, SlurmCluster]]:
    root = tmp_path_factory.mktemp("slurm-agent")
    with slurm_cluster(root / "slurm", nodes=2, gpus=1) as slurm:
        env = {"SLURM_CONF": str(slurm.conf)}
        extra = {"b": ["--backend", "slurm", "--slurm-partition", "cpn", "--time-limit", "600"]}
        # Rendezvous ports away from the default range other suites on this host use.
        low = free_port_block(21)
        ports = {"CPN_RENDEZVOUS_PORT_MIN": str(low), "CPN_RENDEZVOUS_PORT_MAX": str(low + 20)}
        # A lease long enough for an agent restart on a loaded machine (the restart test):
        # re-planning a job whose agent was lost is the failure-recovery work's, not this.
        # Checkpoints (the preemption test resumes from one).
        store = {"CPN_CHECKPOINT_ROOT": str(root / "checkpoints")}
        with cluster(
            root, {"a": 2, "b": 0}, "--lease-ttl", "30",
            env={**ports, **store}, agent_extra=extra, agent_env={"b": env},
        ) as c:  # fmt: skip
            yield c, slurm


def _wait_state(client: CpnClient, job_id: str, states: set[str], timeout: float) -> JobPublic:
    def reached() -> JobPublic | None:
        job = client.job(job_id)
        return job if job.state.value in states else None

    return wait_until(reached, timeout, f"job {job_id} to reach {states}")


def _slurm_jobs(slurm: SlurmCluster, job_id: str) -> list[str]:
    """Ids of every Slurm job (any state) of this cpn job."""
    out = slurm.run("squeue", "-h", "-t", "all", "-o", "%i %j")
    return [line.split()[0] for line in out.splitlines() if f"cpn-{job_id}-e" in line]


def _tasks(c: Cluster, job_id: str) -> dict[int, tuple[str, str]]:
    """Each rank's last reported (state, message), from the registry's database."""
    path = c.db_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT rank, state, message FROM tasks WHERE job_id = ?", (job_id,)
        ).fetchall()
    return {int(rank): (str(state), str(message)) for rank, state, message in rows}


def test_a_job_across_a_local_site_and_a_slurm_site(
    sites: tuple[Cluster, SlurmCluster], tmp_path: Path
) -> None:
    c, slurm = sites
    client = c.client(make_key(c.db_url, "alice"))
    job_id = client.submit(tiny_job("across-slurm", steps=4)).id
    job = _wait_state(client, job_id, {"succeeded", "failed"}, 240)
    assert job.state.value == "succeeded", (job.reason, job.failure)
    assert job.plan is not None
    shards = {(s.site, s.node) for s in job.plan.shards}
    assert shards == {("a", "a-node"), ("b", "node1"), ("b", "node2")}
    # One Slurm job ran b's shard, over both nodes, and completed.
    ids = _slurm_jobs(slurm, job_id)
    assert len(ids) == 1
    info = slurm.run("scontrol", "-o", "show", "job", ids[0])
    assert "JobState=COMPLETED" in info and "NodeList=node[1-2]" in info
    # The same plan run on this machine alone gives the same losses, step by step.
    work = c.agents["a"].log.parent / "work-a" / job_id
    local = tmp_path / "local"
    subprocess.run(
        [*CPN, "train", "--plan", str(work / "plan.json"), "--job", str(work / "job.yaml"),
         "--workdir", str(local)],
        capture_output=True, text=True, timeout=180, check=True,
    )  # fmt: skip
    records = [
        json.loads(line)
        for path in sorted(local.glob("rank-*.metrics.jsonl"))
        for line in path.read_text().splitlines()
    ]
    expected = [s.loss for s in summarise(records)]
    series = client.metrics(job_id)
    assert [s.loss for s in series.steps] == expected
    assert len(expected) == 4


def _free_gpus(client: CpnClient, site: str) -> int:
    return int(next(s["gpus_free"] for s in client.sites() if s["name"] == site))


def test_the_slurm_agent_restarted_adopts_its_job(sites: tuple[Cluster, SlurmCluster]) -> None:
    """Adopted across a restart, on a node drained under it: Slurm lets running jobs
    finish on a draining node, so the agent keeps offering the GPUs its launch holds
    there (before the restart and after it) and the job is not planned again; once the
    launch ends the node offers nothing until it is resumed."""
    c, slurm = sites
    client = c.client(make_key(c.db_url, "bob"))
    job_id = client.submit(tiny_job("adopted", steps=300)).id
    _wait_state(client, job_id, {"running"}, 120)
    wait_until(lambda: client.job(job_id).progress.step >= 2, 120, "a few steps")
    slurm.run("scontrol", "update", "nodename=node2", "state=drain", "reason=cpn-test")
    try:
        # Killed: whether the Slurm job is still running when the agent is back or ended
        # while it was away (on a loaded machine either may happen), the agent adopts it.
        c.restart_agent("b")
        job = _wait_state(client, job_id, {"succeeded", "failed"}, 300)
        log = c.agents["b"].text()
        assert job.state.value == "succeeded", (job.reason, job.failure, log[-3000:])
        # Adopted, not launched again (one Slurm job, one epoch, nothing lost).
        assert len(_slurm_jobs(slurm, job_id)) == 1, (job.epoch, job.reason, log[-3000:])
        assert (job.epoch, job.losses, job.restarts) == (1, 0, 0)
        assert "adopted slurm" in log
        assert job.progress.step == 300
        # Once the launch ended, the next capacity check drops the drained node.
        wait_until(lambda: _free_gpus(client, "b") == 1, 60, "drained node2 offered no more")
    finally:
        slurm.run("scontrol", "update", "nodename=node2", "state=resume")
    wait_until(lambda: _free_gpus(client, "b") == 2, 60, "node2 offered again")


def test_an_agent_restarted_within_its_lease_has_its_job_planned_again(
    sites: tuple[Cluster, SlurmCluster],
) -> None:
    """The local site's agent killed and started again at once, well within its 30 s
    lease: no loss is declared, but the new process says which launches it follows
    (none: its workers died with it), so the job is planned again now, not never."""
    c, _ = sites
    client = c.client(make_key(c.db_url, "gina"))
    job_id = client.submit(tiny_job("restarted", steps=100_000)).id
    _wait_state(client, job_id, {"running"}, 120)
    c.restart_agent("a")
    moved = rescheduled(client, job_id, 60)
    job = client.job(job_id)
    assert job.losses == 1 and job.restarts == 0, job.reason
    assert "agent a-a-node restarted and no longer runs this launch" in moved.message, moved
    client.cancel(job_id)
    _wait_state(client, job_id, {"cancelled"}, 60)


def test_cancel_leaves_nothing_in_squeue(sites: tuple[Cluster, SlurmCluster]) -> None:
    c, slurm = sites
    client = c.client(make_key(c.db_url, "carol"))
    job_id = client.submit(tiny_job("cancelled", steps=100_000)).id
    _wait_state(client, job_id, {"running"}, 120)
    ids = _slurm_jobs(slurm, job_id)
    assert len(ids) == 1 and ids[0] in slurm.squeue_ids()
    client.cancel(job_id)
    wait_until(lambda: ids[0] not in slurm.squeue_ids(), 10, "the Slurm job to leave squeue")
    _wait_state(client, job_id, {"cancelled"}, 30)


def test_scancel_from_outside_fails_the_job_with_slurms_word(
    sites: tuple[Cluster, SlurmCluster],
) -> None:
    c, slurm = sites
    client = c.client(make_key(c.db_url, "dave"))
    job_id = client.submit(tiny_job("scancelled", steps=100_000)).id
    _wait_state(client, job_id, {"running"}, 120)
    (slurm_id,) = _slurm_jobs(slurm, job_id)
    slurm.run("scancel", slurm_id)
    started = time.monotonic()
    # Judged at once (the site said who ended it), by the job's recovery policy: fail.
    job = _wait_state(client, job_id, {"failed"}, 30)
    assert time.monotonic() - started < 15
    said = f"CANCELLED: Slurm job {slurm_id} CANCELLED"
    assert job.reason is not None and said in job.reason, job.reason
    assert job.failure is not None and job.failure.site == "b"
    assert job.restarts == 0 and job.losses == 0

    # b's ranks say so in their own state. The job is judged on the first rank's report;
    # the other rank's may come one poll later (a CI run read it still running).
    def both_said() -> bool:
        tasks = _tasks(c, job_id)
        b = [(s, m) for r, (s, m) in tasks.items() if r < 2]
        return len(b) == 2 and all(s == "cancelled" and m.startswith(said) for s, m in b)

    wait_until(both_said, 15, f"site b's ranks to report {said!r}")


def test_a_preempted_slurm_job_resumes_from_its_checkpoint_without_a_restart(
    sites: tuple[Cluster, SlurmCluster],
) -> None:
    c, slurm = sites
    client = c.client(make_key(c.db_url, "frank"))
    # No periodic checkpoint: the one to resume from is the one Slurm's warning asks for.
    # A job that never ends by itself: with a finite one, a busy machine let it finish
    # (final checkpoint) before Slurm got round to the preemption (CI: resumed at 120).
    steps = 100_000
    doc = tiny_job("preempted", steps=steps, recovery={"checkpoint_every": 100_000})
    job_id = client.submit(doc).id
    wait_until(lambda: client.job(job_id).progress.step >= 5, 180, "a few steps")
    (victim,) = _slurm_jobs(slurm, job_id)
    # What `sbatch --signal=USR2@N` does before a time limit, now: SIGUSR2 to the job's
    # steps. The workers agree on a step and checkpoint there, and train on.
    slurm.run("scancel", "--signal=USR2", victim)
    store = c.tmp / "checkpoints" / job_id / "e1"
    wait_until(lambda: list(store.glob("step-*/COMPLETE")), 60, "the warned checkpoint")
    (warned,) = [int(p.parent.name.removeprefix("step-")) for p in store.glob("step-*/COMPLETE")]
    assert 5 <= warned < steps
    # A job of the higher-priority partition takes node1: Slurm preempts cpn's (CANCEL).
    slurm.run(
        "sbatch", "--parsable", "-p", "urgent", "--nodelist=node1", "--exclusive",
        "--time=1", f"--output={c.tmp}/urgent.out", "--wrap", "sleep 6",
    )  # fmt: skip
    moved = rescheduled(client, job_id, 30)
    assert f"PREEMPTED: Slurm job {victim} PREEMPTED" in moved.message, moved.message
    assert int(moved.data["checkpoint"]["step"]) == warned

    # Steps past any the first epoch reached are the second epoch's.
    first = len(client.metrics(job_id).steps)

    def resumed_and_trained_on() -> JobPublic | None:
        job = client.job(job_id)
        assert job.state.value not in {"failed", "cancelled", "succeeded"}, (
            job.reason,
            job.failure,
        )
        grown = len(client.metrics(job_id).steps) >= first + 10
        return job if job.epoch == 2 and grown else None

    job = wait_until(resumed_and_trained_on, 300, "the second epoch to train 10 steps on")
    # A loss of infrastructure, not one of the job's restarts.
    assert job.losses == 1 and job.restarts == 0
    # The second epoch ran from the warned step: every step once, in order.
    series = [s.step for s in client.metrics(job_id).steps]
    assert series == list(range(len(series)))
    assert len(_slurm_jobs(slurm, job_id)) == 2  # one Slurm job per epoch
    client.cancel(job_id)
    _wait_state(client, job_id, {"cancelled"}, 60)


def test_a_lost_slurm_node_is_planned_again_without_it(
    sites: tuple[Cluster, SlurmCluster],
) -> None:
    c, slurm = sites
    client = c.client(make_key(c.db_url, "erin"))
    job_id = client.submit(tiny_job("node-lost", steps=100_000)).id
    _wait_state(client, job_id, {"running"}, 120)
    (slurm_id,) = _slurm_jobs(slurm, job_id)
    slurm.kill_node("node2")
    try:
        moved = rescheduled(client, job_id, 90)
        job = _wait_state(client, job_id, {"running"}, 180)
        # Planned again on what is left: node2 is no longer offered (the agent registered
        # the site's nodes again), and the loss is not counted as a restart.
        assert job.plan is not None
        assert ("b", "node2") not in {(s.site, s.node) for s in job.plan.shards}
        assert job.losses == 1 and job.restarts == 0
        assert "node2" in moved.message or f"NODE_LOST: Slurm job {slurm_id}" in moved.message
        client.cancel(job_id)
        _wait_state(client, job_id, {"cancelled"}, 60)
    finally:
        slurm.start_node("node2")
