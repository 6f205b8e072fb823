"""Launch and stop orders on their way to agents (`WatchAssignments`), kept in the database.

This is the control layer's internal API for the orchestration: an order is a row of
`orders` (`cpn.registry.models.Order`) holding the serialized `cpn.v1.Assignment`, written
in the transaction that decides it (`queue()`, with its `order_queued` event) or in one of
its own (`launch()`, `stop()`); the agent's `WatchAssignments` stream reads the queued
rows of its agent in order and marks each delivered once it was written to the stream.
So orders survive a control-plane restart (the next stream of the agent gets what was not
delivered), and an order delivered is never sent again: nothing is lost or done twice.
UNIQUE (job, epoch, site, agent, kind) makes a second launch of one job epoch on one agent
impossible; queueing the same order again returns the first one's id.

A lost agent's queued orders are dropped (`drop_orders`, in the reaper's transaction) and
its stream ends (`close`). `launch()`, `stop()` and `notify()` may be called from any
thread; streams wake on `notify()` and, when `poll_s` is set, also poll (orders written by
another control plane sharing the database).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session

from cpn.contracts import Plan
from cpn.registry import Registry
from cpn.registry.events import EventKind, record_event
from cpn.registry.models import Order, OrderState, utcnow
from proto.cpn.v1 import agent_pb2 as pb

RunDb = Callable[..., Awaitable[Any]]


@dataclass
class _Stream:
    #: Wakes the current stream (new orders, its end). Each stream has its own: a newer
    #: stream clearing a shared one could leave the older one it replaced asleep.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    generation: int = 0  # the stream that may read; an older one ends
    closed: bool = False


def launch_assignment(
    *,
    job_id: str,
    plan: Plan,
    job_yaml: str,
    master_addr: str,
    master_port: int,
    env: dict[str, str] | None = None,
    epoch: int = 0,
    checkpoint_store: str = "",
    checkpoint_every: int = 0,
    resume_from: str = "",
) -> pb.Assignment:
    """A launch order: the agent starts a worker for each of its ranks of the plan."""
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
        epoch=epoch,
        checkpoint_store=checkpoint_store,
        checkpoint_every=checkpoint_every,
        resume_from=resume_from,
    )
    return pb.Assignment(order_id=_order_id(), launch=order)


def stop_assignment(job_id: str, reason: str = "", epoch: int = 0) -> pb.Assignment:
    """A stop order: the agent ends the job's workers of `epoch` and older (0: all)."""
    return pb.Assignment(
        order_id=_order_id(), stop=pb.StopOrder(job_id=job_id, reason=reason, epoch=epoch)
    )


def queue(session: Session, site: str, agent_id: str, assignment: pb.Assignment) -> str:
    """Write an order for one agent in the caller's transaction, with its `order_queued`
    event; the order's id. Call `notify()` after the commit. An order of the same kind for
    the same job epoch and agent already queued (or delivered) is not written again: its
    id is returned."""
    kind = assignment.WhichOneof("order") or "unknown"
    body = assignment.launch if kind == "launch" else assignment.stop
    job_id, epoch = body.job_id, body.epoch
    existing = session.scalar(
        select(Order.order_id).where(
            Order.job_id == job_id,
            Order.epoch == epoch,
            Order.site == site,
            Order.agent_id == agent_id,
            Order.kind == kind,
        )
    )
    if existing is not None:
        return existing
    now = utcnow()
    session.add(
        Order(
            order_id=assignment.order_id,
            job_id=job_id,
            epoch=epoch,
            site=site,
            agent_id=agent_id,
            kind=kind,
            body=assignment.SerializeToString(),
            state=OrderState.QUEUED,
            created_at=now,
        )
    )
    data: dict[str, object] = {"order_id": assignment.order_id, "kind": kind, "epoch": epoch}
    if kind == "launch":
        # What a task status from this agent may refer to (cpn.control.references).
        data["ranks"] = [r.rank for r in assignment.launch.ranks if r.site == site]
    record_event(
        session,
        EventKind.ORDER_QUEUED,
        f"{kind} order {assignment.order_id} for job {job_id} (epoch {epoch}) queued for "
        f"{agent_id}",
        site=site,
        agent_id=agent_id,
        job_id=job_id,
        data=data,
        at=now,
    )
    return assignment.order_id


