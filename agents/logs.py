"""Forwarding what workers print, and their per-step metrics, to the control plane.

The agent already tails each worker's log file (`rank-R.log`) and metrics file; this
module turns them into what ReportTaskStatus carries besides the state:

- `new_lines` reads the new complete lines of a log file (and, once the worker has ended,
  the last unterminated one) through a `FileTail`, decoded as UTF-8 with replacement,
  each cut to `MAX_LINE_BYTES`;
- `Outbox` keeps, per (job, rank), the lines and step records not yet delivered, bounded:
  while the control plane is out of reach the oldest lines are dropped and counted
  (`log_lines_dropped`), the steps are kept up to `MAX_PENDING_STEPS`. A report takes at
  most `MAX_PER_REPORT` of each; what is left goes with the next one.

The bounds match what the control plane accepts (cpn/control/task_output.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cpn.contracts.limits import is_label
from cpn.train.tail import FileTail
from proto.cpn.v1 import agent_pb2 as pb

#: The control plane's bound on a step's `wan_sync` (cpn.control.task_output).
MAX_WAN_SYNC = 200

MAX_LINE_BYTES = 4096
MAX_PER_REPORT = 1000
MAX_PENDING_LINES = 10_000
MAX_PENDING_STEPS = 100_000


def cut(line: bytes) -> str:
    """One line as text, at most MAX_LINE_BYTES of UTF-8, without its line end."""
    text = line.rstrip(b"\r\n")[:MAX_LINE_BYTES].decode("utf-8", errors="replace")
    while len(text.encode()) > MAX_LINE_BYTES:  # replacement characters take 3 bytes
        text = text[:-1]
    return text


def new_lines(tail: FileTail, final: bool = False) -> list[str]:
    """A worker log's new lines as text, each cut to MAX_LINE_BYTES."""
    return [cut(line) for line in tail.lines(final)]


def step_message(record: dict[str, Any]) -> pb.StepMetrics | None:
    """A `cpn worker --metrics` record as the protocol's StepMetrics (None if malformed)."""
    step = record.get("step")
    if not isinstance(step, int) or step < 0:
        return None
    seconds = record.get("seconds")
    wall = seconds.get("step") if isinstance(seconds, dict) else seconds
    sent = record.get("bytes")
    if not isinstance(sent, dict):
        sent = {}
    message = pb.StepMetrics(
        step=step,
        seconds=float(wall) if isinstance(wall, int | float) and wall >= 0 else 0.0,
        bytes=pb.LinkBytes(
            **{
                k: v
                for k in ("intra_node", "intra_site", "wan")
                if isinstance(v := sent.get(k), int) and v >= 0
            }
        ),
    )
    loss = record.get("loss")
    if isinstance(loss, int | float):
        message.loss = float(loss)
    wan_sync = record.get("wan_sync")
    # Only what the control plane stores: one bad field would have it refuse the report.
    if isinstance(wan_sync, str) and wan_sync and is_label(wan_sync[:MAX_WAN_SYNC]):
        message.wan_sync = wan_sync[:MAX_WAN_SYNC]
    return message


@dataclass
class _Pending:
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_PENDING_LINES))
    steps: deque[pb.StepMetrics] = field(default_factory=lambda: deque(maxlen=MAX_PENDING_STEPS))
    dropped: int = 0


class Outbox:
    def __init__(self) -> None:
        self._pending: dict[tuple[str, int], _Pending] = {}

    def collect(
        self, job_id: str, rank: int, records: list[dict[str, Any]], lines: list[str]
    ) -> bool:
        """Queue a worker's new metrics records and log lines. True if anything was new."""
        steps = [m for m in map(step_message, records) if m is not None]
        if not steps and not lines:
            return False
        box = self._pending.setdefault((job_id, rank), _Pending())
        overflow = len(box.lines) + len(lines) - MAX_PENDING_LINES
        if overflow > 0:
            box.dropped += min(overflow, len(box.lines) + len(lines))
        box.lines.extend(lines)
        box.steps.extend(steps)
        return True

    def pending(self, job_id: str, rank: int) -> bool:
        box = self._pending.get((job_id, rank))
        return box is not None and bool(box.lines or box.steps or box.dropped)

    def fill(self, request: pb.ReportTaskStatusRequest) -> None:
        """Move up to MAX_PER_REPORT lines and steps of the request's task into it."""
        box = self._pending.get((request.job_id, request.rank))
        if box is None:
            return
        for _ in range(min(MAX_PER_REPORT, len(box.steps))):
            request.steps.append(box.steps.popleft())
        for _ in range(min(MAX_PER_REPORT, len(box.lines))):
            request.log_lines.append(box.lines.popleft())
        request.log_lines_dropped = box.dropped
        box.dropped = 0
        if not (box.lines or box.steps):
            del self._pending[(request.job_id, request.rank)]

    def put_back(self, request: pb.ReportTaskStatusRequest) -> None:
        """The request was not delivered: its lines and steps go first in the next one."""
        if not (request.steps or request.log_lines or request.log_lines_dropped):
            return
        box = self._pending.setdefault((request.job_id, request.rank), _Pending())
        box.lines.extendleft(reversed(request.log_lines))
        box.steps.extendleft(reversed(request.steps))
        box.dropped += request.log_lines_dropped
        del request.steps[:], request.log_lines[:]
        request.log_lines_dropped = 0
