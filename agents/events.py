"""The agent's periodic work, as small event classes with their own interval (the way
SkyPilot's skylet organises its node agent). Each event is given only what it needs — a
function to call, a store to fill — never the agent itself. `run_events` runs each in its
own loop; an event whose failure means the session with the control plane is over
re-raises, the others log and carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agents.links import LinkBook
from agents.probe import ProbeResult, measure
from proto.cpn.v1 import agent_pb2 as pb

log = logging.getLogger("cpn.agent")

Interval = Callable[[], float]


class PeriodicEvent(ABC):
    #: Failing ends the session (reconnect); otherwise the error is logged and retried.
    fatal = False
    #: With a wakeup event: however often it fires, runs are at least this far apart.
    min_gap_s = 1.0

    @abstractmethod
    def interval_s(self) -> float: ...

    @abstractmethod
    async def run(self) -> None: ...

    def wakeup(self) -> asyncio.Event | None:
        """An event that, when set, runs this one before its interval is up."""
        return None


class HeartbeatEvent(PeriodicEvent):
    """Renew the lease at the pace the control plane asked for."""

    fatal = True

    def __init__(self, beat: Callable[[], Awaitable[None]], interval: Interval) -> None:
        self._beat, self._interval = beat, interval

    def interval_s(self) -> float:
        return self._interval()

    async def run(self) -> None:
        await self._beat()


@dataclass
class Peers:
    """What the probe needs to know of the control plane's peer list."""

    current: Callable[[], list[pb.Peer]]
    changed: asyncio.Event


class ProbeEvent(PeriodicEvent):
    """Measure RTT and throughput to one agent of every peer site, one peer at a time.

    Each site is probed at most once per interval; a site that appears in the peer list
    (the control plane announced a new agent) is probed right away."""

    def __init__(
        self, site: str, peers: Peers, links: LinkBook, interval_s: float, probe_bytes: int
    ) -> None:
        self.site, self.peers, self.links = site, peers, links
        self._interval_s, self.probe_bytes = interval_s, probe_bytes
        self._probed: dict[str, float] = {}  # site → monotonic time of the last probe

    def interval_s(self) -> float:
        return self._interval_s

    def wakeup(self) -> asyncio.Event | None:
        return self.peers.changed

    async def run(self) -> None:
        by_site: dict[str, str] = {}
        for peer in sorted(self.peers.current(), key=lambda p: (p.site, p.agent_id)):
            if peer.site != self.site and peer.probe_address:
                by_site.setdefault(peer.site, peer.probe_address)
        now = time.monotonic()
        for site, address in by_site.items():
            if now - self._probed.get(site, -math.inf) < self._interval_s * 0.9:
                continue  # measured recently: a peer-list change is no reason to redo it
            self._probed[site] = now
            try:
                result: ProbeResult = await measure(address, transfer_bytes=self.probe_bytes)
            except (OSError, TimeoutError, ConnectionError, ValueError) as exc:
                log.warning("probe to %s (%s) failed: %s", site, address, exc)
                continue
            self.links.record(site, result)
            log.debug("probe %s: %.2f ms, %.2f Gb/s", site, result.rtt_ms, result.bandwidth_gbps)


@dataclass
class HealthState:
    """The node's health as heartbeats report it."""

    health: pb.Health.ValueType = pb.HEALTH_OK

    @property
    def name(self) -> str:
        return pb.Health.Name(self.health).removeprefix("HEALTH_").lower()


class HealthEvent(PeriodicEvent):
    """Look again at the hardware: DEGRADED when an RDMA port that was active at start is
    no longer, FAILING when GPUs have disappeared (a fallen-off-the-bus GPU, a driver
    reset). Cheap: sysfs reads, and a GPU query only where a real GPU source exists."""

    def __init__(
        self,
        check: Callable[[], tuple[pb.Health.ValueType, str]],
        state: HealthState,
        interval_s: float = 15.0,
    ) -> None:
        self.check, self.state, self._interval_s = check, state, interval_s

    def interval_s(self) -> float:
        return self._interval_s

    async def run(self) -> None:
        health, reason = await asyncio.to_thread(self.check)
        if health != self.state.health:
            new = HealthState(health)
            log.warning(
                "health %s -> %s%s", self.state.name, new.name, f": {reason}" if reason else ""
            )
            self.state.health = health


async def run_events(events: list[PeriodicEvent]) -> None:
    """Run every event in its own loop until a fatal one fails (its error propagates)."""

    async def loop(event: PeriodicEvent) -> None:
        while True:
            started = time.monotonic()
            try:
                await event.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                if event.fatal:
                    raise
                log.exception(
                    "%s failed; next try in %.1f s", type(event).__name__, event.interval_s()
                )
            elapsed = time.monotonic() - started
            remaining = max(0.0, event.interval_s() - elapsed)
            wake = event.wakeup()
            if wake is None:
                await asyncio.sleep(remaining)
                continue
            await asyncio.sleep(min(remaining, event.min_gap_s))
            if not wake.is_set():
                # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result
                # when the wait ends just as the task is cancelled, swallowing the cancel —
                # this loop then ran on for ever and the agent's session never ended
                # (caught by the chaos test under load). The same holds for every wait_for
                # in the agent's and the control plane's long-lived tasks.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, remaining - event.min_gap_s)):
                        await wake.wait()
            wake.clear()

    tasks = [asyncio.create_task(loop(e), name=type(e).__name__) for e in events]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        await cancel_all(tasks)


#: How long a cancelled task of a session may take to end before it is left behind.
CANCEL_WAIT_S = 10.0


async def cancel_all(tasks: list[asyncio.Task[Any]], wait_s: float = CANCEL_WAIT_S) -> None:
    """Cancel `tasks` and wait for them, at most `wait_s`: a task that does not end (an
    await that ignores its cancellation) is logged with where it waits and left behind.
    Waiting for ever here would leave the agent alive, silent and without a session — no
    heartbeats, no orders — which is worse than a leaked task."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=wait_s)
    for task in done:  # their errors were the caller's to raise: retrieved, not logged
        if not task.cancelled():
            task.exception()
    for task in pending:
        stack = io.StringIO()
        task.print_stack(file=stack)
        log.error(
            "task %s did not end %g s after it was cancelled; left behind. %s",
            task.get_name(),
            wait_s,
            stack.getvalue().rstrip(),
        )
