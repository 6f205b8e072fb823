"""The gRPC control server as agents see it: a real server on a real port, real clients."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sqlalchemy import func, select

from cpn.contracts import Plan
from cpn.control import TaskReport
from cpn.control.leases import LiveLease
from cpn.registry import Registry, upgrade
from cpn.registry.models import (
    Agent,
    AgentStatus,
    Event,
    Gpu,
    GpuStatus,
    Order,
    OrderState,
    Site,
    Task,
    TaskState,
    WanLink,
    utcnow,
)
from proto.cpn.v1 import agent_pb2 as pb
from tests.control_harness import ServerThread, auth, control_server, inventory, stub, wait_for


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/control.db"


def _register(client, site: str = "a", agent_id: str = "agent-1", **kw) -> pb.RegisterResponse:
    req = pb.RegisterRequest(site=site, agent_id=agent_id, version="t", inventory=inventory(), **kw)
    return client.Register(req, metadata=auth(site), timeout=10)


def _heartbeat(client, lease: str, site: str = "a", agent_id: str = "agent-1", **kw):
    req = pb.HeartbeatRequest(
        site=site, agent_id=agent_id, lease_id=lease, health=pb.HEALTH_OK, **kw
    )
    return client.Heartbeat(req, metadata=auth(site), timeout=10)


def _rows(registry: Registry, model: type) -> int:
    with registry.read() as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details() or ""


# ---------------------------------------------------------------------------- plumbing


def test_health_and_reflection_are_served_without_a_token(sqlite_url: str) -> None:
    with control_server(sqlite_url) as srv:
        channel = grpc.insecure_channel(f"127.0.0.1:{srv.server.port}")
        health: Any = health_pb2_grpc.HealthStub(channel)  # its stub types lack Check
        for service in ("", "cpn.v1.AgentService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect: Any = reflection_pb2_grpc.ServerReflectionStub(channel)
        [answer] = list(
            reflect.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        )
        names = {s.name for s in answer.list_services_response.service}
        assert {"cpn.v1.AgentService", "grpc.health.v1.Health"} <= names
        channel.close()


# ---------------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    ("metadata", "code", "words"),
    [
        ((), grpc.StatusCode.UNAUTHENTICATED, "missing bearer token"),
        (
            (("authorization", "Bearer not-a-token"),),
            grpc.StatusCode.UNAUTHENTICATED,
            "invalid token",
        ),
        (
            (("authorization", "Basic dXNlcjpwdw=="),),
            grpc.StatusCode.UNAUTHENTICATED,
            "missing bearer token",
        ),
        (auth("b"), grpc.StatusCode.PERMISSION_DENIED, "site: this token is for site 'b', not 'a'"),
    ],
)
def test_every_call_needs_the_sites_own_token(sqlite_url: str, metadata, code, words) -> None:
    with control_server(sqlite_url) as srv:
        channel, client = stub(srv.server.port)
        req = pb.RegisterRequest(site="a", agent_id="x", inventory=inventory())
        got = _code(lambda: client.Register(req, metadata=metadata, timeout=10))
        assert got[0] == code and words in got[1]
        hb = pb.HeartbeatRequest(site="a", agent_id="x", lease_id="l", health=pb.HEALTH_OK)
        assert _code(lambda: client.Heartbeat(hb, metadata=metadata, timeout=10))[0] == code
        watch = pb.WatchAssignmentsRequest(site="a", agent_id="x", lease_id="l")
        assert (
            _code(lambda: next(client.WatchAssignments(watch, metadata=metadata, timeout=10)))[0]
            == code
        )
        assert _rows(srv.registry, Site) == 0 and _rows(srv.registry, Event) == 0
        channel.close()


# ---------------------------------------------------------------------------- validation


def _bad(mutate) -> pb.RegisterRequest:
    req = pb.RegisterRequest(
        site="a", agent_id="agent-1", version="t", inventory=inventory(nodes=2)
    )
    mutate(req)
    return req


BAD_INVENTORIES = {
    "negative GPU count": (
        lambda r: setattr(r.inventory.nodes[0], "gpu_count", -1),
        "inventory.nodes[0].gpu_count: must be ≥ 0, got -1",
    ),
    "unknown transport": (
        lambda r: setattr(r.inventory.nodes[1].rdma_nics[0], "transport", 9),
        "inventory.nodes[1].rdma_nics[0].transport: unknown transport 9",
    ),
    "unset transport": (
        lambda r: setattr(r.inventory.nodes[0].rdma_nics[0], "transport", 0),
        "inventory.nodes[0].rdma_nics[0].transport: transport must be set",
    ),
    "duplicate node": (
        lambda r: setattr(r.inventory.nodes[1], "name", "n0"),
        "inventory.nodes[1].name: duplicate node 'n0'",
    ),
    "count disagrees with the list": (
        lambda r: setattr(r.inventory.nodes[0], "gpu_count", 3),
        "inventory.nodes[0].gpus: describes 2 GPUs, gpu_count says 3",
    ),
    "duplicate GPU index": (
        lambda r: setattr(r.inventory.nodes[0].gpus[1], "index", 0),
        "inventory.nodes[0].gpus[1].index: duplicate GPU index 0",
    ),
    "zero memory": (
        lambda r: setattr(r.inventory.nodes[0].gpus[0], "memory_gb", 0.0),
        "inventory.nodes[0].gpus[0].memory_gb: must be ≥ 0.001, got 0",
    ),
    # Tiny positive values pass "≥ 0" but make times no scheduler can represent.
    "a subnormal memory": (
        lambda r: setattr(r.inventory.nodes[0].gpus[0], "memory_gb", 5e-324),
        "inventory.nodes[0].gpus[0].memory_gb: must be ≥ 0.001, got 4.94066e-324",
    ),
    "tiny TFLOP/s": (
        lambda r: setattr(r.inventory.nodes[0].gpus[0], "tflops", 1e-300),
        "inventory.nodes[0].gpus[0].tflops: must be 0 (unknown) or ≥ 0.001, got 1e-300",
    ),
    "tiny in-node bandwidth": (
        lambda r: setattr(r.inventory.nodes[0], "intra_node_gbps", 1e-300),
        "inventory.nodes[0].intra_node_gbps: must be 0 (unknown) or ≥ 0.001, got 1e-300",
    ),
    "tiny NIC rate": (
        lambda r: setattr(r.inventory.nodes[0].rdma_nics[0], "rate_gbps", 1e-12),
        "inventory.nodes[0].rdma_nics[0].rate_gbps: must be 0 (unknown) or ≥ 0.001, got 1e-12",
    ),
    "not a number": (
        lambda r: setattr(r.inventory.nodes[0].rdma_nics[0], "rate_gbps", math.nan),
        "inventory.nodes[0].rdma_nics[0].rate_gbps: must be a finite number",
    ),
    "RoCE without a version": (
        lambda r: setattr(r.inventory.nodes[0].rdma_nics[0], "transport", pb.RDMA_TRANSPORT_ROCE),
        "inventory.nodes[0].rdma_nics[0].roce_version: must be 1 or 2",
    ),
    "bad node name": (
        lambda r: setattr(r.inventory.nodes[0], "name", "n 0"),
        "inventory.nodes[0].name: 'n 0'",
    ),
    "no nodes": (lambda r: r.inventory.ClearField("nodes"), "inventory.nodes: at least one node"),
    "no inventory": (lambda r: r.ClearField("inventory"), "inventory: required"),
    "no agent id": (lambda r: setattr(r, "agent_id", ""), "agent_id: required"),
    "bad probe address": (
        lambda r: setattr(r, "probe_address", "nowhere"),
        "probe_address: 'nowhere'",
    ),
}


def test_malformed_registrations_name_the_field_and_store_nothing(sqlite_url: str) -> None:
    with control_server(sqlite_url) as srv:
        channel, client = stub(srv.server.port)
        for case, (mutate, message) in BAD_INVENTORIES.items():
            code, details = _code(
                lambda m=mutate: client.Register(_bad(m), metadata=auth("a"), timeout=10)
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT, case
            assert details.startswith(message), (case, details)
        for model in (Site, Agent, Gpu, Event):
            assert _rows(srv.registry, model) == 0
        _register(client)  # the server is fine afterwards
        assert _rows(srv.registry, Gpu) == 2
        channel.close()


def test_an_oversized_registration_is_refused_whole(sqlite_url: str) -> None:
    with control_server(sqlite_url, max_message_bytes=64 * 1024) as srv:
        channel, client = stub(srv.server.port)
        huge = pb.RegisterRequest(
            site="a", agent_id="agent-1", inventory=inventory(nodes=600, gpus=8)
        )
        assert huge.ByteSize() > 64 * 1024
        code, details = _code(lambda: client.Register(huge, metadata=auth("a"), timeout=10))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert _rows(srv.registry, Site) == 0 and _rows(srv.registry, Gpu) == 0
        _register(client)
        channel.close()


def test_bad_heartbeats_and_reports_name_the_field(sqlite_url: str) -> None:
    with control_server(sqlite_url) as srv:
        channel, client = stub(srv.server.port)
        lease = _register(client).lease_id
        usage = [pb.GpuUsage(node="n0", index=0, utilisation=1.5)]
        code, details = _code(lambda: _heartbeat(client, lease, gpus=usage))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(
            "gpus[0].utilisation"
        )
        req = pb.HeartbeatRequest(site="a", agent_id="agent-1", lease_id=lease)
        code, details = _code(lambda: client.Heartbeat(req, metadata=auth("a"), timeout=10))
        assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "health: health must be set")
        report = pb.ReportTaskStatusRequest(
            site="a", agent_id="agent-1", lease_id=lease, job_id="j"
        )
        code, details = _code(
            lambda: client.ReportTaskStatus(report, metadata=auth("a"), timeout=10)
        )
        assert (code, details) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "state: task state must be set",
        )
        assert _rows(srv.registry, Task) == 0
        channel.close()


# ---------------------------------------------------------------------------- leases


def test_heartbeats_renew_and_a_silent_agent_is_lost(db_url: str) -> None:
    ttl = 2.0  # long enough that a busy machine does not expire it between two beats
    with control_server(db_url, lease_ttl_s=ttl, heartbeat_interval_s=0.3) as srv:
        channel, client = stub(srv.server.port)
        lease = _register(client, probe_address="127.0.0.1:9").lease_id
        _register(client, site="b", agent_id="agent-b", probe_address="127.0.0.1:10")
        link = pb.LinkMeasurement(peer_site="b", bandwidth_gbps=9.0, rtt_ms=12.0)
        replies = []
        for _ in range(9):  # 2.7 s of heartbeats: longer than the TTL, so renewal works
            usage = [pb.GpuUsage(node="n0", index=1, utilisation=0.25)]
            replies.append(_heartbeat(client, lease, links=[link], gpus=usage))
            time.sleep(0.3)
        first = replies[0]  # later ones may already miss b, which never heartbeats
        assert first.lease_ttl_ms == 2000 and first.heartbeat_interval_ms == 300
        assert [p.site for p in first.peers] == ["b"] and first.peers_changed
        last = time.monotonic()

        def lost() -> bool:
            with srv.registry.read() as s:
                agent = s.scalars(select(Agent).where(Agent.agent_id == "agent-1")).one()
                return agent.status == AgentStatus.LOST

        wait_for(lost, timeout=30, what="agent-1 to be declared lost")
        assert time.monotonic() - last < ttl + 4.0  # lost within TTL + grace (a busy machine)
        code, details = _code(lambda: _heartbeat(client, lease))
        assert code == grpc.StatusCode.NOT_FOUND and "register again" in details
        with srv.registry.read() as s:
            gpus = s.scalars(select(Gpu).join(Gpu.node).where(Gpu.node.has(name="n0"))).all()
            assert {g.status for g in gpus if g.node.site.name == "a"} == {GpuStatus.LOST}
            assert [g.utilisation for g in gpus if g.node.site.name == "a" and g.index == 1] == [
                0.25
            ]
            [m] = s.scalars(select(WanLink)).all()
            assert (m.site.name, m.peer_site.name, m.bandwidth_gbps, m.rtt_ms) == (
                "a",
                "b",
                9.0,
                12.0,
            )
            assert "agent_lost" in s.scalars(select(Event.kind)).all()
        channel.close()


def test_the_database_never_shows_a_lease_alive_after_it_expired(sqlite_url: str) -> None:
    ttl = 2.0
    with control_server(sqlite_url, lease_ttl_s=ttl, heartbeat_interval_s=0.2, flush_interval_s=0.3,
                        reaper_interval_s=5.0) as srv:  # fmt: skip
        channel, client = stub(srv.server.port)
        lease = _register(client).lease_id
        for _ in range(5):
            _heartbeat(client, lease)
            answered = time.time()  # the server renewed before answering: expiry ≤ this + TTL
            time.sleep(0.1)
        seen_alive_late = []
        while time.time() < answered + ttl + 1.0:  # the reaper is slow on purpose here
            with srv.registry.read() as s:
                agent = s.scalars(select(Agent)).one()
                now = utcnow()
                if agent.alive_at(now) and now.timestamp() > answered + ttl:
                    seen_alive_late.append(now)
            time.sleep(0.02)
        assert seen_alive_late == []
        channel.close()


def test_after_a_restart_agents_must_register_again_and_absentees_are_reaped(
    sqlite_url: str,
) -> None:
    with control_server(sqlite_url) as srv:
        channel, client = stub(srv.server.port)
        first = _register(client).lease_id
        _register(client, site="b", agent_id="never-back")
        channel.close()
    with control_server(
        sqlite_url, lease_ttl_s=1.0, heartbeat_interval_s=0.2, restart_grace_s=1.0
    ) as srv:
        channel, client = stub(srv.server.port)
        code, details = _code(lambda: _heartbeat(client, first))
        assert code == grpc.StatusCode.NOT_FOUND and "restarted" in details
        again = _register(client)
        assert again.lease_id != first

        def states() -> dict[str, tuple[AgentStatus, int]]:
            with srv.registry.read() as s:
                return {a.agent_id: (a.status, a.registrations) for a in s.scalars(select(Agent))}

        def never_back_lost() -> bool:
            _heartbeat(client, again.lease_id)  # keep agent-1 alive meanwhile
            time.sleep(0.1)
            return states()["never-back"][0] == AgentStatus.LOST

        # never-back had up to the old server's TTL (5 s) left: it gets that much grace
        # (more than restart_grace_s).
        wait_for(never_back_lost, what="never-back lost")
        assert states()["agent-1"] == (AgentStatus.ALIVE, 2)
        channel.close()


# ---------------------------------------------------------------------------- orders and status

PLAN = Plan.model_validate(
    {
        "job": "tiny",
        "parallel": {"dp": 2, "tp": 1, "pp": 1},
        "micro_batches": 1,
        "shards": [
            {"replica": 0, "stage": 0, "site": "a", "node": "n0", "gpus": [0]},
            {"replica": 1, "stage": 0, "site": "b", "node": "n0", "gpus": [1]},
        ],
        "bytes_per_iteration": {"intra_node": 0, "intra_site": 0, "wan": 1},
        "predicted_iteration_seconds": 1.0,
        "breakdown": {"compute": 1.0, "pipeline": 0, "dp_sync": 0, "bubble": 0},
        "price_per_hour": 0,
        "solver": {"status": "OPTIMAL", "seconds": 0, "objective": 1, "bound": 1, "gap": 0},
    }
)


def test_orders_queued_before_the_agent_watches_are_delivered_in_order(sqlite_url: str) -> None:
    # This agent never heartbeats: a lease long enough for the whole test on a busy machine.
    with control_server(sqlite_url, lease_ttl_s=60) as srv:
        channel, client = stub(srv.server.port)
        lease = _register(client).lease_id
        dispatcher = srv.server.dispatcher
        # Called from this (non-loop) thread, as the orchestration would.
        launch_id = dispatcher.launch(
            "a",
            "agent-1",
            job_id="job-7",
            plan=PLAN,
            job_yaml="name: tiny\n",
            master_addr="10.0.0.1",
            master_port=29500,
            env={"X": "1"},
        )
        stop_id = dispatcher.stop("a", "agent-1", job_id="job-7", reason="cancelled")
        watch = pb.WatchAssignmentsRequest(site="a", agent_id="agent-1", lease_id=lease)
        # Deadlines for the whole test, not one read: a loaded machine makes it slow.
        stream = client.WatchAssignments(watch, metadata=auth("a"), timeout=120)
        first, second = next(stream), next(stream)
        assert (first.order_id, second.order_id) == (launch_id, stop_id)
        order = first.launch
        assert (order.job_id, order.world_size, order.master_addr, order.master_port) == (
            "job-7",
            2,
            "10.0.0.1",
            29500,
        )
        assert [(r.rank, r.site, r.node, r.gpu) for r in order.ranks] == [
            (0, "a", "n0", 0),
            (1, "b", "n0", 1),
        ]
        assert Plan.model_validate_json(order.plan_json) == PLAN and dict(order.env) == {"X": "1"}
        assert (second.stop.job_id, second.stop.reason) == ("job-7", "cancelled")

        def queued() -> list[str]:
            with srv.registry.read() as s:
                rows = s.scalars(
                    select(Event).where(Event.kind == "order_queued", Event.job_id == "job-7")
                )
                return [e.data["order_id"] for e in rows]

        assert wait_for(lambda: len(queued()) == 2 and queued(), what="order events") == [
            launch_id,
            stop_id,
        ]
        # A second stream for the same agent takes over; the first one ends.
        newer = client.WatchAssignments(watch, metadata=auth("a"), timeout=120)
        got = []
        reader = threading.Thread(target=lambda: got.append(next(newer)))
        reader.start()
        wait_for(lambda: srv.on_loop(lambda: True), what="server loop")
        time.sleep(0.3)
        assert list(stream) == []  # ended cleanly
        dispatcher.stop("a", "agent-1", job_id="job-8")
        reader.join(10)
        assert got[0].stop.job_id == "job-8"
        newer.cancel()
        channel.close()


def delivered(srv: Any) -> bool:
    with srv.registry.read() as s:
        states = s.scalars(select(Order.state)).all()
    return set(states) == {OrderState.DELIVERED}


def test_orders_outlive_a_restart_and_are_delivered_once(db_url: str) -> None:
    """Orders are rows: queued before a restart, delivered after it; delivered ones are not
    sent again by the next control plane; the same order for one job epoch is queued once;
    a lost agent's undelivered orders are dropped."""
    upgrade(db_url)
    launch = dict(
        plan=PLAN, job_yaml="name: tiny\n", master_addr="h", master_port=1, epoch=3,
        checkpoint_store="/ckpt/job-1/e3", checkpoint_every=5, resume_from="/ckpt/e2/step-00000010",
    )  # fmt: skip
    with control_server(db_url, migrate=False, lease_ttl_s=60) as srv:
        first = srv.server.dispatcher.launch("a", "agent-1", job_id="job-1", **launch)
        again = srv.server.dispatcher.launch("a", "agent-1", job_id="job-1", **launch)
        assert again == first  # one launch per (job, epoch, agent)
        stop = srv.server.dispatcher.stop("a", "agent-1", job_id="job-1", epoch=3)
    with control_server(db_url, migrate=False, lease_ttl_s=60) as srv:
        channel, client = stub(srv.server.port)
        lease = _register(client).lease_id
        watch = pb.WatchAssignmentsRequest(site="a", agent_id="agent-1", lease_id=lease)
        stream = client.WatchAssignments(watch, metadata=auth("a"), timeout=30)
        got = [next(stream), next(stream)]
        assert [g.order_id for g in got] == [first, stop]
        order = got[0].launch
        assert (order.epoch, order.checkpoint_store, order.checkpoint_every, order.resume_from) == (
            3, "/ckpt/job-1/e3", 5, "/ckpt/e2/step-00000010",
        )  # fmt: skip
        assert got[1].stop.epoch == 3

        wait_for(lambda: delivered(srv), what="both orders marked delivered")
        stream.cancel()
        channel.close()
    with control_server(db_url, migrate=False, lease_ttl_s=3, reaper_interval_s=0.1) as srv:
        channel, client = stub(srv.server.port)
        lease = _register(client).lease_id
        later = srv.server.dispatcher.stop("a", "agent-1", job_id="job-2")
        stream = client.WatchAssignments(
            pb.WatchAssignmentsRequest(site="a", agent_id="agent-1", lease_id=lease),
            metadata=auth("a"),
            timeout=30,
        )
        assert next(stream).order_id == later  # nothing delivered before comes again
        wait_for(lambda: delivered(srv), what="the new order marked delivered")
        stream.cancel()
        # Queued for an agent that then goes silent: dropped when it is declared lost. (Its
        # lease renewed just before, or on a loaded machine it could expire before the
        # order is queued — CI once: "0 orders dropped" — with a 1 s lease and no renewal.)
        _heartbeat(client, lease)
        srv.server.dispatcher.stop("a", "agent-1", job_id="job-3")

        def dropped() -> bool:
            with srv.registry.read() as s:
                row = s.scalars(select(Order).where(Order.job_id == "job-3")).one()
            return row.state is OrderState.DROPPED

        wait_for(dropped, what="the lost agent's order dropped")
        with srv.registry.read() as s:
            lost = s.scalars(select(Event).where(Event.kind == "agent_lost")).one()
        assert "1 queued orders dropped" in lost.message
        channel.close()


