"""The Slurm backend against a real Slurm cluster on this host (tests/slurm_cluster.py:
slurmctld, four slurmd, munge). Commands here are small shell programs; the agent running
real training through it is tests/integration/test_slurm_agent.py.

Every path the backend takes on a live cluster: nodes picked by name (node rank k is the
plan's node k whatever order Slurm lists them in), a rendezvous port per launch, an
idempotent submit, adopt after a restart, cancel, a cancel from outside, a lost node, a
preemption, a start that can never happen, and the bad inputs (no sbatch, an unreachable
controller, an unknown partition, a launch larger than the partition)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.backends import BackendError, Handle, LaunchSpec, NodeShare, State, Status
from agents.backends.base import PORT_PLACEHOLDER
from agents.backends.slurm import SlurmBackend, SlurmOptions
from tests.slurm_cluster import SlurmCluster, slurm_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    saved = os.environ.get("SLURM_CONF")
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        os.environ["SLURM_CONF"] = str(cluster.conf)
        try:
            yield cluster
        finally:
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved


def _backend(partition: str = "cpn", agent: str = "site-s") -> SlurmBackend:
    return SlurmBackend(SlurmOptions(partition), agent, poll_interval_s=0.3)


def _spec(
    run_dir: Path, job: str, nodes: list[str], script: str, *, epoch: int = 0, gpus: int = 1
) -> LaunchSpec:
    """A launch whose node k runs `bash -c script` with K, the node and the port as $1 $2 $3."""
    shares = tuple(NodeShare(n, (k,), tuple(range(gpus))) for k, n in enumerate(nodes))
    commands = tuple(
        ("bash", "-c", script, "node", str(k), n, PORT_PLACEHOLDER) for k, n in enumerate(nodes)
    )
    return LaunchSpec(
        job_id=job,
        nodes=shares,
        commands=commands,
        run_dir=run_dir / job,
        env={"CPN_TEST": "yes"},
        time_limit_s=600,
        epoch=epoch,
    )


def _until(backend: SlurmBackend, handle: Handle, states: set[State], timeout: float) -> Status:
    async def go() -> Status:
        deadline = time.monotonic() + timeout
        status = await backend.poll(handle)
        while status.state not in states:
            if time.monotonic() > deadline:
                raise AssertionError(f"{handle.native_id}: {status} after {timeout} s")
            await asyncio.sleep(0.3)
            status = await backend.poll(handle)
        return status

    return asyncio.run(go())


def test_capacity_is_what_slurm_offers(slurm: SlurmCluster) -> None:
    backend = _backend()
    asyncio.run(backend.check())
    capacity = asyncio.run(backend.capacity())
    assert [(n.name, n.gpus, n.usable, n.address) for n in capacity.nodes] == [
        (f"node{i}", 2, True, "127.0.0.1") for i in range(1, 5)
    ]
    assert capacity.gpus == 8


def test_nodes_by_name_ports_apart_and_an_idempotent_submit(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    backend = _backend()
    # Node rank 0 is node2: Slurm lists node1 first, the launch must not care.
    hold = (
        'echo "$1 $2 $3 $CPN_TEST $CUDA_VISIBLE_DEVICES"; '
        'if [ "$1" = 0 ]; then exec python3 -c "import socket,time; s=socket.socket(); '
        "s.bind(('', int('$3'))); s.listen(); time.sleep(60)\"; fi; sleep 60"
    )
    spec = _spec(tmp_path, "j-ports", ["node2", "node1"], hold)
    first = asyncio.run(backend.submit(spec))
    again = asyncio.run(backend.submit(spec))
    assert again is first
    # A new backend (the agent restarted) submitting the same (job, epoch) finds it too.
    assert asyncio.run(_backend().submit(spec)).native_id == first.native_id
    assert slurm.squeue_ids().count(first.native_id) == 1
    _until(backend, first, {State.RUNNING}, 30)
    logs = [backend.logs(first, k) for k in (0, 1)]
    deadline = time.monotonic() + 20
    while not all(p.exists() and p.read_text().strip() for p in logs):
        assert time.monotonic() < deadline, "the nodes' launcher logs stayed empty"
        time.sleep(0.2)
    lines = [p.read_text().split() for p in logs]
    assert [line[:2] for line in lines] == [["0", "node2"], ["1", "node1"]]
    port = lines[0][2]
    assert port.isdigit() and lines[1][2] == port  # every node reads the head's port
    assert lines[0][3] == "yes" and lines[0][4] == "0"  # env, and the GPU Slurm gave
    # A second launch with the same head node while the first holds its port: another port.
    other = asyncio.run(backend.submit(_spec(tmp_path, "j-ports2", ["node2"], hold)))
    _until(backend, other, {State.RUNNING}, 30)
    log2 = backend.logs(other, 0)
    deadline = time.monotonic() + 20
    while not (log2.exists() and log2.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert log2.read_text().split()[2] != port
    for handle in (first, other):
        asyncio.run(backend.cancel(handle, 2))


def test_a_launch_that_succeeds_and_one_that_fails(slurm: SlurmCluster, tmp_path: Path) -> None:
    backend = _backend()
    ok = asyncio.run(backend.submit(_spec(tmp_path, "j-ok", ["node1", "node3"], "exit 0")))
    bad = asyncio.run(
        backend.submit(_spec(tmp_path, "j-bad", ["node2"], 'echo "broken on $2"; exit 7'))
    )
    done = _until(backend, ok, {State.SUCCEEDED, State.FAILED}, 30)
    assert (done.state, done.native, done.exit_code) == (State.SUCCEEDED, "COMPLETED", 0)
    failed = _until(backend, bad, {State.SUCCEEDED, State.FAILED}, 30)
    assert (failed.state, failed.native, failed.exit_code) == (State.FAILED, "FAILED", 7)
    assert backend.logs(bad, 0).read_text().strip() == "broken on node2"


def test_cancel_leaves_nothing_in_squeue(slurm: SlurmCluster, tmp_path: Path) -> None:
    backend = _backend()
    handle = asyncio.run(
        backend.submit(_spec(tmp_path, "j-cancel", ["node1", "node2"], "sleep 300"))
    )
    _until(backend, handle, {State.RUNNING}, 30)
    started = time.monotonic()
    asyncio.run(backend.cancel(handle, 2))
    while handle.native_id in slurm.squeue_ids():
        assert time.monotonic() - started < 10, "the cancelled job is still in squeue"
        time.sleep(0.2)
    assert asyncio.run(backend.poll(handle)).ended


def test_adopt_finds_this_agents_jobs_only(slurm: SlurmCluster, tmp_path: Path) -> None:
    backend = _backend(agent="adopter")
    handle = asyncio.run(
        backend.submit(_spec(tmp_path, "j-adopt", ["node3", "node4"], "sleep 300", epoch=4))
    )
    _until(backend, handle, {State.RUNNING}, 30)
    found = asyncio.run(_backend(agent="adopter").adopt())
    assert [(h.job_id, h.epoch, h.native_id) for h in found] == [("j-adopt", 4, handle.native_id)]
    assert found[0].nodes == handle.nodes and found[0].run_dir == handle.run_dir
    assert asyncio.run(_backend(agent="someone-else").adopt()) == []
    asyncio.run(backend.cancel(handle, 1))
    # Ended while "the agent was away": still adopted, so that its end gets reported.
    (ended,) = asyncio.run(_backend(agent="adopter").adopt())
    assert ended.native_id == handle.native_id
    # (FAILED with 143 when SIGTERM ended the script first, CANCELLED when scancel did)
    assert asyncio.run(backend.poll(ended)) == asyncio.run(backend.poll(handle))
    assert asyncio.run(backend.poll(ended)).ended


def test_scancel_from_outside_is_noticed_in_one_poll(slurm: SlurmCluster, tmp_path: Path) -> None:
    backend = _backend()
    handle = asyncio.run(backend.submit(_spec(tmp_path, "j-outside", ["node1"], "sleep 300")))
    _until(backend, handle, {State.RUNNING}, 30)
    slurm.run("scancel", handle.native_id)
    status = _until(backend, handle, {State.CANCELLED}, 10)
    assert status.native.startswith("CANCELLED")
    assert status.task_state()[1].startswith("CANCELLED: Slurm job")


def test_a_start_that_can_never_happen_is_cancelled_not_left_pending(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    backend = _backend(partition="short")  # MaxTime 1 minute; the launch asks for 10
    handle = asyncio.run(backend.submit(_spec(tmp_path, "j-never", ["node1"], "true")))
    status = _until(backend, handle, {State.FAILED}, 20)
    # 22.05 says PartitionConfig, 24.11 PartitionTimeLimit
    assert status.reason in {
        f"Slurm cannot start it ({why}); cancelled"
        for why in ("PartitionConfig", "PartitionTimeLimit")
    }
    assert handle.native_id not in slurm.squeue_ids()


def test_a_partition_taken_down_is_the_sites_loss_not_the_jobs(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """A drained node or a partition set DOWN between planning and sbatch is the site's
    doing: NODE_LOST (planned again, no restart counted), not the job's FAILED."""
    slurm.run("scontrol", "update", "PartitionName=urgent", "State=DOWN")
    try:
        backend = _backend(partition="urgent")
        handle = asyncio.run(backend.submit(_spec(tmp_path, "j-down", ["node1"], "true")))
        status = _until(backend, handle, {State.NODE_LOST}, 20)
        assert status.reason == "Slurm cannot start it (PartitionDown); cancelled"
        assert handle.native_id not in slurm.squeue_ids()
    finally:
        slurm.run("scontrol", "update", "PartitionName=urgent", "State=UP")


