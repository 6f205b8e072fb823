"""Databases for registry tests: a fresh SQLite file or a fresh PostgreSQL database per test.

PostgreSQL is the local server on 127.0.0.1:5432 (or `$CPN_TEST_POSTGRES_URL`, an admin
URL). Each test session creates its own `cpn_test_<random>_<n>` databases and drops them at
the end, so parallel sessions and CI runs never collide. When the server is unreachable
the fixture FAILS the tests that need it — it never skips them: a registry that was not
tested on PostgreSQL must not look green.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field

import psycopg
import pytest

from cpn.registry import Registry, upgrade

ADMIN_URL = os.environ.get("CPN_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@dataclass
class PostgresDatabases:
    """One database per test session; one schema per test inside it (schemas are made
    and dropped in milliseconds, databases in seconds)."""

    admin_url: str
    name: str = field(default_factory=lambda: f"cpn_test_{secrets.token_hex(4)}")
    _n: itertools.count[int] = field(default_factory=itertools.count)

    def _admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5)

    @property
    def url(self) -> str:
        base = self.admin_url.rsplit("/", 1)[0]
        return f"{base}/{self.name}".replace("postgresql://", "postgresql+psycopg://", 1)

    def create_database(self) -> None:
        with self._admin() as conn:
            conn.execute(f'CREATE DATABASE "{self.name}"')

    def create(self) -> str:
        """A new empty schema; returns a URL whose connections use it (search_path)."""
        schema = f"t{next(self._n)}"
        with psycopg.connect(self.url.replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
        return f"{self.url}?options=-csearch_path%3D{schema}"

    def drop_database(self) -> None:
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresDatabases]:
    try:
        with psycopg.connect(ADMIN_URL, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        pytest.fail(
            f"PostgreSQL at {ADMIN_URL} is unreachable ({str(exc).strip().splitlines()[0]}); "
            "the registry tests need it (scripts/setup.sh starts the local server)",
            pytrace=False,
        )
    dbs = PostgresDatabases(ADMIN_URL)
    dbs.create_database()
    try:
        yield dbs
    finally:
        dbs.drop_database()


BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> str:
    """An empty database (no tables) on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/registry.db"
    dbs: PostgresDatabases = request.getfixturevalue("postgres")
    return dbs.create()


@pytest.fixture
def registry(db_url: str) -> Iterator[Registry]:
    """A migrated registry on each backend."""
    upgrade(db_url)
    reg = Registry(db_url)
    try:
        yield reg
    finally:
        reg.dispose()
