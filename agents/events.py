"""The agent's periodic work, as small event classes with their own interval (the way
SkyPilot's skylet organises its node agent). `run_events` runs each in its own loop; an
event whose failure means the session with the control plane is over re-raises, the others
log and carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from agents.probe import ProbeResult, measure

if TYPE_CHECKING:
    from agents.agent import Agent

log = logging.getLogger("cpn.agent")


class PeriodicEvent(ABC):
    #: Failing ends the session (reconnect); otherwise the error is logged and retried.
    fatal = False
    #: With a wakeup event: however often it fires, runs are at least this far apart.
    min_gap_s = 1.0

    @abstractmethod
    def interval_s(self, agent: Agent) -> float: ...

    @abstractmethod
    async def run(self, agent: Agent) -> None: ...

    def wakeup(self, agent: Agent) -> asyncio.Event | None:
        """An event that, when set, runs this one before its interval is up."""
        return None


class HeartbeatEvent(PeriodicEvent):
    """Renew the lease at the pace the control plane asked for, with utilisation, health
    and the newest WAN measurements."""

    fatal = True

    def interval_s(self, agent: Agent) -> float:
        return agent.heartbeat_interval_s

    async def run(self, agent: Agent) -> None:
        await agent.heartbeat()


class ProbeEvent(PeriodicEvent):
    """Measure RTT and throughput to one agent of every peer site, one peer at a time.

    Each site is probed at most once per interval; a site that appears in the peer list
    (the control plane announced a new agent) is probed right away."""

    def __init__(self) -> None:
        self._probed: dict[str, float] = {}  # site → monotonic time of the last probe

    def interval_s(self, agent: Agent) -> float:
        return agent.config.probe_interval_s

    def wakeup(self, agent: Agent) -> asyncio.Event | None:
        return agent.peers_changed

    async def run(self, agent: Agent) -> None:
        by_site: dict[str, str] = {}
        for peer in sorted(agent.peers, key=lambda p: (p.site, p.agent_id)):
            if peer.site != agent.config.site and peer.probe_address:
                by_site.setdefault(peer.site, peer.probe_address)
        now = time.monotonic()
        interval = self.interval_s(agent)
        for site, address in by_site.items():
            if now - self._probed.get(site, -math.inf) < interval * 0.9:
                continue  # measured recently: a peer-list change is no reason to redo it
            self._probed[site] = now
            try:
                result: ProbeResult = await measure(
                    address, transfer_bytes=agent.config.probe_bytes
                )
            except (OSError, TimeoutError, ConnectionError, ValueError) as exc:
                log.warning("probe to %s (%s) failed: %s", site, address, exc)
                continue
            agent.record_link(site, result)
            log.debug("probe %s: %.2f ms, %.2f Gb/s", site, result.rtt_ms, result.bandwidth_gbps)


class HealthEvent(PeriodicEvent):
    """Look again at the hardware: DEGRADED when an RDMA port that was active at start is
    no longer, FAILING when GPUs have disappeared (a fallen-off-the-bus GPU, a driver
    reset). Cheap: sysfs reads, and a GPU query only where a real GPU source exists."""

    def __init__(self, interval_s: float = 15.0) -> None:
        self._interval_s = interval_s

    def interval_s(self, agent: Agent) -> float:
        return self._interval_s

    async def run(self, agent: Agent) -> None:
        health, reason = await asyncio.to_thread(agent.check_health)
        if health != agent.health:
            log.warning(
                "health %s -> %s%s",
                agent.health_name,
                _NAMES[health],
                f": {reason}" if reason else "",
            )
            agent.health = health


_NAMES = {1: "ok", 2: "degraded", 3: "failing"}


async def run_events(agent: Agent, events: list[PeriodicEvent]) -> None:
    """Run every event in its own loop until a fatal one fails (its error propagates)."""

    async def loop(event: PeriodicEvent) -> None:
        while True:
            started = time.monotonic()
            try:
                await event.run(agent)
            except asyncio.CancelledError:
                raise
            except Exception:
                if event.fatal:
                    raise
                log.exception(
                    "%s failed; next try in %.1f s", type(event).__name__, event.interval_s(agent)
                )
            elapsed = time.monotonic() - started
            remaining = max(0.0, event.interval_s(agent) - elapsed)
            wake = event.wakeup(agent)
            if wake is None:
                await asyncio.sleep(remaining)
                continue
            await asyncio.sleep(min(remaining, event.min_gap_s))
            if not wake.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), max(0.0, remaining - event.min_gap_s))
            wake.clear()

    tasks = [asyncio.create_task(loop(e), name=type(e).__name__) for e in events]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
