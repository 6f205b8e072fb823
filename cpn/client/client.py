"""`CpnClient`: one method per endpoint, typed by the API's schemas."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from api.job_schemas import (
    EventPublic,
    JobPublic,
    JobsPublic,
    LogLinePublic,
    LogsPublic,
    MetricsPublic,
)
from api.quote_schemas import QuotePublic
from cpn.contracts import JobSpec, Reservations, Topology
from cpn.errors import CpnError, InputError

T = TypeVar("T")
#: Events per request of `CpnClient.events` (the server allows up to 10 000).
EVENTS_PAGE = 1000
#: Steps asked for per request (the server's default page).
METRICS_PAGE = 10_000
#: Statuses that mean "not now" rather than "no": a proxy between restarts (502, 504) or
#: the registry's database away for a moment (503, with Retry-After).
TRANSIENT = frozenset({502, 503, 504})
#: Seconds a read waits through transient answers before it gives up (`CpnClient`).
READ_PATIENCE = 15.0
#: Seconds without a byte after which a followed stream is taken for dead.
FOLLOW_SILENCE_S = 60.0


class ApiError(CpnError):
    """The server refused a request; `status` is the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _job_path(job_id: str) -> str:
    """/v1/jobs/<id>, the id one path segment whatever it holds: "..", "?x" or "a/b" name
    no job (the server answers 404), rather than another URL."""
    if not job_id:
        raise InputError("job id: must not be empty")
    if job_id in (".", ".."):  # dot segments are resolved by URL parsers, even encoded
        return "/v1/jobs/" + job_id.replace(".", "%2E")
    return "/v1/jobs/" + quote(job_id, safe="")


def _message(reply: httpx.Response) -> str:
    try:
        body = reply.json()
    except ValueError:
        return f"HTTP {reply.status_code}: {reply.text[:200]}"
    if isinstance(body, dict):
        if isinstance(body.get("message"), str):
            return str(body["message"])
        if isinstance(body.get("detail"), str):
            return str(body["detail"])
    return f"HTTP {reply.status_code}: {json.dumps(body)[:200]}"


class _StreamError(BaseModel):
    """The data of a log stream's `error` event (api/routes/jobs.py)."""

    detail: str
    retry: bool = False


class _StreamCut(ApiError):
    """A followed stream ended before the job did, for a reason that may pass."""

    def __init__(self, status: int, message: str, reached: bool, wait: float = 1.0) -> None:
        super().__init__(status, message)
        self.reached = reached  # the server answered (a refused connection did not)
        self.wait = wait  # seconds before following again


def _retry_after(reply: httpx.Response, default: float) -> float:
    """The server's Retry-After in seconds (the delta form; kept within 0.5–10 s, as a
    hostile or mistaken header must neither stall the client nor make it hammer), else
    `default`."""
    try:
        seconds = float(reply.headers.get("Retry-After", ""))
    except ValueError:
        return default
    # A floor too: "0" (or less) from a proxy would have the client hammer it.
    return min(max(seconds, 0.5), 10.0) if math.isfinite(seconds) else default


