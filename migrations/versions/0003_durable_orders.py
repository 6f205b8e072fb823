"""Failure recovery: orders to agents in the database, launch epochs, the checkpoint a job
resumes from, restart counters and backoff.

Orders used to live in the control plane's memory and died with it; a row per order
(written in the transaction that decides it) survives a restart, and UNIQUE (job, epoch,
site, agent, kind) makes a second launch of one job epoch on one agent impossible.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "orders",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("order_id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("site", sa.String(length=64), nullable=False),
        sa.Column("agent_id", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column(
            "state",
            sa.Enum(
                "queued", "delivered", "dropped", name="orderstate", native_enum=False, length=16
            ),
            nullable=False,
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_orders")),
        sa.UniqueConstraint("order_id", name=op.f("uq_orders_order_id")),
        sa.UniqueConstraint(
            "job_id",
            "epoch",
            "site",
            "agent_id",
            "kind",
            name=op.f("uq_orders_job_id_epoch_site_agent_id_kind"),
        ),
    )
    with op.batch_alter_table("orders", schema=None) as batch_op:
        batch_op.create_index(
            "ix_orders_agent_state", ["site", "agent_id", "state", "id"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_orders_job_id"), ["job_id"], unique=False)

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("epoch", sa.BigInteger(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("checkpoint", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("restarts", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("losses", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("not_before", sa.DateTime(timezone=True), nullable=True))

    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("epoch", sa.BigInteger(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("progressed_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("progressed_at")
        batch_op.drop_column("epoch")

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("not_before")
        batch_op.drop_column("losses")
        batch_op.drop_column("restarts")
        batch_op.drop_column("checkpoint")
        batch_op.drop_column("epoch")

    with op.batch_alter_table("orders", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_orders_job_id"))
        batch_op.drop_index("ix_orders_agent_state")

    op.drop_table("orders")