def test_task_status_is_stored_with_events_and_passed_on(sqlite_url: str) -> None:
    with control_server(sqlite_url) as srv:
        seen: list[TaskReport] = []
        srv.server.state.task_listeners.append(seen.append)
        channel, client = stub(srv.server.port)
        lease = _register(client).lease_id
        # Reports are about jobs the agent was ordered to run: PLAN puts rank 0 at site a.
        srv.server.dispatcher.launch(
            "a", "agent-1", job_id="job-1", plan=PLAN, job_yaml="", master_addr="h",
            master_port=1,
        )  # fmt: skip
        wait_for(lambda: _rows(srv.registry, Event) >= 2, what="the order's event")
        for state, step in (
            (pb.TASK_STATE_RUNNING, 10),
            (pb.TASK_STATE_RUNNING, 20),
            (pb.TASK_STATE_SUCCEEDED, 20),
        ):
            req = pb.ReportTaskStatusRequest(
                site="a", agent_id="agent-1", lease_id=lease, job_id="job-1", rank=0, state=state,
                step=step, loss=2.5, bytes=pb.LinkBytes(intra_node=1, intra_site=2, wan=3 << 33),
                checkpoint_id=f"ckpt-{step}",
            )  # fmt: skip
            client.ReportTaskStatus(req, metadata=auth("a"), timeout=10)
        with srv.registry.read() as s:
            task = s.scalars(select(Task)).one()
            assert (task.job_id, task.rank, task.state, task.step) == (
                "job-1",
                0,
                TaskState.SUCCEEDED,
                20,
            )
            assert (task.loss, task.bytes_wan, task.checkpoint_id, task.exit_code) == (
                2.5,
                3 << 33,
                "ckpt-20",
                0,
            )
            kinds = s.scalars(
                select(Event.kind).where(Event.job_id == "job-1").order_by(Event.id)
            ).all()
            # running, succeeded: not every step
            assert kinds == ["order_queued", "task_state", "task_state"]
        assert [r.state for r in seen] == [
            TaskState.RUNNING,
            TaskState.RUNNING,
            TaskState.SUCCEEDED,
        ]
        channel.close()


