"""A small in-process fake of the Kubernetes API, served over HTTP to the official client.

No API server can run on the machines cpn is tested on (none in the package registries,
no container engine), so the Kubernetes backend's tests are contract tests against this:
it implements only what the backend uses — create, get, list (label and field
selectors), watch (from a resourceVersion; events after it, or wait for one), delete — for
Jobs, Services, Pods and Nodes, with 409 Conflict on a second create, 404 for a missing
object or namespace, and a resourceVersion that grows with every write. The test plays
the cluster's controllers: it sets a Job's status and its pods (`set_job`, `add_pod`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

ROUTES = {
    ("apis/batch/v1", "jobs"): "jobs",
    ("api/v1", "services"): "services",
    ("api/v1", "pods"): "pods",
}


@dataclass
class FakeApi:
    namespaces: set[str]
    objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = field(
        default_factory=lambda: {"jobs": {}, "services": {}, "pods": {}, "nodes": {}}
    )
    events: list[tuple[int, str, str, dict[str, Any]]] = field(default_factory=list)
    version: int = 100
    changed: threading.Condition = field(default_factory=threading.Condition)
    requests: list[tuple[str, str]] = field(default_factory=list)

    # ------------------------------------------------------------------ the test's side
    def add_node(
        self, name: str, gpus: int | str, ready: bool = True, cordoned: bool = False
    ) -> None:
        """`gpus` a string: the allocatable quantity as the API would hold it, verbatim."""
        address = f"10.0.0.{len(self.objects['nodes']) + 1}"
        self._put("nodes", "", {
            "metadata": {"name": name},
            "spec": {"unschedulable": cordoned},
            "status": {
                "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "8"},
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                "addresses": [{"type": "InternalIP", "address": address}],
            },
        })  # fmt: skip

    def add_bare_node(self, name: str) -> None:
        """A node the API lists before its kubelet has reported any status."""
        self._put("nodes", "", {"metadata": {"name": name}, "spec": {}})

    def set_job(self, ns: str, name: str, status: dict[str, Any]) -> None:
        job = self.objects["jobs"][(ns, name)]
        self._put_event("jobs", ns, {**job, "status": status}, "MODIFIED")

    def add_pod(self, ns: str, job: str, index: int, status: dict[str, Any]) -> None:
        self._put("pods", ns, {
            "metadata": {"name": f"{job}-{index}-abcde", "namespace": ns,
                         "labels": {"job-name": job}},
            "status": status,
        })  # fmt: skip

    def job(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.objects["jobs"].get((ns, name))

    # ------------------------------------------------------------------ storage
    def _put(self, kind: str, ns: str, obj: dict[str, Any]) -> None:
        self._put_event(kind, ns, obj, "ADDED")

    def _put_event(self, kind: str, ns: str, obj: dict[str, Any], event: str) -> None:
        with self.changed:
            self.version += 1
            meta = obj.setdefault("metadata", {})
            meta["resourceVersion"] = str(self.version)
            meta.setdefault("uid", f"uid-{self.version}")
            meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
            if ns:
                meta["namespace"] = ns
            self.objects[kind][(ns, meta["name"])] = obj
            self.events.append((self.version, kind, event, json.loads(json.dumps(obj))))
            self.changed.notify_all()

    def _delete(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        with self.changed:
            obj = self.objects[kind].pop((ns, name), None)
            if obj is not None:
                self.version += 1
                self.events.append((self.version, kind, "DELETED", obj))
                if kind == "jobs":  # the garbage collector takes the pods with it
                    for key in [k for k, p in self.objects["pods"].items()
                                if p["metadata"]["labels"].get("job-name") == name]:  # fmt: skip
                        del self.objects["pods"][key]
                self.changed.notify_all()
            return obj


def _matches(obj: dict[str, Any], labels: str | None, fields: str | None) -> bool:
    meta = obj.get("metadata", {})
    for term in (labels or "").split(","):
        if term:
            k, _, v = term.partition("=")
            if meta.get("labels", {}).get(k) != v:
                return False
    for term in (fields or "").split(","):
        if term:
            k, _, v = term.partition("=")
            if k == "metadata.name" and meta.get("name") != v:
                return False
    return True


def _handler(api: FakeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _status(self, code: int, reason: str, message: str) -> None:
            self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                              "message": message, "reason": reason, "code": code})  # fmt: skip

        def _route(self) -> tuple[str, str, str | None, dict[str, list[str]]] | None:
            url = urlparse(self.path)
            query = parse_qs(url.query)
            parts = url.path.strip("/").split("/")
            if parts[:3] == ["api", "v1", "nodes"]:
                return "nodes", "", parts[3] if len(parts) > 3 else None, query
            for (prefix, plural), kind in ROUTES.items():
                p = prefix.split("/")
                if (
                    parts[: len(p)] == p
                    and parts[len(p)] == "namespaces"
                    and len(parts) > len(p) + 2
                ):
                    ns, rest = parts[len(p) + 1], parts[len(p) + 2 :]
                    if rest[0] == plural:
                        if ns not in api.namespaces:
                            self._status(404, "NotFound", f'namespaces "{ns}" not found')
                            return None
                        return kind, ns, rest[1] if len(rest) > 1 else None, query
            self._status(404, "NotFound", f"no route {url.path}")
            return None

        def do_GET(self) -> None:
            api.requests.append(("GET", self.path))
            route = self._route()
            if route is None:
                return
            kind, ns, name, q = route
            if name is not None:
                obj = api.objects[kind].get((ns, name))
                if obj is None:
                    self._status(404, "NotFound", f'{kind} "{name}" not found')
                else:
                    self._send(200, obj)
                return
            labels, fields = q.get("labelSelector", [None])[0], q.get("fieldSelector", [None])[0]
            if q.get("watch", ["false"])[0].lower() in ("true", "1"):
                self._watch(kind, ns, labels, fields, q)
                return
            items = [o for (n, _), o in api.objects[kind].items()
                     if n == ns and _matches(o, labels, fields)]  # fmt: skip
            limit = int(q.get("limit", ["0"])[0])
            self._send(200, {"kind": "List", "apiVersion": "v1",
                             "metadata": {"resourceVersion": str(api.version)},
                             "items": items[:limit] if limit else items})  # fmt: skip

        def _watch(self, kind: str, ns: str, labels: str | None, fields: str | None,
                   q: dict[str, list[str]]) -> None:  # fmt: skip
            since = int(q.get("resourceVersion", ["0"])[0] or 0)
            timeout = float(q.get("timeoutSeconds", ["5"])[0])

            def fresh() -> list[tuple[int, str, str, dict[str, Any]]]:
                return [e for e in api.events if e[0] > since and e[1] == kind
                        and e[3].get("metadata", {}).get("namespace") == ns
                        and _matches(e[3], labels, fields)]  # fmt: skip

            with api.changed:
                api.changed.wait_for(lambda: bool(fresh()), timeout)
                events = fresh()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            for _, _, event, obj in events:
                self.wfile.write(json.dumps({"type": event, "object": obj}).encode() + b"\n")

        def do_POST(self) -> None:
            api.requests.append(("POST", self.path))
            route = self._route()
            if route is None:
                return
            kind, ns, _, _ = route
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            name = body["metadata"]["name"]
            if (ns, name) in api.objects[kind]:
                self._status(409, "AlreadyExists", f'{kind} "{name}" already exists')
                return
            body.setdefault("status", {})
            api._put(kind, ns, body)
            self._send(201, api.objects[kind][(ns, name)])

        def do_DELETE(self) -> None:
            api.requests.append(("DELETE", self.path))
            route = self._route()
            if route is None:
                return
            kind, ns, name, _ = route
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            obj = api._delete(kind, ns, name or "")
            if obj is None:
                self._status(404, "NotFound", f'{kind} "{name}" not found')
            elif kind == "services":  # as the API does: a Service's delete returns it
                self._send(200, obj)
            else:
                self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

    return Handler


@contextmanager
def fake_api(namespaces: set[str]) -> Iterator[tuple[FakeApi, str]]:
    """The fake and its URL (http://127.0.0.1:PORT), served until the block ends."""
    api = FakeApi(namespaces)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(api))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
