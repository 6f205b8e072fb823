"""Connecting to the registry's database: SQLite by default, PostgreSQL in production.

`Registry` owns the engine and hands out sessions. Writes go through `Registry.write()`,
one transaction each. On SQLite a write transaction starts with `BEGIN IMMEDIATE`: it
takes the database's write lock up front, so two writers queue (up to the busy timeout)
instead of both reading, both deciding, and one failing at commit.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

from cpn.errors import InputError

#: The embedded default: a SQLite file in the current directory.
DEFAULT_DATABASE_URL = "sqlite:///cpn.db"
ENV_VAR = "CPN_DATABASE_URL"

#: How long a SQLite writer waits for the lock before giving up.
SQLITE_BUSY_TIMEOUT_S = 30.0
#: Connections kept open per process. The API answers from a pool of threads (and the
#: control server and the orchestration loop have their own): with SQLAlchemy's default
#: of 5 (+10 overflow), connections beyond the fifth were closed on return and opened
#: again on the next request — a new PostgreSQL backend, or SQLite's PRAGMAs, per request.
POOL_SIZE = 16
POOL_OVERFLOW = 8
#: A pooled PostgreSQL connection that sat unused this long is pinged before it is handed
#: out (and replaced if dead). Pinging every checkout (`pool_pre_ping`) cost a round trip
#: per transaction — under load, one for every submission and several per orchestration
#: tick — for connections used a moment before. What it still catches: a server restart
#: or a connection dropped while idle. A connection that dies within this window fails
#: its next statement instead, and SQLAlchemy then replaces every connection that was
#: opened before the failure.
PING_IDLE_S = 1.0


def database_url(explicit: str | None = None) -> str:
    """The URL to use: the explicit one, else $CPN_DATABASE_URL, else the SQLite default."""
    return explicit or os.environ.get(ENV_VAR) or DEFAULT_DATABASE_URL


def normalize_url(url: str) -> str:
    """Accept the URLs operators write (`postgresql://`, `postgres://`) and pick psycopg 3."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise InputError(f"--database-url: cannot parse {url!r}") from None
    backend = parsed.get_backend_name()
    if backend in {"postgres", "postgresql"}:
        if parsed.drivername in {"postgres", "postgresql"}:
            parsed = parsed.set(drivername="postgresql+psycopg")
    elif backend != "sqlite":
        raise InputError(f"--database-url: {backend!r} is not supported (use sqlite or postgresql)")
    return parsed.render_as_string(hide_password=False)


def _sqlite_setup(engine: Engine) -> None:
    # pysqlite's own transaction handling defers BEGIN and cannot do BEGIN IMMEDIATE; turn
    # it off and emit BEGIN ourselves (the SQLAlchemy documentation's recipe).
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        if engine.url.database not in (None, "", ":memory:"):
            cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
            cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        immediate = conn.get_execution_options().get("cpn_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _ping_when_idle(engine: Engine) -> None:
    # The pessimistic disconnect handling of SQLAlchemy's documentation, for connections
    # that were idle: raising DisconnectionError makes the pool open another one.
    @event.listens_for(engine, "checkin")
    def _checkin(_dbapi_conn: Any, record: Any) -> None:
        record.info["cpn_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("cpn_idle_since")
        if since is None or time.monotonic() - since < PING_IDLE_S:
            return  # new, or used a moment ago
        try:
            engine.dialect.do_ping(dbapi_conn)
        except engine.dialect.loaded_dbapi.Error as exc:
            raise DisconnectionError(f"a pooled connection is gone: {exc}") from exc


def make_engine(url: str, **kwargs: Any) -> Engine:
    url = normalize_url(url)
    if url.startswith("sqlite"):
        if make_url(url).database not in (None, "", ":memory:"):
            kwargs = {"pool_size": POOL_SIZE, "max_overflow": POOL_OVERFLOW, **kwargs}
        engine = create_engine(
            url,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False},
            **kwargs,
        )
        _sqlite_setup(engine)
        return engine
    kwargs = {"pool_size": POOL_SIZE, "max_overflow": POOL_OVERFLOW, **kwargs}
    engine = create_engine(url, **kwargs)
    _ping_when_idle(engine)
    return engine


class Registry:
    """The registry's database: an engine and two kinds of session."""

    def __init__(self, url: str) -> None:
        self.url = normalize_url(url)
        self.engine = make_engine(self.url)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(
            self.engine.execution_options(cpn_write=True), expire_on_commit=False
        )
        # SQLite has one writer at a time. A second `BEGIN IMMEDIATE` does not queue: it
        # fails with SQLITE_BUSY and the busy handler retries after sleeping 1, 2, 5, 10,
        # … 100 ms, so under load a writer could sleep long after the lock was free (the
        # API's p99 was hundreds of ms). Writers of this process queue on a mutex instead
        # and take the database lock when it is theirs; other processes (the CLI) still
        # meet the busy timeout. Re-entrant, so a nested write fails as it did before
        # (busy timeout) instead of deadlocking here.
        self._writer: contextlib.AbstractContextManager[object] = (
            threading.RLock() if self.engine.dialect.name == "sqlite" else contextlib.nullcontext()
        )

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._read() as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        with self._writer, self._write() as session, session.begin():
            yield session

    @contextmanager
    def statements(self) -> Iterator[Connection]:
        """A connection on which each statement is a transaction of its own: on PostgreSQL
        in autocommit, which saves the BEGIN and the ROLLBACK or COMMIT round trips around
        a single statement (a lookup, or one INSERT or UPDATE that must be atomic alone).
        Several reads on it see what was committed when each ran, as in a READ COMMITTED
        transaction. On SQLite, a plain connection (for reads)."""
        with self.engine.connect() as plain:
            autocommit = self.dialect == "postgresql"
            yield plain.execution_options(isolation_level="AUTOCOMMIT") if autocommit else plain

    def dispose(self) -> None:
        self.engine.dispose()
