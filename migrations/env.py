"""Alembic environment for the registry. Run through `cpn db upgrade` (or `cpn serve`),
which passes the database URL in the config; there is no alembic.ini to edit."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from cpn.registry.db import make_engine
from cpn.registry.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things: batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(config.get_main_option("sqlalchemy.url") or "")
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported: run cpn db upgrade")
run_migrations_online()
