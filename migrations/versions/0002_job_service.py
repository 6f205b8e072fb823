"""The job service: tenants and API keys, quotes, job lifecycle columns, rendezvous ports,
forwarded worker log lines and per-step metrics.

Columns added to existing tables get a server default so that rows already there (jobs
made before this revision) stay valid.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("gpu_quota", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column(
            "role",
            sa.Enum("user", "admin", name="role", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_api_keys_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
        sa.UniqueConstraint("prefix", name=op.f("uq_api_keys_prefix")),
    )
    op.create_table(
        "quotes",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("candidates", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_quotes_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_quotes")),
    )
    with op.batch_alter_table("quotes", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_quotes_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "job_log_lines",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("line", sa.Text(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_job_log_lines_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_log_lines")),
    )
    with op.batch_alter_table("job_log_lines", schema=None) as batch_op:
        batch_op.create_index("ix_job_log_lines_job_rank", ["job_id", "rank", "id"], unique=False)

    op.create_table(
        "job_steps",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("ranks", sa.Integer(), nullable=False),
        sa.Column("loss_sum", sa.Float(), nullable=False),
        sa.Column("loss_count", sa.Integer(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("bytes_intra_node", sa.BigInteger(), nullable=False),
        sa.Column("bytes_intra_site", sa.BigInteger(), nullable=False),
        sa.Column("bytes_wan", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_job_steps_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_steps")),
        sa.UniqueConstraint("job_id", "step", name=op.f("uq_job_steps_job_id_step")),
    )
    op.create_table(
        "rendezvous_ports",
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("host", sa.String(length=256), nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_rendezvous_ports_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_rendezvous_ports")),
        sa.UniqueConstraint("host", "port", name=op.f("uq_rendezvous_ports_host_port")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("state_reason", sa.Text(), nullable=False, server_default=""))
        batch_op.add_column(sa.Column("tenant_id", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("priority", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("gpus", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("idempotency_key", sa.String(length=128), nullable=True))
        batch_op.add_column(
            sa.Column("request_hash", sa.String(length=64), nullable=False, server_default="")
        )
        batch_op.add_column(sa.Column("quote_id", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("quote_candidate", sa.Integer(), nullable=True))
        batch_op.add_column(
            sa.Column("rendezvous_host", sa.String(length=256), nullable=False, server_default="")
        )
        batch_op.add_column(sa.Column("rendezvous_port", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("failure", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("scheduled_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("started_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index(batch_op.f("ix_jobs_state"), ["state"], unique=False)
        batch_op.create_index(batch_op.f("ix_jobs_tenant_id"), ["tenant_id"], unique=False)
        batch_op.create_unique_constraint(
            batch_op.f("uq_jobs_tenant_id_idempotency_key"), ["tenant_id", "idempotency_key"]
        )
        batch_op.create_foreign_key(
            batch_op.f("fk_jobs_tenant_id_tenants"),
            "tenants",
            ["tenant_id"],
            ["id"],
            ondelete="SET NULL",
        )

    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("metrics_steps", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("metrics_steps")

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_jobs_tenant_id_tenants"), type_="foreignkey")
        batch_op.drop_constraint(batch_op.f("uq_jobs_tenant_id_idempotency_key"), type_="unique")
        batch_op.drop_index(batch_op.f("ix_jobs_tenant_id"))
        batch_op.drop_index(batch_op.f("ix_jobs_state"))
        batch_op.drop_column("finished_at")
        batch_op.drop_column("started_at")
        batch_op.drop_column("scheduled_at")
        batch_op.drop_column("failure")
        batch_op.drop_column("rendezvous_port")
        batch_op.drop_column("rendezvous_host")
        batch_op.drop_column("quote_candidate")
        batch_op.drop_column("quote_id")
        batch_op.drop_column("request_hash")
        batch_op.drop_column("idempotency_key")
        batch_op.drop_column("gpus")
        batch_op.drop_column("priority")
        batch_op.drop_column("tenant_id")
        batch_op.drop_column("state_reason")

    op.drop_table("rendezvous_ports")
    op.drop_table("job_steps")
    with op.batch_alter_table("job_log_lines", schema=None) as batch_op:
        batch_op.drop_index("ix_job_log_lines_job_rank")

    op.drop_table("job_log_lines")
    with op.batch_alter_table("quotes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_quotes_tenant_id"))

    op.drop_table("quotes")
    op.drop_table("api_keys")
    op.drop_table("tenants")
