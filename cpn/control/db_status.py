"""Which gRPC status a database error becomes.

UNAVAILABLE tells a well-behaved client to retry the same request later, so it is kept
for what later can cure: the database unreachable, restarting, out of resources, or busy
(a lock timeout). An error the request itself caused — a value the database cannot hold —
would fail the same way forever: INVALID_ARGUMENT (the validation layer should have caught
it; this is the net under it). A write that lost a race with another writer (a unique or
serialisation conflict) is ABORTED: retry at a higher level. Anything else is a bug or a
misconfiguration (a missing table): INTERNAL.

The decision uses the driver's own error codes where there are some — PostgreSQL's
SQLSTATE classes, SQLite's extended result-code names — and SQLAlchemy's exception classes
otherwise.
"""

from __future__ import annotations

import grpc
from sqlalchemy.exc import (
    DataError,
    DBAPIError,
    DisconnectionError,
    IntegrityError,
    OperationalError,
    SQLAlchemyError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

UNAVAILABLE_DETAILS = "registry database unavailable; retry"
INVALID_DETAILS = "request: holds a value the registry database cannot store"
ABORTED_DETAILS = "registry write conflicted with another writer; retry"
INTERNAL_DETAILS = "registry database error (logged by the control plane)"

# PostgreSQL SQLSTATE classes (Appendix A of its manual).
_PG_UNAVAILABLE = {"08", "53", "57", "58", "55"}  # connection, resources, shutdown, lock
_PG_INVALID = {"22", "54"}  # data exception, program limit exceeded
_PG_CONFLICT = {"23", "40"}  # integrity constraint, transaction rollback (serialisation)
# SQLite primary result codes (the part of the extended name before any '_' suffix).
_SQLITE_UNAVAILABLE = {
    "SQLITE_BUSY",
    "SQLITE_LOCKED",
    "SQLITE_IOERR",
    "SQLITE_CANTOPEN",
    "SQLITE_FULL",
    "SQLITE_NOMEM",
    "SQLITE_READONLY",
    "SQLITE_PROTOCOL",
}
_SQLITE_INVALID = {"SQLITE_TOOBIG", "SQLITE_MISMATCH", "SQLITE_RANGE"}
_SQLITE_CONFLICT = {"SQLITE_CONSTRAINT"}


def _sqlite_primary(name: str) -> str:
    # SQLITE_IOERR_SHORT_READ → SQLITE_IOERR; SQLITE_CONSTRAINT_UNIQUE → SQLITE_CONSTRAINT
    parts = name.split("_")
    return "_".join(parts[:2])


def database_status(exc: SQLAlchemyError) -> tuple[grpc.StatusCode, str]:
    """The status and details for a database error met while serving a request."""
    if isinstance(exc, DisconnectionError | PoolTimeoutError):
        return grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_DETAILS
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_DETAILS
        orig = exc.orig
        sqlstate = getattr(orig, "sqlstate", None)
        if isinstance(sqlstate, str) and len(sqlstate) == 5:
            cls = sqlstate[:2]
            if cls in _PG_UNAVAILABLE:
                return grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_DETAILS
            if cls in _PG_INVALID:
                return grpc.StatusCode.INVALID_ARGUMENT, INVALID_DETAILS
            if cls in _PG_CONFLICT:
                return grpc.StatusCode.ABORTED, ABORTED_DETAILS
            return grpc.StatusCode.INTERNAL, INTERNAL_DETAILS
        name = getattr(orig, "sqlite_errorname", None)
        if isinstance(name, str):
            primary = _sqlite_primary(name)
            if primary in _SQLITE_UNAVAILABLE:
                return grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_DETAILS
            if primary in _SQLITE_INVALID:
                return grpc.StatusCode.INVALID_ARGUMENT, INVALID_DETAILS
            if primary in _SQLITE_CONFLICT:
                return grpc.StatusCode.ABORTED, ABORTED_DETAILS
            return grpc.StatusCode.INTERNAL, INTERNAL_DETAILS
    # No driver code (a psycopg error raised before the server answered, say).
    if isinstance(exc, DataError):
        return grpc.StatusCode.INVALID_ARGUMENT, INVALID_DETAILS
    if isinstance(exc, IntegrityError):
        return grpc.StatusCode.ABORTED, ABORTED_DETAILS
    if isinstance(exc, OperationalError):
        return grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_DETAILS
    return grpc.StatusCode.INTERNAL, INTERNAL_DETAILS


__all__ = ["database_status"]