def test_preemption_is_preempted(slurm: SlurmCluster, tmp_path: Path) -> None:
    backend = _backend()
    handle = asyncio.run(backend.submit(_spec(tmp_path, "j-victim", ["node3"], "sleep 300")))
    _until(backend, handle, {State.RUNNING}, 30)
    urgent = slurm.run(
        "sbatch", "--parsable", "-p", "urgent", "--nodelist=node3", "--exclusive",
        "--time=1", f"--output={tmp_path}/urgent.out", "--wrap", "sleep 5",
    ).strip()  # fmt: skip
    status = _until(backend, handle, {State.PREEMPTED}, 30)
    assert status.native == "PREEMPTED" and status.ended
    assert status.task_state()[1].startswith("PREEMPTED:")
    slurm.run("scancel", urgent)


def test_a_killed_slurmd_is_a_lost_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    backend = _backend()
    handle = asyncio.run(backend.submit(_spec(tmp_path, "j-lost", ["node4"], "sleep 300")))
    _until(backend, handle, {State.RUNNING}, 30)
    slurm.kill_node("node4")
    try:
        status = _until(backend, handle, {State.NODE_LOST}, 60)
        assert status.native == "NODE_FAIL"
        capacity = {n.name: n for n in asyncio.run(backend.capacity()).nodes}
        assert not capacity["node4"].usable and capacity["node4"].gpus == 0
        assert capacity["node1"].usable
        worst, lost = backend.node_health({"node1", "node2", "node3", "node4"})
        assert worst == "degraded" and len(lost) == 1 and lost[0].startswith("node4 (DOWN")
        assert backend.node_health({"node4"})[0] == "failing"
        assert backend.node_health({"node1"}) == ("ok", [])
    finally:
        slurm.start_node("node4")


