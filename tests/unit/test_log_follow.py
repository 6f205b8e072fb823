"""Following a job's logs (server-sent events) ends cleanly when it cannot go on: the API
key is revoked (in-process, SQLite and PostgreSQL), or `cpn serve` is asked to stop (a real
process: it exits at once instead of waiting for the stream of a job that never ends)."""

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
from cpn.orchestration.tenants import create_key, revoke_key
from cpn.registry import Registry
from tests.processes import CPN, Proc, free_port, serve_argv, wait_until, write_tokens
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


@pytest.mark.timeout(180)
def test_serve_stops_at_once_while_a_log_is_followed(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path}/cpn.db"
    subprocess.run(
        [*CPN, "db", "upgrade", "--database-url", db_url],
        check=True,
        capture_output=True,
        timeout=120,
    )
    key = make_key(db_url, "t")
    http_port = free_port()
    tokens = write_tokens(tmp_path / "tokens.yaml")
    serve = Proc(serve_argv(db_url, tokens, free_port(), http_port), tmp_path / "serve.log")
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_until(
            lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, 60, "ready", serve
        )
        with CpnClient(url, key) as client:
            job_id = client.submit(tiny_job("no-agents")).id  # no site: it waits forever
            outcome: list[BaseException | None] = []

            def follow() -> None:
                try:
                    list(client.follow_logs(job_id))
                    outcome.append(None)
                except ApiError as exc:
                    outcome.append(exc)

            follower = threading.Thread(target=follow, daemon=True)
            follower.start()
            time.sleep(1.0)  # the stream is open and polling
            started = time.monotonic()
            assert serve.stop(signal.SIGTERM, timeout=60) == 0
            took = time.monotonic() - started
            follower.join(10)
        assert took < 10, f"cpn serve took {took:.1f} s to stop"
        assert len(outcome) == 1 and isinstance(outcome[0], ApiError)
        assert "shutting down" in str(outcome[0])
    finally:
        serve.stop(signal.SIGKILL)
