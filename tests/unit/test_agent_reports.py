"""The agent's report queue across sessions: an update that one session could not
deliver (the control plane went away mid-send, or the session was cancelled) is the first
thing the next session sends, with no newer update needed to wake it.

Found by the chaos test under load: a worker killed just before `cpn serve` was; the
launch's FAILED report failed to send, the launch never changed again, and the job stayed
RUNNING on the control plane for good. The sends here are plain coroutines standing in for
the RPC: what is under test is the queue's hand-over between sessions, not gRPC."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio

from agents.logs import Outbox
from agents.reports import ReportQueue
from agents.tasks import TaskUpdate
from proto.cpn.v1 import agent_pb2 as pb

FAILED = TaskUpdate(job_id="j", rank=1, state=pb.TASK_STATE_FAILED, exit_code=1, epoch=2)


def request_of(update: TaskUpdate) -> pb.ReportTaskStatusRequest:
    return update.request("a", "a-n", "lease-1")  # as the agent builds it


def unavailable() -> aio.AioRpcError:
    return aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, aio.Metadata(), aio.Metadata(), "connection reset"
    )


async def next_session(queue: ReportQueue) -> list[pb.ReportTaskStatusRequest]:
    """A session whose sends succeed, for one second; what it sent."""
    sent: list[pb.ReportTaskStatusRequest] = []

    async def send(request: pb.ReportTaskStatusRequest) -> None:
        sent.append(request)

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1.0):
            await queue.deliver(request_of, send)
    return sent


def test_an_update_whose_send_failed_goes_first_in_the_next_session() -> None:
    async def scenario() -> list[pb.ReportTaskStatusRequest]:
        queue = ReportQueue(Outbox())
        queue.put(FAILED)

        async def down(request: pb.ReportTaskStatusRequest) -> None:
            raise unavailable()

        with pytest.raises(aio.AioRpcError):
            await queue.deliver(request_of, down)
        return await next_session(queue)

    sent = asyncio.run(scenario())
    assert [(r.job_id, r.rank, r.state, r.exit_code, r.epoch) for r in sent] == [
        ("j", 1, pb.TASK_STATE_FAILED, 1, 2)
    ]


def test_updates_left_by_a_cancelled_session_go_in_the_next() -> None:
    """The session ends for another reason (its heartbeat stream broke) while a send is
    in flight: that update and the ones behind it are sent by the next session."""

    async def scenario() -> list[pb.ReportTaskStatusRequest]:
        queue = ReportQueue(Outbox())
        queue.put(FAILED)
        queue.put(TaskUpdate(job_id="j", rank=0, state=pb.TASK_STATE_FAILED, epoch=2))
        entered = asyncio.Event()

        async def hangs(request: pb.ReportTaskStatusRequest) -> None:
            entered.set()
            await asyncio.Event().wait()

        session = asyncio.create_task(queue.deliver(request_of, hangs))
        await entered.wait()
        session.cancel()
        with pytest.raises(asyncio.CancelledError):
            await session
        return await next_session(queue)

    sent = asyncio.run(scenario())
    assert sorted((r.rank, r.state) for r in sent) == [
        (0, pb.TASK_STATE_FAILED),
        (1, pb.TASK_STATE_FAILED),
    ]


def test_a_delivered_update_is_not_sent_again() -> None:
    Sent = list[pb.ReportTaskStatusRequest]

    async def scenario() -> tuple[Sent, Sent]:
        queue = ReportQueue(Outbox())
        queue.put(FAILED)
        return await next_session(queue), await next_session(queue)

    first, second = asyncio.run(scenario())
    assert len(first) == 1 and second == []
