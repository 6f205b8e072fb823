"""Property-based fuzz of every AgentService RPC against a real server, on SQLite and
PostgreSQL.

Hypothesis sends messages near a valid one with fields at the edges of their types
(tests/proto_strategies.py), and raw bytes that do not decode, through a generic gRPC
client. Whatever comes in:

- the answer is never INTERNAL, UNKNOWN, UNAVAILABLE or DATA_LOSS (those say "our fault"
  or "retry", and bad input is neither), and its details are at most 1 KB;
- a refused request stored nothing: every table is unchanged, and a refused heartbeat
  left the lease as it was;
- nothing is logged as an error, and afterwards the server still serves.

Bounded in time: `CPN_FUZZ_EXAMPLES` examples per RPC and backend (default 60).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpn.control.errors import MAX_DETAILS_BYTES
from cpn.registry import create_job
from proto.cpn.v1 import agent_pb2 as pb
from proto.cpn.v1 import agent_pb2_grpc
from tests.control_harness import ServerThread, auth, control_server, inventory, registry_digest
from tests.databases import BACKENDS, PostgresDatabases
from tests.proto_strategies import NOW_MS, near, undecodable

EXAMPLES = int(os.environ.get("CPN_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: What bad input must never get: these blame the server, or tell the client to retry.
FORBIDDEN = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS,
}
SERVICE = "/cpn.v1.AgentService/"


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Fuzzed:
    """A server with one registered agent (site a, node n0, GPUs 0 and 1) and job-1."""

    srv: ServerThread
    channel: grpc.Channel
    stub: agent_pb2_grpc.AgentServiceStub
    lease_id: str
    errors: _Errors

    def lease_state(self) -> tuple[Any, ...]:
        def read() -> tuple[Any, ...]:
            lease = self.srv.server.leases.get(self.lease_id)
            assert lease is not None
            return (
                lease.expires_mono,
                lease.health,
                dict(lease.pending_gpus),
                dict(lease.pending_links),
                dict(lease.last_usage),
            )

        return self.srv.on_loop(read)

    # Valid requests that the strategies start from.
    def register(self) -> pb.RegisterRequest:
        inv = inventory(nodes=1, gpus=2)
        inv.nodes[0].name = "r0"
        return pb.RegisterRequest(
            site="a", agent_id="fuzz-reg", version="1", inventory=inv,
            probe_address="127.0.0.1:9",
        )  # fmt: skip

    def heartbeat(self) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(
            site="a", agent_id="agent-1", lease_id=self.lease_id, health=pb.HEALTH_OK,
            gpus=[pb.GpuUsage(node="n0", index=1, utilisation=0.5, memory_used_gb=3.0)],
            links=[pb.LinkMeasurement(peer_site="b", bandwidth_gbps=1.0, rtt_ms=9.0,
                                      measured_at_unix_ms=NOW_MS)],
        )  # fmt: skip

    def watch(self) -> pb.WatchAssignmentsRequest:
        return pb.WatchAssignmentsRequest(site="a", agent_id="agent-1", lease_id=self.lease_id)

    def report(self) -> pb.ReportTaskStatusRequest:
        return pb.ReportTaskStatusRequest(
            site="a", agent_id="agent-1", lease_id=self.lease_id, job_id="job-1", rank=1,
            state=pb.TASK_STATE_RUNNING, step=5, loss=2.0, bytes=pb.LinkBytes(wan=7),
            checkpoint_id="ck-1", message="ok",
        )  # fmt: skip


@pytest.fixture(scope="module", params=BACKENDS)
def fuzzed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fuzzed]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('fuzz')}/registry.db"
    else:
        dbs: PostgresDatabases = request.getfixturevalue("postgres")
        url = dbs.create()
    errors = _Errors()
    loggers = [logging.getLogger(name) for name in ("cpn", "grpc")]
    for logger in loggers:
        logger.addHandler(errors)
    # Long leases, no background writes: any change in the database is a request's.
    quiet: dict[str, Any] = dict(
        lease_ttl_s=3600.0, flush_interval_s=3600.0, reaper_interval_s=3600.0
    )
    try:
        with control_server(url, **quiet) as srv:
            channel = grpc.insecure_channel(f"127.0.0.1:{srv.server.port}")
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            reg = pb.RegisterRequest(site="a", agent_id="agent-1", inventory=inventory(1, 2))
            lease_id = stub.Register(reg, metadata=auth("a"), timeout=10).lease_id
            with srv.registry.write() as s:
                create_job(s, "job-1", "job-1").plan = {"parallel": {"dp": 2, "tp": 1, "pp": 1}}
            yield Fuzzed(srv, channel, stub, lease_id, errors)
            _still_serving(srv, stub, lease_id, channel)
            channel.close()
    finally:
        for logger in loggers:
            logger.removeHandler(errors)


def _still_serving(
    srv: ServerThread, stub: agent_pb2_grpc.AgentServiceStub, lease_id: str, ch: grpc.Channel
) -> None:
    beat = pb.HeartbeatRequest(site="a", agent_id="agent-1", lease_id=lease_id, health=pb.HEALTH_OK)
    assert stub.Heartbeat(beat, metadata=auth("a"), timeout=10).lease_ttl_ms == 3_600_000
    health: Any = health_pb2_grpc.HealthStub(ch)
    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _outcome(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _check(
    f: Fuzzed,
    call: Callable[[], object],
    *,
    heartbeat: bool = False,
    allowed_extra: frozenset[grpc.StatusCode] = frozenset(),
) -> grpc.StatusCode:
    digest = registry_digest(f.srv.registry)
    lease = f.lease_state() if heartbeat else None
    code, details = _outcome(call)
    assert code not in FORBIDDEN, (code, details[:300])
    assert code in {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
        *allowed_extra,
    }, (code, details[:300])
    assert len(details.encode()) <= MAX_DETAILS_BYTES, (code, len(details))
    if code != grpc.StatusCode.OK and code not in allowed_extra:
        assert registry_digest(f.srv.registry) == digest, (code, details[:300])
        if heartbeat:
            assert f.lease_state() == lease, (code, details[:300])
    assert not f.errors.records, [r.getMessage()[:300] for r in f.errors.records]
    return code


# ---------------------------------------------------------------------------- messages


@FUZZ
@given(data=st.data())
def test_register(fuzzed: Fuzzed, data: st.DataObject) -> None:
    request = data.draw(near(fuzzed.register()))
    _check(fuzzed, lambda: fuzzed.stub.Register(request, metadata=auth("a"), timeout=30))


@FUZZ
@given(data=st.data())
def test_heartbeat(fuzzed: Fuzzed, data: st.DataObject) -> None:
    request = data.draw(near(fuzzed.heartbeat()))
    _check(
        fuzzed,
        lambda: fuzzed.stub.Heartbeat(request, metadata=auth("a"), timeout=30),
        heartbeat=True,
    )


@FUZZ
@given(data=st.data())
def test_heartbeat_stream(fuzzed: Fuzzed, data: st.DataObject) -> None:
    requests = data.draw(st.lists(near(fuzzed.heartbeat()), min_size=1, max_size=3))

    def call() -> None:
        replies = fuzzed.stub.HeartbeatStream(iter(requests), metadata=auth("a"), timeout=30)
        assert len(list(replies)) == len(requests)

    # A stream may renew with its first messages and then end on a bad one: the lease
    # state is compared only when the whole stream was refused at its first message.
    if len(requests) == 1:
        _check(fuzzed, call, heartbeat=True)
    else:
        _check(fuzzed, call)


@FUZZ
@given(data=st.data())
def test_watch_assignments(fuzzed: Fuzzed, data: st.DataObject) -> None:
    request = data.draw(near(fuzzed.watch()))
    # A valid watch waits for orders: it ends at its deadline, which is not a refusal.
    _check(
        fuzzed,
        lambda: next(fuzzed.stub.WatchAssignments(request, metadata=auth("a"), timeout=0.3)),
        allowed_extra=frozenset({grpc.StatusCode.DEADLINE_EXCEEDED}),
    )


@FUZZ
@given(data=st.data())
def test_report_task_status(fuzzed: Fuzzed, data: st.DataObject) -> None:
    request = data.draw(near(fuzzed.report()))
    _check(fuzzed, lambda: fuzzed.stub.ReportTaskStatus(request, metadata=auth("a"), timeout=30))


# ---------------------------------------------------------------------------- raw bytes


@FUZZ
@given(data=st.data())
def test_undecodable_bytes(fuzzed: Fuzzed, data: st.DataObject) -> None:
    method = data.draw(
        st.sampled_from(
            ["Register", "Heartbeat", "HeartbeatStream", "WatchAssignments", "ReportTaskStatus"]
        )
    )
    base: Any = {
        "Register": fuzzed.register,
        "Heartbeat": fuzzed.heartbeat,
        "HeartbeatStream": fuzzed.heartbeat,
        "WatchAssignments": fuzzed.watch,
        "ReportTaskStatus": fuzzed.report,
    }[method]()
    raw = data.draw(undecodable(base))
    ch = fuzzed.channel
    # Identity serializers (None): the bytes go on the wire exactly as drawn.
    if method == "HeartbeatStream":
        bidi: Any = ch.stream_stream(SERVICE + method)
        call: Callable[[], object] = lambda: list(bidi(iter([raw]), metadata=auth("a"), timeout=30))  # noqa: E731
    elif method == "WatchAssignments":
        stream: Any = ch.unary_stream(SERVICE + method)
        call = lambda: next(stream(raw, metadata=auth("a"), timeout=0.3))  # noqa: E731
    else:
        unary: Any = ch.unary_unary(SERVICE + method)
        call = lambda: unary(raw, metadata=auth("a"), timeout=30)  # noqa: E731
    _check(
        fuzzed,
        call,
        heartbeat=method in {"Heartbeat", "HeartbeatStream"},
        allowed_extra=frozenset(
            {grpc.StatusCode.DEADLINE_EXCEEDED} if method == "WatchAssignments" else ()
        ),
    )