def test_heartbeats_on_a_stream(sqlite_url: str) -> None:
    with control_server(sqlite_url, lease_ttl_s=1.0, heartbeat_interval_s=0.2) as srv:
        channel, client = stub(srv.server.port)
        lease = _register(client).lease_id
        beat = pb.HeartbeatRequest(
            site="a", agent_id="agent-1", lease_id=lease, health=pb.HEALTH_OK
        )
        replies = list(client.HeartbeatStream(iter([beat] * 5), metadata=auth("a"), timeout=10))
        assert len(replies) == 5 and all(r.lease_ttl_ms == 1000 for r in replies)
        # One bad message ends the stream with the status a unary call would get.
        bad = pb.HeartbeatRequest(site="a", agent_id="agent-1", lease_id=lease)
        stream = client.HeartbeatStream(iter([beat, bad, beat]), metadata=auth("a"), timeout=10)
        assert next(stream).lease_ttl_ms == 1000
        code, details = _code(lambda: next(stream))
        assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "health: health must be set")
        other = pb.HeartbeatRequest(
            site="b", agent_id="agent-1", lease_id=lease, health=pb.HEALTH_OK
        )
        stream = client.HeartbeatStream(iter([other]), metadata=auth("a"), timeout=10)
        assert _code(lambda: next(stream))[0] == grpc.StatusCode.PERMISSION_DENIED
        stream = client.HeartbeatStream(iter([beat]), timeout=10)
        assert _code(lambda: next(stream))[0] == grpc.StatusCode.UNAUTHENTICATED
        unknown = pb.HeartbeatRequest(
            site="a", agent_id="agent-1", lease_id="nope", health=pb.HEALTH_OK
        )
        stream = client.HeartbeatStream(iter([unknown]), metadata=auth("a"), timeout=10)
        assert _code(lambda: next(stream))[0] == grpc.StatusCode.NOT_FOUND

        # Renewals on the stream keep the agent alive past its TTL.
        def beats() -> Iterator[pb.HeartbeatRequest]:
            for _ in range(8):
                yield beat
                time.sleep(0.2)

        assert len(list(client.HeartbeatStream(beats(), metadata=auth("a"), timeout=30))) == 8
        with srv.registry.read() as s:
            assert s.scalars(select(Agent)).one().status == AgentStatus.ALIVE
        channel.close()


