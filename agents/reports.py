"""Task updates on their way to the control plane.

The newest update per (job, rank) waits here until `ReportTaskStatus` has delivered it;
none is lost to an outage (they wait for the next session) and a fast worker's updates
do not pile up (an older one is replaced). Log lines and per-step records from the
`Outbox` ride on the reports of their task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from grpc import aio

from agents.logs import Outbox
from agents.tasks import TaskUpdate
from proto.cpn.v1 import agent_pb2 as pb

log = logging.getLogger("cpn.agent")

#: The control plane refused this one report (a job it does not know, a field out of
#: range): sending it again cannot help, and it must not end the agent's session.
REPORT_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}

Send = Callable[[pb.ReportTaskStatusRequest], Awaitable[None]]
Request = Callable[[TaskUpdate], pb.ReportTaskStatusRequest]


class ReportQueue:
    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self._updates: dict[tuple[str, int], TaskUpdate] = {}
        self._changed = asyncio.Event()

    def put(self, update: TaskUpdate) -> None:
        self._updates[(update.job_id, update.rank)] = update
        self._changed.set()

    def nudge(self) -> None:
        """New output or steps for a task whose state did not change: report anyway."""
        self._changed.set()

    async def deliver(self, request_of: Request, send: Send) -> None:
        """Send what waits, as it comes, until cancelled or a send fails (which ends the
        session; the updates stay for the next one).

        What an earlier session left undelivered goes first: a launch that ended while
        the control plane was away has no further update to wake this loop, and its final
        state would otherwise wait for ever (its job RUNNING on the control plane, which
        sees the agent back and still following the launch)."""
        if self._updates:
            self._changed.set()
        while True:
            await self._changed.wait()
            self._changed.clear()
            for key, update in list(self._updates.items()):
                request = request_of(update)
                self.outbox.fill(request)
                try:
                    await send(request)
                except aio.AioRpcError as exc:
                    if exc.code() not in REPORT_REFUSALS:
                        self.outbox.put_back(request)
                        raise
                    log.warning(
                        "report for job %s rank %d refused, dropped: %s: %s",
                        update.job_id,
                        update.rank,
                        exc.code().name,
                        exc.details(),
                    )
                except BaseException:
                    self.outbox.put_back(request)
                    raise
                if self.outbox.pending(update.job_id, update.rank):
                    self._changed.set()  # more than one report's worth: go again
                elif self._updates.get(key) is update:
                    del self._updates[key]