def drop_orders(session: Session, site: str, agent_id: str) -> int:
    """The agent is lost: its orders not yet delivered will never be. Returns how many."""
    result = session.execute(
        update(Order)
        .where(Order.site == site, Order.agent_id == agent_id, Order.state == OrderState.QUEUED)
        .values(state=OrderState.DROPPED),
        execution_options={"synchronize_session": False},
    )
    return int(cast("CursorResult[Any]", result).rowcount)


class AssignmentDispatcher:
    def __init__(self, registry: Registry, poll_s: float | None = None) -> None:
        self.registry = registry
        self.poll_s = poll_s
        self._streams: dict[tuple[str, str], _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._run_db: RunDb | None = None

    def bind(self, loop: asyncio.AbstractEventLoop, run_db: RunDb) -> None:
        """Serve streams on `loop`, reading the database through `run_db` (the server's
        database thread)."""
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._run_db = run_db

    # ------------------------------------------------------------------ orchestration API

    def launch(self, site: str, agent_id: str, **fields: Any) -> str:
        """Queue a launch order (launch_assignment's fields) in a transaction of its own."""
        return self.submit(site, agent_id, launch_assignment(**fields))

    def stop(
        self, site: str, agent_id: str, *, job_id: str, reason: str = "", epoch: int = 0
    ) -> str:
        """Queue a stop order in a transaction of its own."""
        return self.submit(site, agent_id, stop_assignment(job_id, reason, epoch))

    def submit(self, site: str, agent_id: str, assignment: pb.Assignment) -> str:
        with self.registry.write() as session:
            order_id = queue(session, site, agent_id, assignment)
        self.notify(site, agent_id)
        return order_id

    def notify(self, site: str, agent_id: str) -> None:
        """Orders were committed for this agent: wake its stream (any thread)."""
        if self._loop is None:
            return
        if threading.get_ident() == self._loop_thread:
            self._wake((site, agent_id))
        else:
            self._loop.call_soon_threadsafe(self._wake, (site, agent_id))

    def close(self, site: str, agent_id: str) -> None:
        """The agent is lost: end its stream (on the loop)."""
        stream = self._streams.pop((site, agent_id), None)
        if stream is not None:
            stream.closed = True
            stream.changed.set()

    # ------------------------------------------------------------------ server side

    def _wake(self, key: tuple[str, str]) -> None:
        stream = self._streams.get(key)
        if stream is not None:
            stream.changed.set()

    def _queued(self, site: str, agent_id: str) -> list[tuple[int, bytes]]:
        with self.registry.read() as session:
            rows = session.execute(
                select(Order.id, Order.body)
                .where(
                    Order.site == site, Order.agent_id == agent_id, Order.state == OrderState.QUEUED
                )
                .order_by(Order.id)
                .limit(100)
            )
            return [(int(pk), bytes(body)) for pk, body in rows]

    def _delivered(self, pk: int) -> None:
        with self.registry.write() as session:
            session.execute(
                update(Order)
                .where(Order.id == pk, Order.state == OrderState.QUEUED)
                .values(state=OrderState.DELIVERED, delivered_at=utcnow()),
                execution_options={"synchronize_session": False},
            )

    async def stream(self, site: str, agent_id: str) -> AsyncIterator[pb.Assignment]:
        """Orders for one agent as they come, oldest first; each marked delivered once it
        was written to the stream. A newer stream for the same agent (it reconnected)
        takes over and this one ends."""
        assert self._run_db is not None, "bind() first"
        key = (site, agent_id)
        stream = self._streams.get(key)
        if stream is None or stream.closed:
            stream = self._streams[key] = _Stream()
        stream.generation += 1
        mine = stream.generation
        older, stream.changed = stream.changed, asyncio.Event()
        changed = stream.changed
        older.set()  # wake an older stream so that it sees it has been replaced

        def replaced() -> bool:
            return stream.closed or stream.generation != mine

        while not replaced():
            changed.clear()
            rows = await self._run_db(self._queued, site, agent_id)
            for pk, body in rows:
                if replaced():
                    return
                yield pb.Assignment.FromString(body)
                await self._run_db(self._delivered, pk)
            if rows or replaced():
                continue
            # Not wait_for: Python 3.11's swallows a cancel that comes as the wait ends.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_s):
                    await changed.wait()


def _order_id() -> str:
    return uuid.uuid4().hex[:16]
