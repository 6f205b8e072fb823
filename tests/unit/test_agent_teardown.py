"""Ending an agent's session never waits for ever: a task that ignores its cancellation
is logged with where it waits and left behind, so that the agent reconnects (a session
that cannot end is an agent alive and silent: no heartbeats, no orders)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from agents.events import HeartbeatEvent, PeriodicEvent, cancel_all, run_events


async def _stubborn(started: asyncio.Event) -> None:
    started.set()
    with contextlib.suppress(asyncio.CancelledError):  # swallows its first cancel
        await asyncio.sleep(3600)
    await asyncio.sleep(3600)


def test_a_task_that_ignores_its_cancel_is_named_and_left_behind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> tuple[float, bool, bool]:
        started = asyncio.Event()
        stubborn = asyncio.create_task(_stubborn(started), name="orders")
        polite = asyncio.create_task(asyncio.sleep(3600), name="reports")
        await started.wait()
        t0 = time.monotonic()
        await cancel_all([stubborn, polite], wait_s=0.3)
        took = time.monotonic() - t0
        state = (took, stubborn.done(), polite.cancelled())
        stubborn.cancel()  # a second cancel ends it, for the test's loop
        await asyncio.wait([stubborn])
        return state

    with caplog.at_level(logging.ERROR, logger="cpn.agent"):
        took, stubborn_done, polite_cancelled = asyncio.run(scenario())
    assert 0.3 <= took < 2.0
    assert not stubborn_done and polite_cancelled
    [record] = [r for r in caplog.records if "left behind" in r.getMessage()]
    message = record.getMessage()
    assert message.startswith("task orders did not end 0.3 s after it was cancelled")
    assert "in _stubborn" in message


def test_a_failing_heartbeat_ends_the_events_with_its_error() -> None:
    async def beat() -> None:
        raise TimeoutError("no answer")

    async def scenario() -> None:
        await run_events([HeartbeatEvent(beat, lambda: 0.01)])

    with pytest.raises(TimeoutError, match="no answer"):
        asyncio.run(scenario())


class _Woken(PeriodicEvent):
    """An event with a wakeup (like the WAN probe's on a new peer list)."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.runs = 0

    def interval_s(self) -> float:
        return 3600.0

    def wakeup(self) -> asyncio.Event:
        return self.wake

    async def run(self) -> None:
        self.runs += 1


def test_an_event_woken_as_its_session_ends_still_ends() -> None:
    """The session is cancelled in the same instant as an event's wakeup fires (a new
    peer list arrives as the control plane goes away): Python 3.11's wait_for returned
    the wakeup and swallowed the cancel, the event's loop ran on and the session's
    teardown waited on it for ever — an agent alive, silent, without heartbeats."""

    async def scenario() -> bool:
        event = _Woken()
        events = asyncio.create_task(run_events([event]))
        while event.runs < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(event.min_gap_s + 0.2)  # now in the wait for the wakeup
        event.wake.set()
        events.cancel()  # same instant: no await between
        done, _ = await asyncio.wait([events], timeout=3.0)
        ended = events in done
        if not ended:  # let the test's loop finish
            events.get_coro().close()
        return ended

    assert asyncio.run(scenario()), "the events' loop swallowed its cancel and ran on"
