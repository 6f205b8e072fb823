"""`CpnClient` against real HTTP servers: a job id is one path segment whatever it holds,
and a reply that is not the API's — not JSON, a redirect, another shape — is an ApiError
with one line, never a traceback (outside review: `cpn jobs get ''` and `'?x'` gave a
JSONDecodeError, `'../sites'` fetched /v1/sites and failed validating it)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import uvicorn
from sqlalchemy import insert, select

from api import create_app
from cpn.client import ApiError, CpnClient
from cpn.client.client import EVENTS_PAGE, METRICS_PAGE
from cpn.errors import InputError
from cpn.listen_ports import free_port
from cpn.orchestration.tenants import create_key
from cpn.registry import Registry
from cpn.registry.events import EventKind, record_event
from cpn.registry.models import Event, JobStep
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


@contextmanager
def _serving(handler: Callable[..., BaseHTTPRequestHandler]) -> Iterator[str]:
    """A plain HTTP server (not cpn's) answering with `handler`, on a free port."""
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}"
        finally:
            httpd.shutdown()


def test_a_server_that_is_not_cpn_is_named(tmp_path: Path) -> None:
    (tmp_path / "v1" / "jobs").mkdir(parents=True)
    (tmp_path / "v1" / "jobs" / "html").write_text("<html>hello</html>")
    (tmp_path / "v1" / "jobs" / "shape").write_text('{"unexpected": 1}')
    (tmp_path / "v1" / "jobs" / "dir").mkdir()  # http.server redirects to dir/
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    with _serving(handler) as url, CpnClient(url, "key") as client:
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


class _Canned(BaseHTTPRequestHandler):
    """Counts requests in `hits`; answers 503 (with `retry_after`) to the first `busy`,
    then 200 with `body` of type `kind`."""

    busy = 0
    retry_after = "0"
    body = b"[]"
    kind = "application/json"
    hits: ClassVar[list[str]] = []

    def _answer(self) -> None:
        cls = type(self)
        cls.hits.append(self.command)
        busy = len(cls.hits) <= cls.busy
        body = b'{"detail": "the registry\'s database is unavailable; retry"}' if busy else cls.body
        self.send_response(503 if busy else 200)
        if busy:
            self.send_header("Retry-After", cls.retry_after)
        self.send_header("Content-Type", "application/json" if busy else cls.kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *_: object) -> None:
        pass


class _Flaky(_Canned):
    hits: ClassVar[list[str]] = []


@pytest.mark.parametrize("retry_after", ["0", "nan", "soon", "-5"])
def test_a_read_waits_through_a_transient_503_a_write_does_not(retry_after: str) -> None:
    """One 503 while the database fails over ended `cpn jobs watch` and a running demo
    (outside review); reads now retry within their patience, writes never (a repeated
    POST could submit twice), and a server still busy past it is one ApiError."""
    _Flaky.retry_after = retry_after
    with _serving(_Flaky) as url:
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


class _Stream(_Canned):
    kind = "text/event-stream"
    hits: ClassVar[list[str]] = []


def test_a_follow_waits_through_503s_but_not_for_ever_on_streams_cut_at_once() -> None:
    """Outside review of the resuming follow: a first answer of 503 ended it at once (a
    GET waits through it), and a server whose streams open and close at once had it
    reconnect for ever (each open renewed the patience). Retry-After: 0 is taken as 0.5 s:
    the client must not hammer."""
    with _serving(_Stream) as url:
        with CpnClient(url, "key", read_patience=5) as client:
            _Stream.hits, _Stream.busy = [], 2
            _Stream.body = b'event: end\ndata: {"state": "succeeded"}\n\n'
            began = time.monotonic()
            assert list(client.follow_logs("j")) == []
            assert len(_Stream.hits) == 3 and time.monotonic() - began >= 0.9
        with CpnClient(url, "key", read_patience=2) as client:
            _Stream.hits, _Stream.busy, _Stream.body = [], 0, b""
            began = time.monotonic()
            with pytest.raises(ApiError, match="closed by the server before the job ended"):
                list(client.follow_logs("j"))
            assert 2 <= time.monotonic() - began < 10 and 2 <= len(_Stream.hits) <= 4


@pytest.mark.parametrize(
    "event",
    [
        b"event: line\ndata: {not json\n\n",
        b'event: line\ndata: {"id": "x"}\n\n',
        b"event: error\ndata: [1]\n\n",
        b'event: error\ndata: {"detail": 3, "retry": "maybe"}\n\n',
        b"event: error\ndata: \xff\xfe\n\n",
    ],
)
def test_a_stream_event_that_is_not_cpns_is_one_error(event: bytes) -> None:
    """A log stream's data that does not decode or fit (a server that is not cpn, or
    another version) is an ApiError naming it, as for any reply, not a traceback."""
    _Stream.hits, _Stream.busy, _Stream.body = [], 0, event
    with (
        _serving(_Stream) as url,
        CpnClient(url, "key") as client,
        pytest.raises(ApiError, match=r"log stream: unexpected event \(.*is http"),
    ):
        list(client.follow_logs("j"))
