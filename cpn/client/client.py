"""`CpnClient`: one method per endpoint, typed by the API's schemas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

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
from cpn.errors import CpnError


class ApiError(CpnError):
    """The server refused a request; `status` is the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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


class CpnClient:
    def __init__(self, server: str, api_key: str | None = None, *, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.server = server.rstrip("/")
        self._http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout)

    def __enter__(self) -> CpnClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            reply = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ApiError(0, f"cannot reach {self.server}: {exc}") from None
        if reply.status_code >= 400:
            raise ApiError(reply.status_code, _message(reply))
        return reply.json()

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
        return JobPublic.model_validate(self._call("POST", "/v1/jobs", json=body, headers=headers))

    def jobs(self, *, state: str | None = None, skip: int = 0, limit: int = 50) -> JobsPublic:
        params: dict[str, Any] = {"skip": skip, "limit": limit}
        if state:
            params["state"] = state
        return JobsPublic.model_validate(self._call("GET", "/v1/jobs", params=params))

    def job(self, job_id: str) -> JobPublic:
        return JobPublic.model_validate(self._call("GET", f"/v1/jobs/{job_id}"))

    def cancel(self, job_id: str) -> JobPublic:
        return JobPublic.model_validate(self._call("POST", f"/v1/jobs/{job_id}/cancel"))

    def events(self, job_id: str, *, after: int = 0) -> list[EventPublic]:
        rows = self._call("GET", f"/v1/jobs/{job_id}/events", params={"after": after})
        return [EventPublic.model_validate(r) for r in rows]

    def metrics(self, job_id: str) -> MetricsPublic:
        return MetricsPublic.model_validate(self._call("GET", f"/v1/jobs/{job_id}/metrics"))

    def logs(self, job_id: str, *, rank: int | None = None, after: int = 0) -> LogsPublic:
        params: dict[str, Any] = {"after": after}
        if rank is not None:
            params["rank"] = rank
        return LogsPublic.model_validate(
            self._call("GET", f"/v1/jobs/{job_id}/logs", params=params)
        )

    def follow_logs(self, job_id: str, *, rank: int | None = None) -> Iterator[LogLinePublic]:
        """Lines as they come (server-sent events), until the job has ended."""
        params: dict[str, Any] = {"follow": "true"}
        if rank is not None:
            params["rank"] = rank
        try:
            with self._http.stream(
                "GET", f"/v1/jobs/{job_id}/logs", params=params, timeout=None
            ) as reply:
                if reply.status_code >= 400:
                    reply.read()
                    raise ApiError(reply.status_code, _message(reply))
                event = ""
                for raw in reply.iter_lines():
                    if raw.startswith("event:"):
                        event = raw.partition(":")[2].strip()
                    elif raw.startswith("data:") and event == "line":
                        yield LogLinePublic.model_validate_json(raw.partition(":")[2].strip())
                    elif raw.startswith("data:") and event == "end":
                        return
                    elif raw.startswith("data:") and event == "error":
                        detail = json.loads(raw.partition(":")[2].strip())["detail"]
                        raise ApiError(reply.status_code, f"log stream: {detail}")
            raise ApiError(0, "log stream: closed by the server before the job ended")
        except httpx.TransportError as exc:
            raise ApiError(0, f"cannot reach {self.server}: {exc}") from None

    # ------------------------------------------------------------------ the rest

    def quote(self, spec: JobSpec | dict[str, Any]) -> QuotePublic:
        body = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else dict(spec)
        return QuotePublic.model_validate(self._call("POST", "/v1/quotes", json=body))

    def sites(self) -> list[dict[str, Any]]:
        sites: list[dict[str, Any]] = self._call("GET", "/v1/sites")
        return sites

    def topology(self) -> Topology:
        return Topology.model_validate(self._call("GET", "/v1/topology"))

    def reservations(self) -> Reservations:
        return Reservations.model_validate(self._call("GET", "/v1/topology/reservations"))
