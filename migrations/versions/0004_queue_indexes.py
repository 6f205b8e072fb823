"""Indexes for the orchestration loop's queue: its head (state, priority, created_at, id)
and the reasons of queued jobs (partial: state = 'pending').

Without them every tick read and sorted the whole queue, twice: the loop ticks up to 50
times a second while jobs are submitted, and with thousands queued that cost more CPU
than the submissions themselves.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None

PENDING_ONLY = "state = 'pending'"


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(
            "ix_jobs_queue", ["state", "priority", "created_at", "id"], unique=False
        )
        batch_op.create_index(
            "ix_jobs_pending_reason",
            ["state", "state_reason"],
            unique=False,
            sqlite_where=sa.text(PENDING_ONLY),
            postgresql_where=sa.text(PENDING_ONLY),
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_pending_reason")
        batch_op.drop_index("ix_jobs_queue")