def test_bad_input_is_one_clear_line(slurm: SlurmCluster, tmp_path: Path) -> None:
    with pytest.raises(BackendError, match=r"^slurm: partition 'nope' not found$"):
        asyncio.run(_backend(partition="nope").check())
    backend = _backend()
    with pytest.raises(BackendError, match=r"node node9 is not in partition 'cpn'"):
        asyncio.run(backend.submit(_spec(tmp_path, "j-big", ["node1", "node9"], "true")))
    with pytest.raises(BackendError, match=r"wants 3 GPUs on node1, which has 2"):
        asyncio.run(backend.submit(_spec(tmp_path, "j-fat", ["node1"], "true", gpus=3)))
    saved = os.environ["PATH"]
    os.environ["PATH"] = str(tmp_path)  # no Slurm client here
    try:
        with pytest.raises(BackendError, match=r"^slurm: sbatch is not on the PATH"):
            asyncio.run(backend.check())
    finally:
        os.environ["PATH"] = saved
    os.environ["SLURM_CONF"] = str(tmp_path / "missing.conf")
    try:
        with pytest.raises(BackendError, match=r"^slurm: SLURM_CONF=.*missing.conf: no such file$"):
            asyncio.run(backend.check())
    finally:
        os.environ["SLURM_CONF"] = str(slurm.conf)
    # A controller nobody listens on: the configuration names a port that is closed.
    dead = tmp_path / "dead.conf"
    conf = slurm.conf.read_text().replace(
        f"SlurmctldPort={slurm.ctld_port}", f"SlurmctldPort={slurm.ctld_port + 7}"
    )
    dead.write_text(conf)
    os.environ["SLURM_CONF"] = str(dead)
    try:
        started = time.monotonic()
        with pytest.raises(BackendError, match=r"^slurm: the controller does not answer"):
            asyncio.run(backend.check())
        assert time.monotonic() - started < 30
    finally:
        os.environ["SLURM_CONF"] = str(slurm.conf)
    # A --time-limit above the partition's MaxTime (short: 1 minute) would fail every
    # launch (PartitionTimeLimit): refused at start; one that fits passes.
    too_long = SlurmBackend(SlurmOptions("short", time_limit_s=61), "site-s")
    with pytest.raises(
        BackendError,
        match=r"^slurm: partition 'short' allows 00:01:00 \(MaxTime\) per job, but launches "
        r"would ask for 61 s; pass --time-limit 60 or less$",
    ):
        asyncio.run(too_long.check())
    asyncio.run(SlurmBackend(SlurmOptions("short", time_limit_s=60), "site-s").check())
    asyncio.run(SlurmBackend(SlurmOptions("cpn", time_limit_s=10**7), "site-s").check())
    names = slurm.run("squeue", "-h", "-t", "all", "-o", "%j").split()
    assert "cpn-j-big-e0" not in names and "cpn-j-fat-e0" not in names  # nothing submitted
