"""`CpnClient` against real HTTP servers: a job id is one path segment whatever it holds,
and a reply that is not the API's — not JSON, a redirect, another shape — is an ApiError
with one line, never a traceback (outside review: `cpn jobs get ''` and `'?x'` gave a
JSONDecodeError, `'../sites'` fetched /v1/sites and failed validating it)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import uvicorn
from sqlalchemy import insert, select

from api import create_app
from cpn.client import ApiError, CpnClient
from cpn.client.client import EVENTS_PAGE, METRICS_PAGE
from cpn.errors import InputError
from cpn.orchestration.tenants import create_key
from cpn.registry import Registry
from cpn.registry.events import EventKind, record_event
from cpn.registry.models import Event, JobStep
from tests.processes import free_port
from tests.service_harness import tiny_job


@pytest.fixture
def api_url(registry: Registry) -> Iterator[tuple[str, str]]:
    with registry.write() as s:
        key = create_key(s, "t").key
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(registry), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", key
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # nothing database-specific
def test_a_job_id_is_one_path_segment(api_url: tuple[str, str]) -> None:
    url, key = api_url
    with CpnClient(url, key) as client:
        for job_id in (".", "..", "../sites", "?x", "#x", "a/b", "%2e%2e"):
            for call in (client.job, client.cancel, client.logs):
                with pytest.raises(ApiError) as err:
                    call(job_id)
                assert err.value.status == 404, (job_id, call.__name__, str(err.value))
        with pytest.raises(InputError, match="job id: must not be empty"):
            client.job("")
        assert client.jobs().count == 0  # the same client still works


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_every_event_of_a_job_however_many(api_url: tuple[str, str], registry: Registry) -> None:
    """`cpn jobs events` promises every transition: the client pages through the server's
    limit (outside review: one request, the first 1000 only)."""
    url, key = api_url
    with CpnClient(url, key) as client:
        job_id = client.submit(tiny_job("chatty")).id
        with registry.write() as s:
            for i in range(EVENTS_PAGE + 5):
                record_event(s, EventKind.TASK_STATE, f"event {i}", job_id=job_id)
        with registry.read() as s:
            stored = s.scalars(select(Event.id).where(Event.job_id == job_id).order_by(Event.id))
            want = list(stored)
        assert len(want) > EVENTS_PAGE + 5  # the submission's own events besides
        assert [e.id for e in client.events(job_id)] == want
        assert [e.id for e in client.events(job_id, after=want[3])] == want[4:]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_every_step_of_a_job_however_many(api_url: tuple[str, str], registry: Registry) -> None:
    """The demo's report and `cpn jobs` read the whole series: the client pages through
    the server's page (outside review: one request, the first 10 000 steps only)."""
    url, key = api_url
    total = METRICS_PAGE + 3
    with CpnClient(url, key) as client:
        job_id = client.submit(tiny_job("long")).id
        with registry.write() as s:
            rows = [{"job_id": job_id, "step": i, "ranks": 1} for i in range(total)]
            s.execute(insert(JobStep), rows)
        series = client.metrics(job_id)
        assert [st.step for st in series.steps] == list(range(total))
        assert series.job_id == job_id


def test_a_server_that_is_not_cpn_is_named(tmp_path: Path) -> None:
    (tmp_path / "v1" / "jobs").mkdir(parents=True)
    (tmp_path / "v1" / "jobs" / "html").write_text("<html>hello</html>")
    (tmp_path / "v1" / "jobs" / "shape").write_text('{"unexpected": 1}')
    (tmp_path / "v1" / "jobs" / "dir").mkdir()  # http.server redirects to dir/
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        try:
            with CpnClient(url, "key") as client:
                with pytest.raises(ApiError, match=r"GET /v1/jobs/html: the reply is not JSON"):
                    client.job("html")
                with pytest.raises(ApiError, match=r"GET /v1/jobs/shape: unexpected reply \("):
                    client.job("shape")
                with pytest.raises(ApiError) as err:
                    client.job("dir")
                assert err.value.status == 301
                with pytest.raises(ApiError) as err:
                    client.job("missing")
                assert err.value.status == 404 and str(err.value).startswith("HTTP 404: ")
        finally:
            httpd.shutdown()


