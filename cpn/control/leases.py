"""Hot lease state, in memory: renewing a lease is a few attribute writes, not a database
write.

The control server's event loop owns this table (no locks: only that thread touches it).
Expiry is decided here, against the monotonic clock, on every renewal and by the reaper;
the database gets the renewals later, in batches (`take_dirty`, written by
cpn.registry.leases.apply_heartbeats). A lease that expired is never renewed: the heartbeat
is refused and the reaper declares the agent lost.

A heartbeat's GPU usage is compared with what was last queued for each GPU and only the
changes are written: at thousands of heartbeats a second, rewriting eight unchanged rows
per heartbeat would cost more than everything else together.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol

from cpn.registry.leases import GpuUsage, HeartbeatRecord, LinkSample

#: Utilisation moves by less than this (of 1.0), memory by less than 0.1 GiB: not news.
UTILISATION_STEP = 0.01
MEMORY_STEP_GB = 0.1


class UsageReport(Protocol):
    """What a heartbeat says about one GPU (the protocol's GpuUsage message)."""

    node: str
    index: int
    utilisation: float
    memory_used_gb: float


@dataclass
class LiveLease:
    lease_id: str
    site: str
    agent_id: str
    agent_pk: int
    site_id: int
    lease_pk: int
    ttl_s: float
    expires_mono: float
    probe_address: str = ""
    gpu_ids: dict[tuple[str, int], int] = field(default_factory=dict)
    #: Loaded from the database after a restart: reaped if its agent does not register
    #: again in time, but not renewable (the agent must register to refresh its state).
    restored: bool = False
    # Since the last flush: when it was renewed (wall clock), its health, what changed.
    renewed_at: float = 0.0
    health: str = "ok"
    pending_gpus: dict[int, tuple[float, float]] = field(default_factory=dict)
    pending_links: dict[str, LinkSample] = field(default_factory=dict)
    #: Usage last queued for the database, per GPU id.
    last_usage: dict[int, tuple[float, float]] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return (self.site, self.agent_id)

    def expired(self, now_mono: float) -> bool:
        return now_mono >= self.expires_mono


class LeaseTable:
    def __init__(self) -> None:
        self._by_id: dict[str, LiveLease] = {}
        self._by_agent: dict[tuple[str, str], LiveLease] = {}
        self._dirty: dict[int, LiveLease] = {}
        #: Bumped whenever the set of live agents (and so everyone's peer list) changes.
        self.peers_version = 1

    def __len__(self) -> int:
        return len(self._by_id)

    def put(self, lease: LiveLease) -> LiveLease | None:
        """Install a lease, replacing (and returning) the agent's previous one."""
        old = self._by_agent.pop(lease.key, None)
        if old is not None:
            self._by_id.pop(old.lease_id, None)
            self._dirty.pop(old.agent_pk, None)
        self._by_id[lease.lease_id] = lease
        self._by_agent[lease.key] = lease
        self.peers_version += 1
        return old

    def get(self, lease_id: str) -> LiveLease | None:
        return self._by_id.get(lease_id)

    def for_agent(self, site: str, agent_id: str) -> LiveLease | None:
        return self._by_agent.get((site, agent_id))

    def remove(self, lease: LiveLease) -> None:
        if self._by_id.get(lease.lease_id) is lease:
            del self._by_id[lease.lease_id]
            del self._by_agent[lease.key]
            self._dirty.pop(lease.agent_pk, None)
            self.peers_version += 1

    def renew(
        self,
        lease: LiveLease,
        now_mono: float,
        health: str,
        gpus: Iterable[UsageReport] = (),
        links: Iterable[LinkSample] = (),
    ) -> None:
        lease.expires_mono = now_mono + lease.ttl_s
        lease.renewed_at = time.time()
        lease.health = health
        ids, last, pending = lease.gpu_ids, lease.last_usage, lease.pending_gpus
        for usage in gpus:
            gpu_id = ids.get((usage.node, usage.index))
            if gpu_id is None:
                continue  # a GPU this agent did not register: nothing to update
            now = (usage.utilisation, usage.memory_used_gb)
            before = last.get(gpu_id)
            if (
                before is None
                or abs(before[0] - now[0]) >= UTILISATION_STEP
                or abs(before[1] - now[1]) >= MEMORY_STEP_GB
            ):
                last[gpu_id] = pending[gpu_id] = now
        for link in links:
            lease.pending_links[link.peer_site] = link
        self._dirty[lease.agent_pk] = lease

    def take_dirty(self) -> list[HeartbeatRecord]:
        """The renewals since the last call, as rows for the database."""
        records = []
        for lease in self._dirty.values():
            at = datetime.fromtimestamp(lease.renewed_at, UTC)
            records.append(
                HeartbeatRecord(
                    agent_pk=lease.agent_pk,
                    lease_pk=lease.lease_pk,
                    site_id=lease.site_id,
                    agent_id=lease.agent_id,
                    at=at,
                    # Computed from the renewal's own time: never later than the
                    # in-memory expiry, so the database cannot outlive the truth.
                    expires_at=at + timedelta(seconds=lease.ttl_s),
                    health=lease.health,
                    gpus=tuple(GpuUsage(g, u, m) for g, (u, m) in lease.pending_gpus.items()),
                    links=tuple(lease.pending_links.values()),
                )
            )
            lease.pending_gpus = {}
            lease.pending_links = {}
        self._dirty = {}
        return records

    def expired(self, now_mono: float | None = None) -> list[LiveLease]:
        now_mono = time.monotonic() if now_mono is None else now_mono
        return [lease for lease in self._by_id.values() if lease.expired(now_mono)]

    def live(self) -> list[LiveLease]:
        return list(self._by_id.values())
