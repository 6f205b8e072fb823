"""What a task status's log lines and steps become before they are stored: one line
each; a step keeps the WAN sync that ran it."""

from __future__ import annotations

import pytest

from agents.logs import step_message
from cpn.control.errors import InvalidField
from cpn.control.task_output import MAX_LINE_BYTES, MAX_WAN_SYNC, log_lines, steps
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


def test_a_step_carries_the_wan_sync_that_ran_it() -> None:
    record = {"step": 4, "loss": 2.0, "seconds": {"step": 0.5}, "bytes": {"wan": 8}}
    plain = step_message(record)
    auto = step_message({**record, "wan_sync": "outer H=32 int8"})
    assert plain is not None and auto is not None
    request = pb.ReportTaskStatusRequest(steps=[plain, auto])
    assert [s.wan_sync for s in steps(request)] == [None, "outer H=32 int8"]
    assert [s.bytes_wan for s in steps(request)] == [8, 8]
    long = pb.StepMetrics(step=1, wan_sync="x" * (MAX_WAN_SYNC + 1))
    with pytest.raises(InvalidField, match=r"steps\[0\]\.wan_sync"):
        steps(pb.ReportTaskStatusRequest(steps=[long]))


@pytest.mark.parametrize(
    "bad", ["\x1b[31mfp16", "fp16\nFAKE LINE", "fp\x00", "outer\u202eH=8", "\t", "a\x7f"]
)
def test_a_wan_sync_that_is_not_one_printable_line_is_refused_and_not_sent(bad: str) -> None:
    # The servicer answers INVALID_ARGUMENT naming the field instead of storing it; the
    # agent never sends such a value (it would get its whole report refused).
    with pytest.raises(InvalidField, match=r"steps\[0\]\.wan_sync: must be printable"):
        steps(pb.ReportTaskStatusRequest(steps=[pb.StepMetrics(step=1, wan_sync=bad)]))
    sent = step_message({"step": 1, "seconds": {"step": 0.1}, "wan_sync": bad})
    assert sent is not None and not sent.HasField("wan_sync")
    [kept] = steps(pb.ReportTaskStatusRequest(steps=[sent]))
    assert kept.wan_sync is None


def test_an_empty_or_long_wan_sync_from_a_worker() -> None:
    [empty] = steps(pb.ReportTaskStatusRequest(steps=[pb.StepMetrics(step=1, wan_sync="")]))
    assert empty.wan_sync is None  # absent, not an empty label
    long = step_message({"step": 1, "seconds": {"step": 0.1}, "wan_sync": "é" * 500})
    assert long is not None
    [cut] = steps(pb.ReportTaskStatusRequest(steps=[long]))
    assert cut.wan_sync == "é" * MAX_WAN_SYNC