def test_an_agent_restarted_without_its_workers_has_them_marked_lost(db_url: str) -> None:
    """An agent that comes back within its lease's TTL replaces its lease (no loss is
    declared): the launches its registration lists are its own, and its ranks in any
    other launch are lost at once — they would never report again. A registration that
    does not list (the same process, with new nodes) changes nothing."""
    upgrade(db_url)
    with control_server(db_url, migrate=False) as srv:
        losses: list[tuple[str, str]] = []
        srv.server.state.loss_listeners.append(lambda *who: losses.append(who))
        channel, client = stub(srv.server.port)
        lease = _register(client).lease_id
        for job_id in ("job-kept", "job-gone"):
            srv.server.dispatcher.launch(
                "a", "agent-1", job_id=job_id, plan=PLAN, job_yaml="", master_addr="h",
                master_port=1, epoch=3,
            )  # fmt: skip
        wait_for(lambda: _rows(srv.registry, Event) >= 3, what="the orders' events")
        for job_id in ("job-kept", "job-gone"):
            client.ReportTaskStatus(
                pb.ReportTaskStatusRequest(
                    site="a", agent_id="agent-1", lease_id=lease, job_id=job_id, rank=0,
                    state=pb.TASK_STATE_RUNNING, step=5, epoch=3,
                ),
                metadata=auth("a"),
                timeout=10,
            )  # fmt: skip

        def states() -> dict[str, tuple[TaskState, str]]:
            with srv.registry.read() as s:
                return {t.job_id: (t.state, t.message) for t in s.scalars(select(Task))}

        _register(client)  # not listed: the same process, registering its nodes again
        assert {j: st for j, (st, _) in states().items()} == {
            "job-kept": TaskState.RUNNING,
            "job-gone": TaskState.RUNNING,
        }
        assert losses == []
        # A new process that adopted one of the two launches (and an older epoch of the
        # other, which does not count).
        kept = [pb.LaunchRef(job_id="job-kept", epoch=3), pb.LaunchRef(job_id="job-gone", epoch=2)]
        _register(client, launches=kept, launches_listed=True)
        now = states()
        assert now["job-kept"] == (TaskState.RUNNING, "")
        assert now["job-gone"] == (
            TaskState.NODE_LOST,
            "LOST: agent agent-1 restarted and no longer runs this launch",
        )
        assert losses == [("a", "agent-1")]
        channel.close()


