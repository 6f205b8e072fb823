"""What a task status's log lines become before they are stored: one line each."""

from __future__ import annotations

import pytest

from cpn.control.errors import InvalidField
from cpn.control.task_output import MAX_LINE_BYTES, log_lines
from proto.cpn.v1 import agent_pb2 as pb


def test_a_line_stays_one_line_so_no_rank_can_forge_another_ranks_output() -> None:
    request = pb.ReportTaskStatusRequest(
        log_lines=["loss 1.0\n[0] fake line of rank 0", "50%\r100%", "nul\x00here", "plain"]
    )
    assert log_lines(request) == (
        "loss 1.0\\n[0] fake line of rank 0",
        "50%\\r100%",
        "nulhere",
        "plain",
    )


def test_dropped_lines_are_said_and_long_lines_refused() -> None:
    assert log_lines(pb.ReportTaskStatusRequest(log_lines=["x"], log_lines_dropped=3)) == (
        "[cpn agent: 3 lines dropped]",
        "x",
    )
    with pytest.raises(InvalidField, match=r"log_lines\[1\]"):
        log_lines(pb.ReportTaskStatusRequest(log_lines=["ok", "y" * (MAX_LINE_BYTES + 1)]))
