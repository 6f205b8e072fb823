"""Which control plane runs the orchestration loop when several share one PostgreSQL.

The one holding a session-level PostgreSQL advisory lock (`pg_try_advisory_lock`) on a
connection of its own: PostgreSQL grants it to one session at a time and releases it when
that session ends — also when its process is killed, since the server ends a backend whose
client connection closed. The others try again on every tick and take over within one.
The database is the arbiter: no election protocol of our own. A leader whose connection
fails stops leading at once (its lock may already be someone else's).

On SQLite there is one control plane per database file: it always leads.

Every write the loop makes is also safe if two loops overlapped for a moment (a leader
that lost its connection mid-tick): GPUs are UNIQUE per allocation, orders UNIQUE per job
epoch and agent, and each job is changed under its row lock.
"""

from __future__ import annotations

import contextlib
import logging

from sqlalchemy import Connection, text
from sqlalchemy.exc import SQLAlchemyError

from cpn.registry import Registry

log = logging.getLogger("cpn.orchestration")

#: The advisory lock's class ("cpn" as a 32-bit integer); its object is a hash of the
#: schema the registry lives in, so that registries in other schemas of one database
#: (tests, several deployments) have leaders of their own.
LOCK_KEY = int.from_bytes(b"cpn\0", "big")
_TRY = text("SELECT pg_try_advisory_lock(:k, hashtext(current_schema()))")
_UNLOCK = text("SELECT pg_advisory_unlock(:k, hashtext(current_schema()))")
_ALIVE = text("SELECT 1")


class Leadership:
    def __init__(self, registry: Registry, key: int = LOCK_KEY) -> None:
        self.registry = registry
        self.key = key
        self._conn: Connection | None = None

    @property
    def exclusive(self) -> bool:
        """Whether leading needs the lock (PostgreSQL), or this process always leads."""
        return self.registry.dialect == "postgresql"

    def lead(self) -> bool:
        """Whether this process leads now: keeps the lock it holds (checking that its
        connection still lives), or tries to take it."""
        if not self.exclusive:
            return True
        if self._conn is not None:
            try:
                self._conn.execute(_ALIVE)
                return True
            except SQLAlchemyError as exc:
                log.warning("orchestration: lost the leader's connection (%s); not leading", exc)
                self._drop()
        try:
            conn = self.registry.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        except SQLAlchemyError as exc:
            log.warning("orchestration: cannot reach the database to lead (%s)", exc)
            return False
        try:
            got = bool(conn.scalar(_TRY, {"k": self.key}))
        except SQLAlchemyError:
            conn.close()
            return False
        if not got:
            conn.close()
            return False
        self._conn = conn
        log.info("orchestration: leading (advisory lock %d taken)", self.key)
        return True

    def release(self) -> None:
        """Give the lock up (on a clean stop): another control plane takes over at once."""
        if self._conn is not None:
            with contextlib.suppress(SQLAlchemyError):
                self._conn.execute(_UNLOCK, {"k": self.key})
            self._drop()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(SQLAlchemyError):
                conn.invalidate()  # never back to the pool: the session may hold the lock
                conn.close()


__all__ = ["LOCK_KEY", "Leadership"]