@pytest.mark.parametrize(
    ("launches", "words"),
    [
        ([pb.LaunchRef(job_id="", epoch=1)], "launches[0].job_id"),
        ([pb.LaunchRef(job_id="job\n1", epoch=1)], "launches[0].job_id"),
        ([pb.LaunchRef(job_id="j", epoch=1 << 63)], "launches[0].epoch"),
    ],
)
def test_a_registration_with_bad_launches_is_refused_naming_them(
    sqlite_url: str, launches: list[pb.LaunchRef], words: str
) -> None:
    with control_server(sqlite_url) as srv:
        channel, client = stub(srv.server.port)
        code, details = _code(lambda: _register(client, launches=launches, launches_listed=True))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith(words), details
        channel.close()


def _expired_then_back(srv: ServerThread, client: Any) -> tuple[str, list[LiveLease], str]:
    """An agent whose lease expired, and the list of expired leases the reaper would take
    then, before the agent registers again: (old lease id, that list, new lease id)."""
    old = _register(client).lease_id
    wait_for(
        lambda: srv.on_loop(lambda: bool(srv.server.leases.expired())),
        what="the first lease to expire",
    )
    stale: list[LiveLease] = srv.on_loop(srv.server.leases.expired)
    assert [lease.lease_id for lease in stale] == [old]
    new = _register(client).lease_id  # the agent is back: a new lease, a new session
    _heartbeat(client, new)
    return old, stale, new