class CpnClient:
    """`read_patience`: seconds a GET goes on retrying a transient answer (`TRANSIENT`),
    so that one 503 while the database fails over does not end `cpn jobs watch` or a
    demo. Writes are never retried (a submission's Idempotency-Key is the caller's), nor
    is an unreachable server (the next call says so at once)."""

    def __init__(
        self,
        server: str,
        api_key: str | None = None,
        *,
        timeout: float = 30.0,
        read_patience: float = READ_PATIENCE,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.server = server.rstrip("/")
        self.read_patience = read_patience
        self._http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout)

    def __enter__(self) -> CpnClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; a GET answered with a transient status is sent again, after the
        server's Retry-After (else 0.5 s, doubling), until `read_patience` is spent.
        By hand: httpx's own retries cover failed connections only, not answers."""
        deadline = time.monotonic() + self.read_patience
        pause = 0.5
        while True:
            try:
                reply = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                raise ApiError(0, f"cannot reach {self.server}: {exc}") from None
            if method != "GET" or reply.status_code not in TRANSIENT:
                return reply
            wait = _retry_after(reply, pause)
            if time.monotonic() + wait > deadline:
                return reply
            time.sleep(wait)
            pause = min(pause * 2, 4.0)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        reply = self._request(method, path, **kwargs)
        if not reply.is_success:  # redirects included: the API answers none
            raise ApiError(reply.status_code, _message(reply))
        try:
            return reply.json()
        except ValueError:
            raise ApiError(
                reply.status_code, f"{method} {path}: the reply is not JSON; is {self.server} cpn?"
            ) from None

    def _get(self, shape: type[T], method: str, path: str, **kwargs: Any) -> T:
        """`_call`, the reply read as `shape`: one that does not fit is an ApiError (a
        server that is not cpn, or another version of it), not a traceback."""
        data = self._call(method, path, **kwargs)
        try:
            return TypeAdapter(shape).validate_python(data)
        except ValidationError as exc:
            why = exc.errors()[0]["msg"]
            raise ApiError(
                0, f"{method} {path}: unexpected reply ({why}); is {self.server} cpn?"
            ) from None

    # ------------------------------------------------------------------ jobs

    def submit(
        self,
        spec: JobSpec | dict[str, Any],
        *,
        idempotency_key: str | None = None,
        quote_id: str | None = None,
        candidate: int = 0,
    ) -> JobPublic:
        body = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else dict(spec)
        if quote_id is not None:
            body.update(quote_id=quote_id, candidate=candidate)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._get(JobPublic, "POST", "/v1/jobs", json=body, headers=headers)

    def jobs(self, *, state: str | None = None, skip: int = 0, limit: int = 50) -> JobsPublic:
        params: dict[str, Any] = {"skip": skip, "limit": limit}
        if state:
            params["state"] = state
        return self._get(JobsPublic, "GET", "/v1/jobs", params=params)

    def job(self, job_id: str) -> JobPublic:
        return self._get(JobPublic, "GET", _job_path(job_id))

    def cancel(self, job_id: str) -> JobPublic:
        return self._get(JobPublic, "POST", f"{_job_path(job_id)}/cancel")

    def events(self, job_id: str, *, after: int = 0) -> list[EventPublic]:
        """Every event after `after`, page by page (the server sends at most a page)."""
        path = f"{_job_path(job_id)}/events"
        out: list[EventPublic] = []
        while True:
            params = {"after": after, "limit": EVENTS_PAGE}
            page = self._get(list[EventPublic], "GET", path, params=params)
            out += page
            if len(page) < EVENTS_PAGE:
                return out
            after = page[-1].id

    def metrics(self, job_id: str) -> MetricsPublic:
        """Every step of the job's series, page by page (the server sends at most a page)."""
        path = f"{_job_path(job_id)}/metrics"
        after, first = -1, None
        steps = []
        while True:
            page = self._get(
                MetricsPublic, "GET", path, params={"after": after, "limit": METRICS_PAGE}
            )
            first = first or page
            steps += page.steps
            if len(page.steps) < METRICS_PAGE:
                return first.model_copy(update={"steps": steps})
            after = page.steps[-1].step

    def logs(self, job_id: str, *, rank: int | None = None, after: int = 0) -> LogsPublic:
        params: dict[str, Any] = {"after": after}
        if rank is not None:
            params["rank"] = rank
        return self._get(LogsPublic, "GET", f"{_job_path(job_id)}/logs", params=params)

    def follow_logs(self, job_id: str, *, rank: int | None = None) -> Iterator[LogLinePublic]:
        """Lines as they come (server-sent events), until the job has ended.

        Once the server has answered, a stream cut or refused for a reason that may
        pass — the server restarting or shutting down (it says "follow again"), a 502–504
        (Retry-After honoured), a dropped or silent connection — is opened again after
        the last line received, for up to `read_patience` seconds, renewed only by a
        stream that brought lines or stayed open that long; an answer that is not "not
        now" (a revoked key, no such job) ends it, as does a server never reached.
        """
        last, reached, deadline = 0, False, None
        while True:
            opened_at, fed = None, False
            try:
                for line in self._follow_once(job_id, rank, last):
                    reached = True
                    if line is None:  # the stream is open
                        opened_at = time.monotonic()
                    else:
                        fed, last = True, line.id
                        yield line
                return
            except _StreamCut as cut:
                reached = reached or cut.reached
                now = time.monotonic()
                # Patience is renewed only by a stream that was worth it (it brought
                # lines, or stayed open a while): one that opens and is cut at once,
                # again and again, must not be followed for ever.
                lasted = opened_at is not None and now - opened_at >= self.read_patience
                if fed or lasted:
                    deadline = None
                deadline = deadline if deadline is not None else now + self.read_patience
                if not reached or now >= deadline:
                    raise ApiError(cut.status, str(cut)) from None
                time.sleep(min(cut.wait, max(deadline - now, 0.0)))

    def _follow_once(
        self, job_id: str, rank: int | None, after: int
    ) -> Iterator[LogLinePublic | None]:
        """One stream: None once it is open, then its lines."""
        params: dict[str, Any] = {"follow": "true", "after": after}
        if rank is not None:
            params["rank"] = rank
        # The server pings every 15 s (sse-starlette): a minute of silence is a dead link.
        timeout = httpx.Timeout(self._http.timeout.connect, read=FOLLOW_SILENCE_S)
        reached = False  # the server answered this request
        try:
            with self._http.stream(
                "GET", f"{_job_path(job_id)}/logs", params=params, timeout=timeout
            ) as reply:
                if reply.status_code in TRANSIENT:  # an answer: "not now"
                    reply.read()
                    raise _StreamCut(
                        reply.status_code, _message(reply), True, _retry_after(reply, 1.0)
                    )
                if not reply.is_success:  # as `_call`: redirects included
                    reply.read()
                    raise ApiError(reply.status_code, _message(reply))
                reached = True
                yield None
                event = ""
                for raw in reply.iter_lines():
                    if raw.startswith("event:"):
                        event = raw.partition(":")[2].strip()
                    elif raw.startswith("data:") and event == "line":
                        yield self._event(LogLinePublic, raw)
                    elif raw.startswith("data:") and event == "end":
                        return
                    elif raw.startswith("data:") and event == "error":
                        said = self._event(_StreamError, raw)
                        message = f"log stream: {said.detail}"
                        if said.retry:
                            raise _StreamCut(reply.status_code, message, True)
                        raise ApiError(reply.status_code, message)
            raise _StreamCut(0, "log stream: closed by the server before the job ended", True)
        except httpx.TransportError as exc:
            raise _StreamCut(0, f"cannot reach {self.server}: {exc}", reached) from None

    def _event(self, shape: type[T], raw: str) -> T:
        """An event's data read as `shape`; data that does not fit is an ApiError, as
        for any reply (`_get`), not a traceback."""
        try:
            return TypeAdapter(shape).validate_json(raw.partition(":")[2].strip())
        except ValidationError as exc:
            why = exc.errors()[0]["msg"]
            raise ApiError(
                0, f"log stream: unexpected event ({why}); is {self.server} cpn?"
            ) from None

    # ------------------------------------------------------------------ the rest

    def quote(self, spec: JobSpec | dict[str, Any]) -> QuotePublic:
        body = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else dict(spec)
        return self._get(QuotePublic, "POST", "/v1/quotes", json=body)

    def sites(self) -> list[dict[str, Any]]:
        sites: list[dict[str, Any]] = self._call("GET", "/v1/sites")
        return sites

    def topology(self) -> Topology:
        return self._get(Topology, "GET", "/v1/topology")

    def reservations(self) -> Reservations:
        return self._get(Reservations, "GET", "/v1/topology/reservations")
