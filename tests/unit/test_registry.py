"""The registry on SQLite and on PostgreSQL: migrations, registration, leases, allocation,
and the topology the scheduler gets from it."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, select, text, update

from cpn.contracts import JobSpec
from cpn.registry import (
    AllocationConflict,
    EmptyRegistry,
    GpuInfo,
    NicInfo,
    NoCapacity,
    NodeInfo,
    NodeOwnedError,
    Registry,
    SiteSettings,
    allocate_free,
    allocate_gpus,
    apply_heartbeats,
    build_topology,
    create_job,
    db,
    downgrade,
    live_leases,
    mark_lost,
    release,
    reserve_link,
    upgrade,
)
from cpn.registry.leases import GpuUsage, HeartbeatRecord, LinkSample
from cpn.registry.migrate import current_revision, head_revision
from cpn.registry.models import (
    Agent,
    AgentStatus,
    Base,
    Event,
    Gpu,
    GpuStatus,
    Lease,
    Node,
    Site,
    utcnow,
)
from cpn.scheduler import plan_job
from tests.databases import PostgresDatabases
from tests.registry_factories import node, register

TABLES = {
    "sites", "agents", "leases", "nodes", "gpus", "rdma_nics", "wan_links", "jobs", "tenants",
    "api_keys", "quotes", "rendezvous_ports", "job_log_lines", "job_steps",
    "allocations", "link_reservations", "tasks", "events", "orders",
}  # fmt: skip


# ---------------------------------------------------------------------------- migrations


def test_migrations_upgrade_from_empty_and_downgrade_to_base(db_url: str) -> None:
    reg = Registry(db_url)
    try:
        assert not set(inspect(reg.engine).get_table_names()) & TABLES
        upgrade(db_url)
        assert set(inspect(reg.engine).get_table_names()) >= TABLES
        assert current_revision(db_url) == head_revision()
        # The migrations and the ORM models describe the same schema.
        with reg.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == []
        upgrade(db_url)  # idempotent
        downgrade(db_url, "base")
        assert not set(inspect(reg.engine).get_table_names()) & TABLES
        assert current_revision(db_url) is None
        upgrade(db_url)  # and back up again
        assert set(inspect(reg.engine).get_table_names()) >= TABLES
    finally:
        reg.dispose()


# ---------------------------------------------------------------------------- registration


def test_register_stores_the_inventory_lease_and_an_event(registry: Registry) -> None:
    nics = (
        NicInfo("mlx5_0", 1, "infiniband", 200.0, "active"),
        NicInfo("mlx5_1", 1, "roce", 100.0, "down", roce_version=2),
    )
    done = register(registry, "beijing", nodes=(node("bj-0", gpus=8, nics=nics),))
    with registry.read() as s:
        site = s.scalars(select(Site)).one()
        assert site.name == "beijing"
        agent = s.scalars(select(Agent)).one()
        assert agent.agent_id == "beijing-agent" and agent.status == AgentStatus.ALIVE
        assert agent.alive_at(utcnow())
        n = s.scalars(select(Node)).one()
        assert [g.index for g in n.gpus] == list(range(8))
        assert all(g.tflops == 312.0 for g in n.gpus)  # filled in from the model name
        assert [(c.device, c.transport, c.state) for c in n.rdma_nics] == [
            ("mlx5_0", "infiniband", "active"),
            ("mlx5_1", "roce", "down"),
        ]
        assert s.get(Lease, done.lease_pk) is not None
        assert [e.kind for e in s.scalars(select(Event))] == ["agent_registered"]
    assert len(done.gpu_ids) == 8


def test_registering_again_keeps_identity_and_allocations(registry: Registry) -> None:
    first = register(registry, "a", nodes=(node("n0", gpus=4),))
    with registry.write() as s:
        create_job(s, "job-1", "job-1")
        allocate_gpus(s, "job-1", {"a": {"n0": [3]}})
    # The agent restarts and reports only 2 GPUs: GPU 3 is held, so it stays (lost);
    # GPU 2 is free, so it goes.
    second = register(registry, "a", nodes=(node("n0", gpus=2),))
    assert second.agent_pk == first.agent_pk and second.lease_id != first.lease_id
    assert second.registrations == 2
    with registry.read() as s:
        gpus = {g.index: g for g in s.scalars(select(Gpu))}
        assert sorted(gpus) == [0, 1, 3]
        assert gpus[3].status == GpuStatus.LOST and gpus[3].allocation is not None
        assert s.scalar(select(Lease.lease_id)) == second.lease_id


def test_a_node_belongs_to_one_live_agent(registry: Registry) -> None:
    register(registry, "a", "agent-1", nodes=(node("shared"),))
    with pytest.raises(NodeOwnedError) as err:
        register(registry, "a", "agent-2", nodes=(node("other"), node("shared")))
    assert err.value.field == "inventory.nodes[1].name"
    with registry.read() as s:  # nothing of the refused registration was written
        assert s.scalars(select(Agent.agent_id)).all() == ["agent-1"]
    # Once its owner is lost, another agent may take the node over.
    with registry.write() as s:
        lease = s.scalars(select(Lease)).one()
        mark_lost(s, lease.agent_pk, lease.lease_id, utcnow(), "test")
    register(registry, "a", "agent-2", nodes=(node("shared"),))


# ---------------------------------------------------------------------------- leases


def test_lease_expiry_is_checked_on_read(registry: Registry) -> None:
    register(registry, "a")
    with registry.write() as s:
        s.execute(update(Lease).values(expires_at=utcnow() - timedelta(seconds=1)))
    with registry.read() as s:
        agent = s.scalars(select(Agent)).one()
        assert agent.status == AgentStatus.ALIVE  # the reaper has not run...
        assert not agent.alive_at(utcnow())  # ...but nobody may call it alive
    with pytest.raises(EmptyRegistry), registry.read() as s:
        build_topology(s)


def test_mark_lost_marks_gpus_and_ignores_a_replaced_lease(registry: Registry) -> None:
    old = register(registry, "a")
    new = register(registry, "a")  # registered again: the old lease is history
    with registry.write() as s:
        assert mark_lost(s, old.agent_pk, old.lease_id, utcnow(), "expired") == 0
    with registry.read() as s:
        assert s.scalars(select(Agent)).one().status == AgentStatus.ALIVE
    with registry.write() as s:
        assert mark_lost(s, new.agent_pk, new.lease_id, utcnow(), "expired") == 4
    with registry.read() as s:
        assert {g.status for g in s.scalars(select(Gpu))} == {GpuStatus.LOST}
        assert s.scalars(select(Agent)).one().lost_at is not None
        assert "agent_lost" in s.scalars(select(Event.kind)).all()
        assert live_leases(s) == []


def test_batched_heartbeats_renew_and_record_usage_and_links(registry: Registry) -> None:
    a = register(registry, "a")
    register(registry, "b")
    now = utcnow()
    record = HeartbeatRecord(
        agent_pk=a.agent_pk,
        lease_pk=a.lease_pk,
        site_id=a.site_id,
        agent_id="a-agent",
        at=now,
        expires_at=now + timedelta(hours=1),
        health="degraded",
        gpus=(GpuUsage(a.gpu_ids[("a-n0", 1)], 0.5, 12.0),),
        links=(LinkSample("b", 9.5, 20.0, now), LinkSample("nowhere", 1.0, 1.0, now)),
    )
    with registry.write() as s:
        apply_heartbeats(s, [record])
    with registry.write() as s:  # a second measurement replaces the first
        apply_heartbeats(
            s,
            [record.__class__(**{**record.__dict__, "links": (LinkSample("b", 8.0, 22.0, now),)})],
        )
    with registry.read() as s:
        lease = s.get(Lease, a.lease_pk)
        assert lease is not None and lease.expires_at > now + timedelta(minutes=59)
        assert s.get(Agent, a.agent_pk).health == "degraded"  # type: ignore[union-attr]
        gpu = s.get(Gpu, a.gpu_ids[("a-n0", 1)])
        assert gpu is not None and gpu.utilisation == 0.5 and gpu.memory_used_gb == 12.0
        site = s.scalars(select(Site).where(Site.name == "a")).one()
        assert [(m.peer_site.name, m.bandwidth_gbps, m.rtt_ms) for m in site.links] == [
            ("b", 8.0, 22.0)
        ]


# ---------------------------------------------------------------------------- allocation


def test_allocation_is_all_or_nothing(registry: Registry) -> None:
    register(registry, "a", nodes=(node("n0", gpus=4),))
    with registry.write() as s:
        create_job(s, "j1", "j1")
        create_job(s, "j2", "j2")
        allocate_gpus(s, "j1", {"a": {"n0": [0, 1]}})
    with pytest.raises(AllocationConflict, match="held by job j1"), registry.write() as s:
        allocate_gpus(s, "j2", {"a": {"n0": [2, 1]}})
    with pytest.raises(AllocationConflict, match="no GPU"), registry.write() as s:
        allocate_gpus(s, "j2", {"a": {"n0": [7]}})
    with pytest.raises(NoCapacity, match="asked for 3 GPUs, 2 free"), registry.write() as s:
        allocate_free(s, "j2", 3)
    with registry.read() as s:  # none of the failed attempts left anything behind
        held = {g.index: g.allocation.job_id for g in s.scalars(select(Gpu)) if g.allocation}
        assert held == {0: "j1", 1: "j1"}
    with registry.write() as s:
        assert allocate_free(s, "j2", 2) == [("a", "n0", 2), ("a", "n0", 3)]
        assert release(s, "j1") == 2
    with registry.write() as s:
        assert allocate_free(s, "j1", 2) == [("a", "n0", 0), ("a", "n0", 1)]


def test_lost_gpus_are_not_allocated(registry: Registry) -> None:
    done = register(registry, "a")
    with registry.write() as s:
        create_job(s, "j", "j")
        mark_lost(s, done.agent_pk, done.lease_id, utcnow(), "test")
    with pytest.raises(NoCapacity), registry.write() as s:
        allocate_free(s, "j", 1)
    with pytest.raises(AllocationConflict, match="lost"), registry.write() as s:
        allocate_gpus(s, "j", {"a": {"a-n0": [0]}})


# ---------------------------------------------------------------------------- topology


def _job(gpus: int) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "tiny",
            "model": {"layers": 4, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 1000},
            "train": {"global_batch": 8, "micro_batch": 1, "dtype": "bf16", "steps": 10},
            "parallel": {"dp": gpus // 2, "tp": 2, "pp": 1},
        }
    )


def test_topology_from_the_registry_feeds_the_scheduler(registry: Registry) -> None:
    ib = (NicInfo("mlx5_0", 1, "infiniband", 200.0, "active"),)
    register(
        registry,
        "a",
        nodes=(node("a0", nics=ib), node("a1", nics=ib)),
        settings=SiteSettings(gpu_price_per_hour=2.5),
    )
    b = register(registry, "b", nodes=(node("b0", gpus=8, model="H100"),))
    lost = register(registry, "c")
    now = utcnow()
    with registry.write() as s:
        mark_lost(s, lost.agent_pk, lost.lease_id, now, "test")
        apply_heartbeats(s, [HeartbeatRecord(
            agent_pk=b.agent_pk, lease_pk=b.lease_pk, site_id=b.site_id, agent_id="b-agent",
            at=now, expires_at=now + timedelta(hours=1), health="ok",
            links=(LinkSample("a", 10.0, 30.0, now),),
        )])  # fmt: skip
        create_job(s, "held", "held")
        allocate_gpus(s, "held", {"a": {"a0": [0, 1]}})
        reserve_link(s, "held", "b", "a", 4.0)
        reserve_link(s, "held", "a", "c", 1.0)  # no such link in the topology: left out
    with registry.read() as s:
        topology, held = build_topology(s)
    assert topology.site_names == ["a", "b"]  # c's agent is lost
    site_a = topology.site("a")
    assert site_a.gpu_price_per_hour == 2.5
    assert site_a.intra_site_gbps == 200.0  # from the active InfiniBand ports
    assert topology.site("b").intra_site_gbps == 100.0  # the default: no RDMA reported
    assert [(n.name, n.gpu.count, n.gpu.tflops) for n in topology.site("b").nodes] == [
        ("b0", 8, 989.0)
    ]
    [link] = topology.links
    assert (link.a, link.b, link.bandwidth_gbps, link.latency_ms) == ("a", "b", 10.0, 15.0)
    assert held.gpus == {"a": {"a0": [0, 1]}}
    assert held.wan_gbps == {"a|b": 4.0}
    result = plan_job(topology, _job(gpus=8), held)
    used = {(sh.site, sh.node, g) for sh in result.shards for g in sh.gpus}
    assert not used & {("a", "a0", 0), ("a", "a0", 1)}


def test_topology_summarises_each_node_conservatively(registry: Registry) -> None:
    mixed = NodeInfo(
        "m0",
        gpus=(
            GpuInfo(0, "H100", 80.0, tflops=900.0),
            GpuInfo(1, "H100", 40.0, tflops=989.0),
            GpuInfo(2, "H100", 80.0, tflops=700.0),
        ),
        nics=(
            NicInfo("mlx5_0", 1, "infiniband", 200.0, "active"),
            NicInfo("mlx5_0", 2, "infiniband", 200.0, "active"),
            NicInfo("mlx5_1", 1, "infiniband", 400.0, "down"),
        ),
        intra_node_gbps=900.0,
    )
    quiet = node("q0", gpus=2)  # no RDMA: the site falls back to the default
    a = register(registry, "a", nodes=(mixed, quiet))
    b = register(registry, "b", nodes=(node("b0", gpus=1),))
    register(registry, "c", nodes=(NodeInfo("empty"),))  # no GPUs: not in the topology
    now = utcnow()
    with registry.write() as s:
        apply_heartbeats(s, [
            HeartbeatRecord(
                agent_pk=a.agent_pk, lease_pk=a.lease_pk, site_id=a.site_id, agent_id="a-agent",
                at=now, expires_at=now + timedelta(hours=1), health="ok",
                links=(LinkSample("b", 10.0, 30.0, now), LinkSample("c", 5.0, 5.0, now)),
            ),
            HeartbeatRecord(
                agent_pk=b.agent_pk, lease_pk=b.lease_pk, site_id=b.site_id, agent_id="b-agent",
                at=now, expires_at=now + timedelta(hours=1), health="ok",
                links=(LinkSample("a", 8.0, 20.0, now - timedelta(hours=2)),),
            ),
        ])  # fmt: skip
        s.execute(update(Gpu).where(Gpu.index == 2).values(status=GpuStatus.LOST))
    with registry.read() as s:
        topology, held = build_topology(s, now=now)
        fresh, _ = build_topology(s, now=now, max_link_age=timedelta(hours=1))
    assert topology.site_names == ["a", "b"]
    [m0, q0] = topology.site("a").nodes
    assert (m0.name, m0.gpu.model, m0.gpu.count, m0.gpu.memory_gb, m0.gpu.tflops) == (
        "m0",
        "H100",
        3,
        40.0,
        700.0,
    )
    assert (m0.intra_node_gbps, q0.intra_node_gbps) == (900.0, 256.0)
    assert topology.site("a").intra_site_gbps == 100.0  # q0 has no active RDMA
    assert held.gpus == {"a": {"m0": [2]}}  # lost while the node lives
    [link] = topology.links  # both directions measured: the smaller bandwidth, larger RTT
    assert (link.key, link.bandwidth_gbps, link.latency_ms) == ("a|b", 8.0, 15.0)
    [link] = fresh.links  # b's measurement is too old
    assert (link.bandwidth_gbps, link.latency_ms) == (10.0, 15.0)


@pytest.mark.postgres
def test_a_pooled_connection_that_died_while_idle_is_replaced(
    postgres: PostgresDatabases, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pooled PostgreSQL connections are pinged only after PING_IDLE_S unused: one whose
    backend was ended meanwhile (a server restart) is replaced, not handed out dead."""
    registry = Registry(postgres.create())
    try:
        with registry.engine.connect() as conn:
            pid = conn.scalar(text("SELECT pg_backend_pid()"))
        with psycopg.connect(postgres.admin_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        monkeypatch.setattr(db, "PING_IDLE_S", 0.0)  # it has been idle long enough
        with registry.engine.connect() as conn:
            assert conn.scalar(text("SELECT pg_backend_pid()")) != pid
    finally:
        registry.dispose()