def _assert_alive(srv: ServerThread) -> None:
    """agent-1 is not lost and its GPUs are available."""
    with srv.registry.read() as s:
        agent = s.scalars(select(Agent).where(Agent.agent_id == "agent-1")).one()
        assert agent.status != AgentStatus.LOST
        assert {g.status for g in s.scalars(select(Gpu))} == {GpuStatus.AVAILABLE}


def test_a_lease_replaced_while_the_reaper_works_is_not_reaped(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reaper takes its list of expired leases, then awaits the database for each: an
    agent may register again in between (seen in the chaos test under load: an agent
    back from an outage registered just as its restored lease was reaped). The replaced
    lease must not cost the new session anything: not its stream, not its queued orders,
    not the agent's status. The interleaving is made exact by handing the reaper the list
    it took before the registration."""
    with control_server(db_url, lease_ttl_s=1.0, reaper_interval_s=3600) as srv:
        channel, client = stub(srv.server.port)
        _, stale, new = _expired_then_back(srv, client)
        watch = pb.WatchAssignmentsRequest(site="a", agent_id="agent-1", lease_id=new)
        stream = client.WatchAssignments(watch, metadata=auth("a"), timeout=120)
        # The list the reaper took before the registration:
        monkeypatch.setattr(srv.server.leases, "expired", lambda now_mono=None: stale)
        assert srv.run(srv.server.reap()) == []
        stop_id = srv.server.dispatcher.stop("a", "agent-1", job_id="job-9")
        assert next(stream).order_id == stop_id  # the new session's stream still serves
        _heartbeat(client, new)

        def order_states() -> list[OrderState]:
            with srv.registry.read() as s:
                return list(s.scalars(select(Order.state)).all())

        # Marked delivered once the stream asks for the next order, after the client has it.
        wait_for(lambda: order_states() == [OrderState.DELIVERED], what="the order delivered")
        _assert_alive(srv)
        stream.cancel()
        channel.close()


def test_a_lease_replaced_in_the_database_only_is_not_told_as_a_loss(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The narrower interleaving: the registration reaches the database after the reaper's
    in-memory check and before its transaction. The reaper must then neither mark the
    agent lost nor tell the orchestration of a loss (nor log one): nothing was lost. Made
    exact by letting the reaper see the old lease as still current in memory."""
    with control_server(db_url, lease_ttl_s=1.0, reaper_interval_s=3600) as srv:
        channel, client = stub(srv.server.port)
        old, stale, _ = _expired_then_back(srv, client)
        told: list[tuple[str, str]] = []
        srv.on_loop(lambda: srv.server.state.loss_listeners.append(lambda *a: told.append(a)))
        monkeypatch.setattr(srv.server.leases, "expired", lambda now_mono=None: stale)
        real_get = srv.server.leases.get
        monkeypatch.setattr(
            srv.server.leases,
            "get",
            lambda lease_id: stale[0] if lease_id == old else real_get(lease_id),
        )
        assert srv.run(srv.server.reap()) == []
        assert told == []
        _assert_alive(srv)
        channel.close()
