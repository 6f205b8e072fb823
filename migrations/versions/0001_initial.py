"""The registry: sites, agents, inventory, leases, WAN links, jobs, allocations, events.

Every timestamp is stored in UTC (naive on SQLite, see cpn.registry.models.UtcDateTime).

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("site", sa.String(length=64), nullable=True),
        sa.Column("agent_id", sa.String(length=128), nullable=True),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_events_at"), ["at"], unique=False)
        batch_op.create_index(batch_op.f("ix_events_job_id"), ["job_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_events_kind"), ["kind"], unique=False)

    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column(
            "state",
            sa.Enum(
                "pending",
                "scheduled",
                "running",
                "succeeded",
                "failed",
                "cancelled",
                "rescheduling",
                name="jobstate",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_table(
        "sites",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("gpu_price_per_hour", sa.Float(), nullable=False),
        sa.Column("intra_site_gbps", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sites")),
        sa.UniqueConstraint("name", name=op.f("uq_sites_name")),
    )
    op.create_table(
        "tasks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("site", sa.String(length=64), nullable=False),
        sa.Column("agent_id", sa.String(length=128), nullable=False),
        sa.Column(
            "state",
            sa.Enum(
                "starting",
                "running",
                "succeeded",
                "failed",
                "stopped",
                name="taskstate",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("bytes_intra_node", sa.BigInteger(), nullable=False),
        sa.Column("bytes_intra_site", sa.BigInteger(), nullable=False),
        sa.Column("bytes_wan", sa.BigInteger(), nullable=False),
        sa.Column("checkpoint_id", sa.String(length=256), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tasks")),
        sa.UniqueConstraint("job_id", "rank", name=op.f("uq_tasks_job_id_rank")),
    )
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_tasks_job_id"), ["job_id"], unique=False)

    op.create_table(
        "agents",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("site_id", sa.Integer(), nullable=False),
        sa.Column("agent_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("probe_address", sa.String(length=256), nullable=False),
        sa.Column("health", sa.String(length=16), nullable=False),
        sa.Column(
            "status",
            sa.Enum("alive", "lost", name="agentstatus", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column("registrations", sa.Integer(), nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lost_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["site_id"], ["sites.id"], name=op.f("fk_agents_site_id_sites"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_agents")),
        sa.UniqueConstraint("site_id", "agent_id", name=op.f("uq_agents_site_id_agent_id")),
    )
    op.create_table(
        "link_reservations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("link_key", sa.String(length=140), nullable=False),
        sa.Column("gbps", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_link_reservations_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_link_reservations")),
        sa.UniqueConstraint(
            "job_id", "link_key", name=op.f("uq_link_reservations_job_id_link_key")
        ),
    )
    op.create_table(
        "wan_links",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("site_id", sa.Integer(), nullable=False),
        sa.Column("peer_site_id", sa.Integer(), nullable=False),
        sa.Column("bandwidth_gbps", sa.Float(), nullable=False),
        sa.Column("rtt_ms", sa.Float(), nullable=False),
        sa.Column("measured_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reported_by", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(
            ["peer_site_id"],
            ["sites.id"],
            name=op.f("fk_wan_links_peer_site_id_sites"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["site_id"], ["sites.id"], name=op.f("fk_wan_links_site_id_sites"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_wan_links")),
        sa.UniqueConstraint(
            "site_id", "peer_site_id", name=op.f("uq_wan_links_site_id_peer_site_id")
        ),
    )
    op.create_table(
        "leases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("lease_id", sa.String(length=36), nullable=False),
        sa.Column("agent_pk", sa.Integer(), nullable=False),
        sa.Column("ttl_ms", sa.Integer(), nullable=False),
        sa.Column("granted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["agent_pk"], ["agents.id"], name=op.f("fk_leases_agent_pk_agents"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_leases")),
        sa.UniqueConstraint("agent_pk", name=op.f("uq_leases_agent_pk")),
        sa.UniqueConstraint("lease_id", name=op.f("uq_leases_lease_id")),
    )
    op.create_table(
        "nodes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("site_id", sa.Integer(), nullable=False),
        sa.Column("agent_pk", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("intra_node_gbps", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["agent_pk"], ["agents.id"], name=op.f("fk_nodes_agent_pk_agents"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["site_id"], ["sites.id"], name=op.f("fk_nodes_site_id_sites"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_nodes")),
        sa.UniqueConstraint("site_id", "name", name=op.f("uq_nodes_site_id_name")),
    )
    op.create_table(
        "gpus",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("memory_gb", sa.Float(), nullable=False),
        sa.Column("tflops", sa.Float(), nullable=False),
        sa.Column("uuid", sa.String(length=64), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column(
            "status",
            sa.Enum("available", "lost", name="gpustatus", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column("utilisation", sa.Float(), nullable=True),
        sa.Column("memory_used_gb", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_gpus_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpus")),
        sa.UniqueConstraint("node_id", "index", name=op.f("uq_gpus_node_id_index")),
    )
    op.create_table(
        "rdma_nics",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("transport", sa.String(length=16), nullable=False),
        sa.Column("roce_version", sa.Integer(), nullable=False),
        sa.Column("rate_gbps", sa.Float(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_rdma_nics_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rdma_nics")),
        sa.UniqueConstraint(
            "node_id", "device", "port", name=op.f("uq_rdma_nics_node_id_device_port")
        ),
    )
    op.create_table(
        "allocations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("gpu_id", sa.Integer(), nullable=False),
        sa.Column("allocated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["gpu_id"], ["gpus.id"], name=op.f("fk_allocations_gpu_id_gpus"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_allocations_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_allocations")),
        sa.UniqueConstraint("gpu_id", name=op.f("uq_allocations_gpu_id")),
    )
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_allocations_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_allocations_job_id"))

    op.drop_table("allocations")
    op.drop_table("rdma_nics")
    op.drop_table("gpus")
    op.drop_table("nodes")
    op.drop_table("leases")
    op.drop_table("wan_links")
    op.drop_table("link_reservations")
    op.drop_table("agents")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tasks_job_id"))

    op.drop_table("tasks")
    op.drop_table("sites")
    op.drop_table("jobs")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_events_kind"))
        batch_op.drop_index(batch_op.f("ix_events_job_id"))
        batch_op.drop_index(batch_op.f("ix_events_at"))

    op.drop_table("events")
