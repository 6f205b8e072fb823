"""One orchestration loop at a time on one PostgreSQL: the advisory lock, with real
connections. SQLite (one control plane per file) always leads."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from cpn.orchestration.leader import Leadership
from cpn.registry import Registry
from tests.databases import PostgresDatabases


@pytest.mark.postgres
def test_one_leader_at_a_time_and_the_other_takes_over(postgres: PostgresDatabases) -> None:
    url = postgres.create()
    first, second = Registry(url), Registry(url)
    # The lock is per schema: this test's own (each test gets a schema of its own).
    one, two = Leadership(first), Leadership(second)
    try:
        assert one.lead() and one.lead()  # taken, then kept
        assert not two.lead()
        elsewhere = Registry(postgres.create())  # another schema: a leader of its own
        try:
            assert Leadership(elsewhere).lead()
        finally:
            elsewhere.dispose()
        # The leader dies: its session ends and PostgreSQL releases the lock at once
        # (once the backend has exited: pg_terminate_backend waits for that, up to 30 s).
        assert one._conn is not None
        pid = one._conn.scalar(text("SELECT pg_backend_pid()"))
        with second.engine.connect() as admin:
            gone = admin.scalar(text("SELECT pg_terminate_backend(:p, 30000)"), {"p": pid})
            assert gone
        assert two.lead()
        assert not one.lead()  # its connection is gone: it notices and does not lead
        two.release()  # a clean stop hands over at once
        assert one.lead()
    finally:
        one.release()
        two.release()
        first.dispose()
        second.dispose()


def test_sqlite_always_leads(tmp_path: Path) -> None:
    registry = Registry(f"sqlite:///{tmp_path}/x.db")
    try:
        assert Leadership(registry).lead() and Leadership(registry).lead()
    finally:
        registry.dispose()
