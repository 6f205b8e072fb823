"""The job service end to end with real processes: `cpn serve` and three agents with
virtual GPUs (sites of different sizes); `cpn submit` a tiny GPT job; the orchestration
plans it on the live registry across sites, the agents launch the real workers, they
train, and the job SUCCEEDS with measured bytes equal to the plan's prediction. Then the
queue (priority, a job waiting for GPUs with its reason) and a cancel mid-run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from api.job_schemas import JobPublic
from cpn.client import CpnClient
from tests.processes import CPN, wait_until
from tests.service_harness import Cluster, cluster, make_key, tiny_job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def three_sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("svc"), {"a": 2, "b": 1, "c": 1}) as c:
        yield c


def _wait_state(client: CpnClient, job_id: str, states: set[str], timeout: float) -> JobPublic:
    def reached() -> JobPublic | None:
        job = client.job(job_id)
        return job if job.state.value in states else None

    return wait_until(reached, timeout, f"job {job_id} to reach {states}")


def test_submit_trains_across_sites_and_succeeds(three_sites: Cluster, tmp_path: Path) -> None:
    key = make_key(three_sites.db_url, "alice")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(tiny_job("tiny-e2e")))
    env = {**os.environ, "CPN_SERVER": three_sites.url, "CPN_API_KEY": key}
    out = subprocess.run(
        [*CPN, "submit", str(job_file), "--json"], env=env, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    job_id = json.loads(out.stdout)["id"]
    client = three_sites.client(key)
    # Follow the logs while it runs (server-sent events that end with the job).
    followed: list[str] = []
    follower = threading.Thread(
        target=lambda: followed.extend(x.line for x in client.follow_logs(job_id)), daemon=True
    )
    follower.start()
    job = _wait_state(client, job_id, {"succeeded", "failed"}, 240)
    assert job.state.value == "succeeded", (job.reason, job.failure)
    assert job.plan is not None
    assert len(job.plan.sites_used()) >= 2
    p = job.progress
    assert p.step == p.steps == 6
    assert p.loss is not None and p.loss > 0
    for link in ("intra_node", "intra_site", "wan"):
        assert p.bytes[link].measured == p.bytes[link].predicted, link
    assert p.bytes["wan"].measured > 0
    # The per-step series: every step, every rank, bytes equal to the plan per step.
    series = client.metrics(job_id)
    assert [s.step for s in series.steps] == list(range(6))
    assert series.predicted_bytes_per_step is not None
    for s in series.steps:
        assert s.ranks == 4
        assert s.bytes == series.predicted_bytes_per_step == s.predicted_bytes
    # Every transition is an event with its reason.
    moves = [e.data["to"] for e in client.events(job_id) if e.kind == "job_state"]
    assert moves == ["scheduled", "running", "succeeded"]
    # The logs are readable, per rank, and the followed stream ended with the job.
    logs = client.logs(job_id)
    assert logs.ended
    assert {line.rank for line in logs.lines} <= set(range(4))
    follower.join(30)
    assert not follower.is_alive()
    assert followed == [line.line for line in logs.lines]
    # GPUs freed: the topology's reservations are empty again.
    wait_until(lambda: not client.reservations().gpus, 30, "GPUs to be freed")


def _workers(job_id: str) -> list[int]:
    """Pids of live `cpn worker` processes of a job (its id is in their --job path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z" and b"worker" in cmd and any(job_id.encode() in c for c in cmd):
            pids.append(int(entry.name))
    return pids


def test_queue_priority_and_cancel(three_sites: Cluster) -> None:
    key = make_key(three_sites.db_url, "bob")
    client = three_sites.client(key)
    # A long job takes all 4 GPUs; two more wait; the higher priority one goes first.
    long_job = client.submit(tiny_job("long", steps=100_000))
    running = _wait_state(client, long_job.id, {"running"}, 120)
    assert running.state.value == "running"
    low = client.submit(tiny_job("low", dp=1, pp=2, steps=3))
    high = client.submit(tiny_job("high", dp=1, pp=2, steps=3, priority=5))
    time.sleep(1.5)
    low_now, high_now = client.job(low.id), client.job(high.id)
    assert low_now.state.value == high_now.state.value == "pending"
    assert "needs 2 GPUs" in high_now.reason and "free" in high_now.reason, high_now.reason
    assert f"queued behind job {high.id}" in low_now.reason, low_now.reason
    # Cancel mid-run: every worker gone within 10 s, GPUs freed, CANCELLED.
    assert len(_workers(long_job.id)) == 4
    cancelled = client.cancel(long_job.id)
    assert cancelled.state.value == "cancelled"
    started = time.monotonic()
    wait_until(lambda: not _workers(long_job.id), 10, "the long job's workers to end")
    assert time.monotonic() - started < 10
    # The queue moves: high first (priority), then low; both finish.
    done_high = _wait_state(client, high.id, {"succeeded", "failed"}, 180)
    done_low = _wait_state(client, low.id, {"succeeded", "failed"}, 180)
    for done in (done_high, done_low):
        assert done.state.value == "succeeded", (done.name, done.reason, done.failure)
    assert done_high.scheduled_at is not None and done_low.scheduled_at is not None
    assert done_high.scheduled_at <= done_low.scheduled_at
    moves = [e.data["to"] for e in client.events(long_job.id) if e.kind == "job_state"]
    assert moves[-1] == "cancelled"


def test_wan_auto_names_its_sync_in_the_jobs_metrics(three_sites: Cluster) -> None:
    """A `wan: auto` job: every step of GET /v1/jobs/{id}/metrics says which WAN sync ran
    it; the first two run the plan's schedule (the ranks agree on a measured bandwidth one
    step after the first exchange, so no move can come earlier)."""
    key = make_key(three_sites.db_url, "carol")
    client = three_sites.client(key)
    job = client.submit(tiny_job("auto-e2e", dp=2, pp=1, steps=6, compression={"wan": "auto"}))
    done = _wait_state(client, job.id, {"succeeded", "failed"}, 240)
    assert done.state.value == "succeeded", (done.reason, done.failure)
    assert done.plan is not None and done.plan.wan_auto is not None
    schedule = done.plan.wan_auto
    series = client.metrics(job.id)
    assert [s.step for s in series.steps] == list(range(6))
    ran = [s.wan_sync for s in series.steps]
    assert ran[:2] == [schedule.phase_at(s).compression.summary for s in range(2)]
    assert all(isinstance(name, str) and name for name in ran), ran
    # Each step that ran the planned phase's sync carried the plan's bytes for that step.
    planned = [
        s for s in series.steps if s.wan_sync == schedule.phase_at(s.step).compression.summary
    ]
    assert planned and all(s.bytes == s.predicted_bytes for s in planned), planned


def test_a_rendezvous_port_taken_on_its_host_fails_the_job_saying_so(
    three_sites: Cluster,
) -> None:
    """Something else on the host holds the port the job was given: the launcher cannot
    serve its rendezvous store, starts no worker, and the job fails with that cause (not
    "the launcher exited with 1", and no "ok" in its result)."""
    client = three_sites.client(make_key(three_sites.db_url, "dave"))
    port = int(three_sites.serve_env["CPN_RENDEZVOUS_PORT_MIN"])  # the first one given
    with socket.socket() as taken:
        # An earlier job's store leaves connections in TIME_WAIT on this port: bind past
        # them, as the store itself does. Listening, it still keeps the store off the port.
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("0.0.0.0", port))
        taken.listen()
        job = client.submit(tiny_job("port-taken", dp=1, pp=1))
        done = _wait_state(client, job.id, {"succeeded", "failed"}, 180)
    assert done.state.value == "failed", done
    assert done.failure is not None and done.failure.exit_code == 1
    message = done.failure.message
    assert message.startswith("rendezvous failed (serving "), message
    assert f":{port}), no worker started: " in message, message
    assert "address already in use" in message, message
    assert done.reason == f"rank 0 ({done.failure.site}) exited with 1: {done.failure.message}"
    assert not done.failure.last_lines  # no worker started, so none wrote a line
    run_dir = next(three_sites.tmp.glob(f"work-*/{job.id}"))
    assert json.loads((run_dir / "result.json").read_text()) == {
        "ok": False,
        "error": message,
    }
    assert "Traceback" not in (run_dir / "launcher.log").read_text()
