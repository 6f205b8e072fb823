"""`cpn train` through torch's elastic agent: a dead worker ends the run within seconds and
names itself; SIGTERM, and even SIGKILL, of `cpn train` leaves no worker behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpn.listen_ports import free_port
from tests.integration.runtime import tiny_job, write_run
from tests.processes import wait_until

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    """Every live descendant of `pid`."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        here = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == here]
        found += kids
        frontier += kids
    return found


def _plan_rank(pid: int) -> int | None:
    """The plan rank of a worker process (from its launcher-given environment)."""
    try:
        env = dict(
            line.split("=", 1)
            for line in (Path("/proc") / str(pid) / "environ").read_text().split("\0")
            if "=" in line
        )
        cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    if b"worker" not in cmdline or "CPN_PLAN_RANKS" not in env:
        return None
    return int(env["CPN_PLAN_RANKS"].split(",")[int(env["LOCAL_RANK"])])


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def _start_training(tmp: Path) -> tuple[subprocess.Popen[str], dict[int, int]]:
    """`cpn train` on an 8-worker plan that runs for long; returns it once every worker
    has trained a step, with the workers' pids by plan rank."""
    job_path, plan_path, _ = write_run(tmp, "long", tiny_job(2, 2, 2, steps=100_000))
    train = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cpn",
            "train",
            "--plan",
            str(plan_path),
            "--job",
            str(job_path),
            "--workdir",
            str(tmp / "run"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = list((tmp / "run").glob("rank-*.metrics.jsonl"))
        if len(metrics) == 8 and all(p.stat().st_size > 0 for p in metrics):
            break
        assert train.poll() is None, train.communicate()
        time.sleep(0.2)
    else:
        train.kill()
        raise AssertionError("workers did not start training within 120 s")
    workers = {r: pid for pid in _children(train.pid) if (r := _plan_rank(pid)) is not None}
    assert sorted(workers) == list(range(8))
    return train, workers


def test_a_killed_worker_ends_the_run_within_seconds_naming_its_rank(tmp_path: Path) -> None:
    train, workers = _start_training(tmp_path)
    killed = time.monotonic()
    os.kill(workers[5], signal.SIGKILL)
    _, err = train.communicate(timeout=60)
    ended = time.monotonic() - killed
    assert train.returncode == 1
    assert "error: worker 5 exited with status -9" in err
    assert ended < 10, f"the run took {ended:.1f} s to end"
    assert _alive(list(workers.values())) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_no_worker_outlives_cpn_train(tmp_path: Path, sig: signal.Signals) -> None:
    train, workers = _start_training(tmp_path)
    train.send_signal(sig)
    train.communicate(timeout=60)
    # SIGTERM is forwarded to the workers and said as 128 + 15; SIGKILL ends it at once.
    assert train.returncode == (128 + sig if sig == signal.SIGTERM else -sig), train.returncode
    deadline = time.monotonic() + 15
    while _alive(list(workers.values())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(list(workers.values())) == [], "workers outlived cpn train"


def _complete_steps(store: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-")) for p in store.glob("step-*/COMPLETE"))


def test_sigusr2_asks_for_a_checkpoint_and_the_launch_goes_on(tmp_path: Path) -> None:
    """A site's warning (Slurm's `--signal=USR2@N`) reaches the launcher, or a worker
    itself: either way every rank checkpoints at one step they agree on, and training
    goes on to the end (SIGUSR2's default action would have ended the launch)."""
    steps = 600
    job_path, plan_path, _ = write_run(tmp_path, "warned", tiny_job(2, 1, 1, steps=steps))
    store, run = tmp_path / "store", tmp_path / "run"
    launch = subprocess.Popen(
        [
            sys.executable, "-m", "cpn", "launch", "--plan", str(plan_path),
            "--job", str(job_path), "--ranks", "0,1", "--nnodes", "1",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--workdir", str(run),
            "--checkpoint-store", str(store), "--checkpoint-on-usr2",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:

        def trained() -> bool:
            assert launch.poll() is None, launch.communicate()
            metrics = list(run.glob("rank-*.metrics.jsonl"))
            return len(metrics) == 2 and all(p.stat().st_size > 0 for p in metrics)

        wait_until(trained, 120, "both workers to train a step")
        launch.send_signal(signal.SIGUSR2)  # to the launcher: it tells its workers
        wait_until(lambda: _complete_steps(store), 60, "a checkpoint on the launcher's USR2")
        (first,) = _complete_steps(store)
        workers = {r: pid for pid in _children(launch.pid) if (r := _plan_rank(pid)) is not None}
        time.sleep(2.5)  # requests within 2 s are one (a signal reaches several processes)
        os.kill(workers[1], signal.SIGUSR2)  # to one worker alone: the ranks agree
        wait_until(lambda: len(_complete_steps(store)) == 2, 60, "a checkpoint on a worker's")
        _, err = launch.communicate(timeout=180)
    finally:
        launch.kill()
    assert launch.returncode == 0, err
    done = _complete_steps(store)
    assert len(done) == 3 and done[0] == first and done[-1] == steps, done
    assert 0 < first < done[1] < steps


def _environment_seen(rank: int, world: int) -> tuple[int, int, str, str, str]:
    return (
        rank,
        world,
        os.environ["RANK"],
        os.environ["CPN_PLAN_RANKS"],
        os.environ.get("OMP_NUM_THREADS", ""),
    )


def _fails_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise RuntimeError("rank one refuses")
    return rank


def test_function_workers_see_their_own_call_s_world_and_report_what_they_raise(
    tmp_path: Path,
) -> None:
    # The fork server starts with the first call and is reused: a later call with another
    # world must not see the first call's variables.
    from cpn.train.launcher import WorkerFailed, run_function  # noqa: PLC0415

    for world in (3, 2):
        seen = run_function(_environment_seen, world, run_dir=tmp_path / f"w{world}")
        ranks = ",".join(str(r) for r in range(world))
        threads = os.environ.get("OMP_NUM_THREADS", "1")  # the launcher's default
        assert seen == [(r, world, str(r), ranks, threads) for r in range(world)]
    with pytest.raises(WorkerFailed, match="RuntimeError: rank one refuses") as failed:
        run_function(_fails_on_rank_one, 2, run_dir=tmp_path / "fails")
    assert [f.rank for f in failed.value.failures] == [1]