class _Flaky(SimpleHTTPRequestHandler):
    """Answers 503 (Retry-After as the class says) `busy` times, then `[]`; counts hits."""

    busy = 2
    retry_after = "0"
    hits: ClassVar[list[str]] = []

    def _answer(self) -> None:
        _Flaky.hits.append(self.command)
        if len(_Flaky.hits) <= _Flaky.busy:
            body, status = b'{"detail": "the registry\'s database is unavailable; retry"}', 503
        else:
            body, status = b"[]", 200
        self.send_response(status)
        if status == 503:
            self.send_header("Retry-After", _Flaky.retry_after)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *_: object) -> None:
        pass


@pytest.mark.parametrize("retry_after", ["0", "nan", "soon", "-5"])
def test_a_read_waits_through_a_transient_503_a_write_does_not(retry_after: str) -> None:
    """One 503 while the database fails over ended `cpn jobs watch` and a running demo
    (outside review); reads now retry within their patience, writes never (a repeated
    POST could submit twice), and a server still busy past it is one ApiError."""
    _Flaky.retry_after = retry_after
    with ThreadingHTTPServer(("127.0.0.1", 0), _Flaky) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        try:
            with CpnClient(url, "key") as client:
                _Flaky.hits, _Flaky.busy = [], 2
                began = time.monotonic()
                assert client.sites() == []
                assert _Flaky.hits == ["GET"] * 3
                assert time.monotonic() - began >= 0.9  # at least 0.5 s between tries
                _Flaky.hits, _Flaky.busy = [], 1
                with pytest.raises(ApiError) as err:
                    client.submit(tiny_job("once"))
                assert err.value.status == 503 and _Flaky.hits == ["POST"]
            with CpnClient(url, "key", read_patience=0.2) as client:
                _Flaky.hits, _Flaky.busy = [], 10**6
                began = time.monotonic()
                with pytest.raises(ApiError, match="database is unavailable") as err:
                    client.sites()
                assert err.value.status == 503 and time.monotonic() - began < 5
        finally:
            httpd.shutdown()


class _Stream(SimpleHTTPRequestHandler):
    """/v1/jobs/j/logs: 503 for the first `busy` requests, then an event stream that is
    empty (closed at once) or, when `end`, one `end` event. Counts requests."""

    busy = 0
    end = False
    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        _Stream.hits.append(self.path)
        if len(_Stream.hits) <= _Stream.busy:
            body, status, kind = b'{"detail": "busy"}', 503, "application/json"
        else:
            body = b'event: end\ndata: {"state": "succeeded"}\n\n' if _Stream.end else b""
            status, kind = 200, "text/event-stream"
        self.send_response(status)
        if status == 503:
            self.send_header("Retry-After", "0")
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def test_a_follow_waits_through_503s_but_not_for_ever_on_streams_cut_at_once() -> None:
    """Outside review of the resuming follow: a first answer of 503 ended it at once (a
    GET waits through it), and a server whose streams open and close at once had it
    reconnect for ever (each open renewed the patience). Retry-After: 0 is taken as 0.5 s:
    the client must not hammer."""
    with ThreadingHTTPServer(("127.0.0.1", 0), _Stream) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        try:
            with CpnClient(url, "key", read_patience=5) as client:
                _Stream.hits, _Stream.busy, _Stream.end = [], 2, True
                began = time.monotonic()
                assert list(client.follow_logs("j")) == []
                assert len(_Stream.hits) == 3 and time.monotonic() - began >= 0.9
            with CpnClient(url, "key", read_patience=2) as client:
                _Stream.hits, _Stream.busy, _Stream.end = [], 0, False
                began = time.monotonic()
                with pytest.raises(ApiError, match="closed by the server before the job ended"):
                    list(client.follow_logs("j"))
                assert 2 <= time.monotonic() - began < 10 and 2 <= len(_Stream.hits) <= 4
        finally:
            httpd.shutdown()
