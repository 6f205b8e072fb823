"""Following a job's logs (server-sent events) ends cleanly when it cannot go on (the API
key is revoked: in-process, SQLite and PostgreSQL), and goes on where it can: `cpn serve`
asked to stop exits at once instead of waiting for the stream of a job that never ends,
and the follower resumes after the last line once the server is back (real processes)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from api import create_app
from cpn.client import ApiError, CpnClient
from cpn.control.settings import ControlSettings
from cpn.listen_ports import free_port
from cpn.orchestration.tenants import create_key, revoke_key
from cpn.registry import Registry
from cpn.registry.models import JobLogLine
from tests.processes import CPN, Proc, serve_argv, wait_until, write_tokens
from tests.service_harness import make_key, tiny_job


def _events(lines: list[str]) -> list[tuple[str, dict[str, object]]]:
    out, event = [], ""
    for raw in lines:
        if raw.startswith("event:"):
            event = raw.partition(":")[2].strip()
        elif raw.startswith("data:"):
            out.append((event, json.loads(raw.partition(":")[2])))
    return out


@pytest.mark.timeout(120)
def test_a_revoked_key_ends_a_followed_stream(registry: Registry) -> None:
    with registry.write() as s:
        key = create_key(s, "t").key
    cfg = ControlSettings(database_url=registry.url, api_key_cache_s=0.3)
    headers = {"Authorization": f"Bearer {key}"}
    with TestClient(create_app(registry, settings=cfg)) as http:
        job_id = http.post("/v1/jobs", json=tiny_job("never-runs"), headers=headers).json()["id"]
        with http.stream("GET", f"/v1/jobs/{job_id}/logs?follow=true", headers=headers) as reply:
            assert reply.status_code == 200
            with registry.write() as s:
                revoke_key(s, key)
            events = _events(list(reply.iter_lines()))  # returns once the stream ends
    assert events == [("error", {"detail": "Authorization: this API key was revoked"})]


def _add_line(db_url: str, job_id: str, line: str) -> None:
    registry = Registry(db_url)
    try:
        with registry.write() as s:
            s.add(JobLogLine(job_id=job_id, rank=0, line=line))
    finally:
        registry.dispose()


@pytest.mark.timeout(240)
def test_serve_stops_at_once_and_a_followed_log_resumes_after_a_restart(tmp_path: Path) -> None:
    """`cpn serve` asked to stop exits at once though a log is followed (it does not wait
    for the stream of a job that never ends); the follower, told "follow again", follows
    again once the server is back, from the line after the last it got: no line lost,
    none twice. A client with less patience than the outage says why it gave up."""
    db_url = f"sqlite:///{tmp_path}/cpn.db"
    subprocess.run(
        [*CPN, "db", "upgrade", "--database-url", db_url],
        check=True,
        capture_output=True,
        timeout=120,
    )
    key = make_key(db_url, "t")
    http_port, grpc_port = free_port(), free_port()
    tokens = write_tokens(tmp_path / "tokens.yaml")
    argv = serve_argv(db_url, tokens, grpc_port, http_port)
    url = f"http://127.0.0.1:{http_port}"

    def ready(proc: Proc) -> None:
        wait_until(
            lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, 60, "ready", proc
        )

    serve = Proc(argv, tmp_path / "serve.log")
    again: Proc | None = None
    try:
        ready(serve)
        with (
            CpnClient(url, key, read_patience=120) as client,
            CpnClient(url, key, read_patience=0.5) as hasty,
        ):
            job_id = client.submit(tiny_job("no-agents")).id  # no site: it waits forever
            got: list[str] = []
            outcome: dict[str, BaseException | None] = {}

            def follow(name: str, who: CpnClient) -> None:
                try:
                    for line in who.follow_logs(job_id):
                        if name == "patient":
                            got.append(line.line)
                    outcome[name] = None
                except ApiError as exc:
                    outcome[name] = exc

            followers = [
                threading.Thread(target=follow, args=(n, c), daemon=True)
                for n, c in (("patient", client), ("hasty", hasty))
            ]
            for f in followers:
                f.start()
            _add_line(db_url, job_id, "before")
            wait_until(lambda: got == ["before"], 30, "the first line followed", serve)
            started = time.monotonic()
            assert serve.stop(signal.SIGTERM, timeout=60) == 0
            took = time.monotonic() - started
            assert took < 10, f"cpn serve took {took:.1f} s to stop"
            followers[1].join(30)
            hasty_end = outcome.get("hasty")
            assert isinstance(hasty_end, ApiError), outcome
            _add_line(db_url, job_id, "while it was down")
            again = Proc(argv, tmp_path / "serve-again.log")
            ready(again)
            wait_until(lambda: len(got) == 2, 60, "the follower to resume", again)
            client.cancel(job_id)  # the job ends: so does the stream, cleanly
            followers[0].join(30)
        assert got == ["before", "while it was down"]
        assert outcome["patient"] is None
        assert "cannot reach" in str(hasty_end) or "shutting down" in str(hasty_end)
    finally:
        serve.stop(signal.SIGKILL)
        if again is not None:
            again.stop(signal.SIGKILL)
