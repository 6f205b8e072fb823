"""The registry (control layer): what the agents reported, kept in a database.

SQLite by default, PostgreSQL in production; the schema comes only from the Alembic
migrations in `migrations/`. Writes are transactional; GPUs are allocated so that two
schedulers can never hand out the same one (see allocations.py).
"""

from cpn.registry.allocations import (
    AllocationConflict,
    NoCapacity,
    allocate_free,
    allocate_gpus,
    create_job,
    release,
    reserve_link,
)
from cpn.registry.db import DEFAULT_DATABASE_URL, Registry, database_url, normalize_url
from cpn.registry.events import EventKind, record_event
from cpn.registry.inventory import (
    AgentRegistration,
    GpuInfo,
    NicInfo,
    NodeInfo,
    NodeOwnedError,
    Registered,
    SiteSettings,
    register_agent,
)
from cpn.registry.leases import HeartbeatRecord, apply_heartbeats, live_leases, mark_lost
from cpn.registry.migrate import DatabaseUnavailable, downgrade, upgrade
from cpn.registry.topology import EmptyRegistry, build_topology

__all__ = [
    "DEFAULT_DATABASE_URL",
    "AgentRegistration",
    "AllocationConflict",
    "DatabaseUnavailable",
    "EmptyRegistry",
    "EventKind",
    "GpuInfo",
    "HeartbeatRecord",
    "NicInfo",
    "NoCapacity",
    "NodeInfo",
    "NodeOwnedError",
    "Registered",
    "Registry",
    "SiteSettings",
    "allocate_free",
    "allocate_gpus",
    "apply_heartbeats",
    "build_topology",
    "create_job",
    "database_url",
    "downgrade",
    "live_leases",
    "mark_lost",
    "normalize_url",
    "record_event",
    "register_agent",
    "release",
    "reserve_link",
    "upgrade",
]
