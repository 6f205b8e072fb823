"""Launch and stop orders on their way to agents (`WatchAssignments`).

This is the control layer's internal API for the orchestration: `launch()` and `stop()`
queue an order for one agent; the agent's `WatchAssignments` stream delivers it. Orders
for an agent that is not watching right now wait in its mailbox until it reconnects; they
live in memory (after a control-plane restart the orchestration re-issues what is still
needed from the job states in the registry). An agent that is declared lost has its
mailbox dropped.

`launch()`, `stop()` and `submit()` may be called from any thread: the mailbox is touched
only on the server's event loop.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from cpn.contracts import Plan
from proto.cpn.v1 import agent_pb2 as pb


@dataclass
class _Mailbox:
    pending: deque[pb.Assignment] = field(default_factory=deque)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    generation: int = 0  # the stream that may read; an older one ends
    closed: bool = False


class AssignmentDispatcher:
    def __init__(self) -> None:
        self._boxes: dict[tuple[str, str], _Mailbox] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        #: Called on the loop for every order queued (the server records an event).
        self.on_queued: Callable[[str, str, pb.Assignment], None] | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()

    # ------------------------------------------------------------------ orchestration API

    def launch(
        self,
        site: str,
        agent_id: str,
        *,
        job_id: str,
        plan: Plan,
        job_yaml: str,
        master_addr: str,
        master_port: int,
        env: dict[str, str] | None = None,
    ) -> str:
        """Queue a launch order: the agent starts a worker for each of its ranks."""
        ranks = [
            pb.RankAssignment(
                rank=r.rank,
                site=r.site,
                node=r.node,
                gpu=r.gpu,
                replica=r.replica,
                stage=r.stage,
                tp_index=r.tp_index,
            )
            for r in plan.ranks()
        ]
        order = pb.LaunchOrder(
            job_id=job_id,
            plan_json=plan.model_dump_json(),
            job_yaml=job_yaml,
            ranks=ranks,
            world_size=len(ranks),
            master_addr=master_addr,
            master_port=master_port,
            env=env or {},
        )
        return self.submit(site, agent_id, pb.Assignment(order_id=_order_id(), launch=order))

    def stop(self, site: str, agent_id: str, *, job_id: str, reason: str = "") -> str:
        """Queue a stop order: the agent terminates the job's workers."""
        order = pb.StopOrder(job_id=job_id, reason=reason)
        return self.submit(site, agent_id, pb.Assignment(order_id=_order_id(), stop=order))

    def submit(self, site: str, agent_id: str, assignment: pb.Assignment) -> str:
        if self._loop is None or threading.get_ident() == self._loop_thread:
            self._put((site, agent_id), assignment)
        else:
            self._loop.call_soon_threadsafe(self._put, (site, agent_id), assignment)
        return assignment.order_id

    # ------------------------------------------------------------------ server side

    def _box(self, key: tuple[str, str]) -> _Mailbox:
        box = self._boxes.get(key)
        if box is None or box.closed:
            box = self._boxes[key] = _Mailbox()
        return box

    def _put(self, key: tuple[str, str], assignment: pb.Assignment) -> None:
        box = self._box(key)
        box.pending.append(assignment)
        box.changed.set()
        if self.on_queued is not None:
            self.on_queued(key[0], key[1], assignment)

    def pending(self, site: str, agent_id: str) -> Sequence[pb.Assignment]:
        box = self._boxes.get((site, agent_id))
        return list(box.pending) if box is not None else []

    def drop(self, site: str, agent_id: str) -> int:
        """The agent is lost: end its stream, forget its queued orders. Returns how many."""
        box = self._boxes.pop((site, agent_id), None)
        if box is None:
            return 0
        box.closed = True
        box.changed.set()
        return len(box.pending)

    async def stream(self, site: str, agent_id: str) -> AsyncIterator[pb.Assignment]:
        """Orders for one agent as they come. A newer stream for the same agent (it
        reconnected) takes over and this one ends."""
        box = self._box((site, agent_id))
        box.generation += 1
        mine = box.generation
        box.changed.set()  # wake an older stream so that it sees it has been replaced
        while True:
            if box.closed or box.generation != mine:
                return
            if box.pending:
                assignment = box.pending.popleft()
                try:
                    yield assignment
                except BaseException:
                    box.pending.appendleft(assignment)  # not delivered: keep it for the next
                    raise
                continue
            box.changed.clear()
            await box.changed.wait()


def _order_id() -> str:
    return uuid.uuid4().hex[:16]
