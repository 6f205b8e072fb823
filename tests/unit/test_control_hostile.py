"""Hostile requests that are legal protobuf, on SQLite and PostgreSQL: each is refused with
INVALID_ARGUMENT naming the field, short details, nothing stored; and database errors get
the status that tells a client the truth (UNAVAILABLE only when retrying can help)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import SQLAlchemyError

from cpn.control.db_status import database_status
from cpn.control.errors import MAX_DETAILS_BYTES
from cpn.registry import Registry, create_job
from cpn.registry.models import Event, JobStep, Site, Task
from proto.cpn.v1 import agent_pb2 as pb
from tests.control_harness import (
    ServerThread,
    auth,
    control_server,
    inventory,
    registry_digest,
    stub,
    wait_for,
)

MB = "x" * (1 << 20)
NOW_MS = int(time.time() * 1000)


def _beat(lease: str, **fields: Any) -> pb.HeartbeatRequest:
    base: dict[str, Any] = dict(site="a", agent_id="agent-1", lease_id=lease, health=pb.HEALTH_OK)
    return pb.HeartbeatRequest(**{**base, **fields})


def _link(**fields: Any) -> pb.LinkMeasurement:
    return pb.LinkMeasurement(**{"peer_site": "b", "bandwidth_gbps": 1.0, "rtt_ms": 10.0, **fields})


def _report(lease: str, **fields: Any) -> pb.ReportTaskStatusRequest:
    base: dict[str, Any] = dict(
        site="a", agent_id="agent-1", lease_id=lease, job_id="job-1", rank=0,
        state=pb.TASK_STATE_RUNNING,
    )  # fmt: skip
    return pb.ReportTaskStatusRequest(**{**base, **fields})


def _register(mutate: Callable[[pb.RegisterRequest], None]) -> pb.RegisterRequest:
    req = pb.RegisterRequest(site="a", agent_id="agent-1", version="t", inventory=inventory())
    mutate(req)
    return req


HEARTBEATS: dict[str, tuple[dict[str, Any], str]] = {
    "timestamp beyond datetime": (
        {"links": [_link(measured_at_unix_ms=2**62)]},
        "links[0].measured_at_unix_ms: 4611686018427387904 is in the future",
    ),
    "negative timestamp": (
        {"links": [_link(measured_at_unix_ms=-1)]},
        "links[0].measured_at_unix_ms: must be ≥ 0",
    ),
    "stale timestamp": (
        {"links": [_link(measured_at_unix_ms=NOW_MS - 3 * 86_400_000)]},
        "links[0].measured_at_unix_ms:",
    ),
    "tiny bandwidth": (
        {"links": [_link(bandwidth_gbps=1e-12)]},
        "links[0].bandwidth_gbps: must be 0 (link down) or ≥ 0.001, got 1e-12",
    ),
    "subnormal bandwidth": (
        {"links": [_link(bandwidth_gbps=5e-324)]},
        "links[0].bandwidth_gbps: must be 0 (link down) or ≥ 0.001",
    ),
    "unknown peer site": (
        {"links": [_link(peer_site="zz")]},
        "links[0].peer_site: unknown site 'zz'",
    ),
    "NUL in a peer site": ({"links": [_link(peer_site="b\0")]}, "links[0].peer_site: 'b\\x00'"),
    "two measurements to one site": (
        {"links": [_link(), _link()]},
        "links[1].peer_site: second measurement to 'b'",
    ),
    "usage of an unknown node": (
        {"gpus": [pb.GpuUsage(node="n9", index=0)]},
        "gpus[0].node: 'n9': not a node this agent registered",
    ),
    "usage of an unknown GPU": (
        {"gpus": [pb.GpuUsage(node="n0", index=2**32 - 1)]},
        "gpus[0].index: node 'n0' has no GPU 4294967295",
    ),
    "usage twice": (
        {"gpus": [pb.GpuUsage(node="n0", index=1), pb.GpuUsage(node="n0", index=1)]},
        "gpus[1]: second usage",
    ),
    "a megabyte of lease id": ({"lease_id": MB}, "lease_id: at most 64 characters"),
}

REPORTS: dict[str, tuple[dict[str, Any], str]] = {
    "step beyond BIGINT": ({"step": 2**64 - 1}, "step: must be ≤ 9223372036854775807"),
    "epoch beyond BIGINT": ({"epoch": 2**63}, "epoch: must be ≤ 9223372036854775807"),
    "rank beyond INTEGER": ({"rank": 2**32 - 1}, "rank: must be ≤ 2147483647"),
    "bytes beyond BIGINT": (
        {"bytes": pb.LinkBytes(wan=2**64 - 1)},
        "bytes.wan: must be ≤ 9223372036854775807",
    ),
    "unknown job": ({"job_id": "nope"}, "job_id: no launch order for job 'nope'"),
    "a job never launched here": (
        {"job_id": "job-2"},
        "job_id: no launch order for job 'job-2' was sent to agent 'agent-1'",
    ),
    "rank the job does not have": ({"rank": 7}, "rank: job 'job-1' has no rank 7 at site 'a'"),
    "an epoch the job has not reached": ({"epoch": 7}, "epoch: 7 is newer than the job's epoch 0"),
    "more steps done than the job has": (
        {"step": 51},
        "step: at most the job's train.steps (50), got 51",
    ),
    "a step the job does not have": (
        {"steps": [pb.StepMetrics(step=3), pb.StepMetrics(step=50)]},
        "steps[1].step: at most 49 (0-based; train.steps = 50)",
    ),
    "rank placed at another site": ({"rank": 2}, "rank: job 'job-1' has no rank 2 at site 'a'"),
    "NUL in a message": ({"message": "bad\0news"}, "message: 'bad\\x00news'"),
    "escape in a checkpoint id": ({"checkpoint_id": "c\x1b[2J"}, "checkpoint_id: 'c\\x1b[2J'"),
    "a megabyte of job id": ({"job_id": MB}, "job_id: at most 64 characters"),
    "a megabyte of message": ({"message": MB}, "message: at most 4096 characters"),
}


def _set_node_name(r: pb.RegisterRequest) -> None:
    r.inventory.nodes[0].name = "n0\n"


REGISTRATIONS: dict[str, tuple[Callable[[pb.RegisterRequest], None], str]] = {
    "newline after a node name": (_set_node_name, "inventory.nodes[0].name: 'n0\\n'"),
    "NUL in a GPU model": (
        lambda r: setattr(r.inventory.nodes[0].gpus[0], "model", "A100\0"),
        "inventory.nodes[0].gpus[0].model: 'A100\\x00'",
    ),
    "bidi override in a GPU uuid": (
        lambda r: setattr(r.inventory.nodes[0].gpus[1], "uuid", "GPU-\u202e1"),
        "inventory.nodes[0].gpus[1].uuid:",
    ),
    "NUL in a probe address": (
        lambda r: setattr(r, "probe_address", "evil\0:80"),
        "probe_address: 'evil\\x00:80': expected host:port",
    ),
    "non-ASCII digits in a port": (
        lambda r: setattr(r, "probe_address", "host:\u0661\u0662"),
        "probe_address:",
    ),
    "a zone id": (
        lambda r: setattr(r, "probe_address", "[fe80::1%eth0]:80"),
        "probe_address:",
    ),
    "RDMA port beyond INTEGER": (
        lambda r: setattr(r.inventory.nodes[0].rdma_nics[0], "port", 2**32 - 1),
        "inventory.nodes[0].rdma_nics[0].port: ports count from 1 to 254",
    ),
    "infinite intra-node bandwidth": (
        lambda r: setattr(r.inventory.nodes[0], "intra_node_gbps", float("inf")),
        "inventory.nodes[0].intra_node_gbps: must be a finite number",
    ),
    "a megabyte of version": (
        lambda r: setattr(r, "version", MB),
        "version: at most 64 characters, got 1048576",
    ),
    "a megabyte of agent id": (lambda r: setattr(r, "agent_id", MB), "agent_id: 'xxxx"),
}


def _launch_recorded(srv: ServerThread) -> bool:
    with srv.registry.read() as s:
        return s.query(Event).filter(Event.kind == "order_queued").count() == 1


def _refusal(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details() or ""


def test_hostile_values_are_named_and_nothing_is_stored(db_url: str) -> None:
    # Long leases and no background writes: any change in the database is the request's.
    quiet: dict[str, Any] = dict(
        lease_ttl_s=600.0, flush_interval_s=3600.0, reaper_interval_s=3600.0
    )
    with control_server(db_url, **quiet) as srv:
        channel, client = stub(srv.server.port)
        lease = client.Register(_register(lambda r: None), metadata=auth("a"), timeout=10).lease_id
        with srv.registry.write() as s:
            job = create_job(s, "job-1", "job-1", spec={"train": {"steps": 50}})
            job.plan = {"parallel": {"dp": 3, "tp": 1, "pp": 1}}
            create_job(s, "job-2", "job-2")  # submitted, never launched
        # The orchestration's launch order for agent-1: ranks 0 and 1 at site a, 2 at b.
        ranks = [pb.RankAssignment(rank=r, site=site) for r, site in ((0, "a"), (1, "a"), (2, "b"))]
        order = pb.Assignment(order_id="o-1", launch=pb.LaunchOrder(job_id="job-1", ranks=ranks))
        srv.on_loop(lambda: srv.server.dispatcher.submit("a", "agent-1", order))
        wait_for(lambda: _launch_recorded(srv), what="the launch order's event")
        before = registry_digest(srv.registry)
        cases: list[tuple[str, Any, Any, str]] = []
        for case, (fields, expected) in HEARTBEATS.items():
            cases.append((case, client.Heartbeat, _beat(lease, **fields), expected))
        for case, (fields, expected) in REPORTS.items():
            cases.append((case, client.ReportTaskStatus, _report(lease, **fields), expected))
        for case, (mutate, expected) in REGISTRATIONS.items():
            cases.append((case, client.Register, _register(mutate), expected))
        for case, rpc, request, expected in cases:
            code, details = _refusal(lambda: rpc(request, metadata=auth("a"), timeout=10))  # noqa: B023
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (case, code, details[:200])
            assert details.startswith(expected), (case, details[:200])
            assert len(details.encode()) <= MAX_DETAILS_BYTES, case
        # A megabyte of site: the token's site is named, the other quoted briefly.
        code, details = _refusal(
            lambda: client.Heartbeat(_beat(lease, site=MB), metadata=auth("a"))
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert details.startswith("site: this token is for site 'a', not 'xxx")
        assert len(details.encode()) <= 200
        assert registry_digest(srv.registry) == before
        # Another agent of the same site may not report on agent-1's ranks.
        other = _register(lambda r: setattr(r, "agent_id", "agent-2"))
        for node in other.inventory.nodes:
            node.name = f"other-{node.name}"
        lease_2 = client.Register(other, metadata=auth("a"), timeout=10).lease_id
        before = registry_digest(srv.registry)
        code, details = _refusal(
            lambda: client.ReportTaskStatus(
                _report(lease_2, agent_id="agent-2", state=pb.TASK_STATE_FAILED),
                metadata=auth("a"),
            )
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details == "job_id: no launch order for job 'job-1' was sent to agent 'agent-2'"
        assert registry_digest(srv.registry) == before
        # The same lease and job still work.
        now_ms = int(time.time() * 1000)
        client.Heartbeat(
            _beat(lease, links=[_link(measured_at_unix_ms=now_ms)]), metadata=auth("a")
        )
        client.ReportTaskStatus(_report(lease, rank=1, step=50), metadata=auth("a"))
        with srv.registry.read() as s:
            [task] = s.query(Task).all()
            assert (task.job_id, task.rank, task.step) == ("job-1", 1, 50)

        # A step is counted once per rank: repeated in one report (a worker restarted in
        # its epoch replays the steps after its checkpoint) or sent again in the next.
        def step(n: int, intra_site: int) -> pb.StepMetrics:
            return pb.StepMetrics(step=n, loss=1.0, bytes=pb.LinkBytes(intra_site=intra_site))

        for batch in (
            [step(0, 100), step(0, 999), step(1, 10), step(0, 999)],
            [step(1, 999), step(2, 5)],
        ):
            client.ReportTaskStatus(_report(lease, steps=batch), metadata=auth("a"))
        with srv.registry.read() as s:
            rows = s.query(JobStep).order_by(JobStep.step).all()
            assert [(r.step, r.ranks, r.loss_count, r.bytes_intra_site) for r in rows] == [
                (0, 1, 1, 100),
                (1, 1, 1, 10),
                (2, 1, 1, 5),
            ]
        channel.close()


def test_undecodable_bytes_get_invalid_argument(tmp_path: Path) -> None:
    with control_server(f"sqlite:///{tmp_path}/c.db") as srv:
        channel = grpc.insecure_channel(f"127.0.0.1:{srv.server.port}")
        valid = pb.RegisterRequest(site="a", agent_id="x").SerializeToString()
        invalid_utf8 = b"\x0a\x02\xff\xfe"  # field 1 (site), 2 bytes that are not UTF-8
        for method in ("Register", "Heartbeat", "ReportTaskStatus"):
            call: Any = channel.unary_unary(f"/cpn.v1.AgentService/{method}")
            for raw in (invalid_utf8, valid[:-1]):
                code, details = _refusal(lambda: call(raw, metadata=auth("a"), timeout=10))  # noqa: B023
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, raw)
                assert details.startswith("request: ") and "do not decode as cpn.v1." in details
        watch: Any = channel.unary_stream("/cpn.v1.AgentService/WatchAssignments")
        code, _ = _refusal(lambda: next(watch(invalid_utf8, metadata=auth("a"), timeout=10)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        beats: Any = channel.stream_stream("/cpn.v1.AgentService/HeartbeatStream")
        code, _ = _refusal(
            lambda: list(beats(iter([invalid_utf8]), metadata=auth("a"), timeout=10))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        # Authentication still comes first.
        call = channel.unary_unary("/cpn.v1.AgentService/Register")
        assert (
            _refusal(lambda: call(invalid_utf8, timeout=10))[0] == grpc.StatusCode.UNAUTHENTICATED
        )
        with srv.registry.read() as s:
            assert s.query(Site).count() == 0
        channel.close()


# ---------------------------------------------------------------------------- database errors


def _error(fn: Callable[[], object]) -> SQLAlchemyError:
    with pytest.raises(SQLAlchemyError) as err:
        fn()
    return err.value


def test_database_errors_a_request_causes_are_never_unavailable(registry: Registry) -> None:
    def duplicate_site() -> None:
        with registry.write() as s:
            s.add_all([Site(name="dup"), Site(name="dup")])

    def missing_table() -> None:
        with registry.write() as s:
            s.execute(text("SELECT * FROM no_such_table"))

    assert database_status(_error(duplicate_site))[0] == grpc.StatusCode.ABORTED
    assert database_status(_error(missing_table))[0] == grpc.StatusCode.INTERNAL
    if registry.dialect == "postgresql":

        def nul_in_text() -> None:
            with registry.write() as s:
                s.add(Site(name="a\0b"))

        def beyond_bigint() -> None:
            with registry.write() as s:
                s.execute(text("SELECT CAST(:v AS BIGINT)"), {"v": 2**63})

        for fn in (nul_in_text, beyond_bigint):
            code, details = database_status(_error(fn))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, fn.__name__
            assert details.startswith("request: ")


def test_a_database_that_is_really_unavailable_is_unavailable(tmp_path: Path) -> None:
    unreachable = create_engine("postgresql+psycopg://cpn@127.0.0.1:1/cpn?connect_timeout=2")
    exc = _error(unreachable.connect)
    assert database_status(exc)[0] == grpc.StatusCode.UNAVAILABLE
    cannot_open = create_engine(f"sqlite:///{tmp_path}/no/such/dir/x.db")
    exc = _error(cannot_open.connect)
    assert database_status(exc)[0] == grpc.StatusCode.UNAVAILABLE
    # Locked by another writer past the busy timeout (here 0 s).
    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x INTEGER)")
    holder.execute("BEGIN IMMEDIATE")
    impatient = create_engine(f"sqlite:///{path}", connect_args={"timeout": 0})

    def write() -> None:
        with impatient.begin() as conn:
            conn.execute(text("INSERT INTO t VALUES (1)"))

    assert database_status(_error(write))[0] == grpc.StatusCode.UNAVAILABLE
    holder.close()
