"""The WAN sync that ran each step (`job_steps.wan_sync`): GET /v1/jobs/{id}/metrics shows
what `wan: auto` ran, step by step, and where it moved.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_steps", schema=None) as batch_op:
        batch_op.add_column(sa.Column("wan_sync", sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_steps", schema=None) as batch_op:
        batch_op.drop_column("wan_sync")
