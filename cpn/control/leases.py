"""Hot lease state, in memory: renewing a lease is a dictionary update, not a database write.

The control server's event loop owns this table (no locks: only that thread touches it).
Expiry is decided here, against the monotonic clock, on every renewal and by the reaper;
the database gets the renewals later, in batches (see cpn.registry.leases). A lease that
expired is never renewed: the heartbeat is refused and the reaper declares the agent lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from cpn.registry.leases import GpuUsage, HeartbeatRecord, LinkSample


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
    #: Usage last queued for the database, per GPU id: unchanged usage is not rewritten.
    gpu_usage: dict[int, tuple[float, float]] = field(default_factory=dict)
    #: Loaded from the database after a restart: reaped if its agent does not register
    #: again in time, but not renewable (the agent must register to refresh its state).
    restored: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.site, self.agent_id)

    def expired(self, now_mono: float) -> bool:
        return now_mono >= self.expires_mono


class LeaseTable:
    def __init__(self) -> None:
        self._by_id: dict[str, LiveLease] = {}
        self._by_agent: dict[tuple[str, str], LiveLease] = {}
        self._dirty: dict[int, HeartbeatRecord] = {}
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
        gpus: tuple[GpuUsage, ...],
        links: tuple[LinkSample, ...],
    ) -> None:
        lease.expires_mono = now_mono + lease.ttl_s
        now = datetime.now(UTC)
        changed = tuple(g for g in gpus if _changed(lease.gpu_usage, g))
        pending = self._dirty.get(lease.agent_pk)
        if pending is not None and pending.gpus:
            # Not flushed yet: keep what it carried unless this heartbeat supersedes it.
            newer = {g.gpu_id for g in changed}
            changed = tuple(g for g in pending.gpus if g.gpu_id not in newer) + changed
        self._dirty[lease.agent_pk] = HeartbeatRecord(
            agent_pk=lease.agent_pk,
            lease_pk=lease.lease_pk,
            site_id=lease.site_id,
            agent_id=lease.agent_id,
            at=now,
            expires_at=now + timedelta(seconds=lease.ttl_s),
            health=health,
            gpus=changed,
            # Keep the last measurements if this heartbeat carried none.
            links=links or self._pending_links(lease.agent_pk),
        )

    def _pending_links(self, agent_pk: int) -> tuple[LinkSample, ...]:
        prev = self._dirty.get(agent_pk)
        return prev.links if prev is not None else ()

    def take_dirty(self) -> list[HeartbeatRecord]:
        batch = list(self._dirty.values())
        self._dirty = {}
        return batch

    def expired(self, now_mono: float | None = None) -> list[LiveLease]:
        now_mono = time.monotonic() if now_mono is None else now_mono
        return [lease for lease in self._by_id.values() if lease.expired(now_mono)]

    def live(self) -> list[LiveLease]:
        return list(self._by_id.values())


#: Utilisation moves by less than this (of 1.0), memory by less than 0.1 GiB: not news.
UTILISATION_STEP = 0.01
MEMORY_STEP_GB = 0.1


def _changed(last: dict[int, tuple[float, float]], usage: GpuUsage) -> bool:
    before = last.get(usage.gpu_id)
    if (
        before is not None
        and abs(before[0] - usage.utilisation) < UTILISATION_STEP
        and abs(before[1] - usage.memory_used_gb) < MEMORY_STEP_GB
    ):
        return False
    last[usage.gpu_id] = (usage.utilisation, usage.memory_used_gb)
    return True
