"""How the agent reads its workers' progress: both line formats, partial lines."""

from __future__ import annotations

import json
from pathlib import Path

from agents.tasks import TaskUpdate, with_metrics, with_status_line
from cpn.train.tail import FileTail
from proto.cpn.v1 import agent_pb2 as pb

START = TaskUpdate(job_id="j", rank=0, state=pb.TASK_STATE_RUNNING)


def test_runtime_metrics_add_up_per_step_bytes() -> None:
    update = START
    for step in range(3):  # what `cpn worker --metrics` writes after each step
        record = {
            "step": step,
            "loss": 5.0 - step,
            "bytes": {"intra_node": 1, "intra_site": 10, "wan": 100},
        }
        update = with_metrics(update, record)
    assert (update.step, update.loss) == (3, 3.0)
    assert (update.bytes_intra_node, update.bytes_intra_site, update.bytes_wan) == (3, 30, 300)
    # A stage without the loss (not the last pipeline stage) reports None: keep the last one.
    assert with_metrics(update, {"step": 3, "loss": None, "bytes": {}}).loss == 3.0


def test_status_lines_are_totals_and_override_field_by_field() -> None:
    update = with_status_line(START, {"step": 7, "bytes": {"wan": 4096}, "checkpoint_id": "ckpt-7"})
    update = with_status_line(update, {"loss": 1.5, "bytes": {"wan": 8192}})
    assert (update.step, update.loss, update.bytes_wan, update.checkpoint_id) == (
        7,
        1.5,
        8192,
        "ckpt-7",
    )
    assert (
        with_status_line(update, {"step": "seven", "loss": "low"}) == update
    )  # wrong types are ignored


def test_a_tail_returns_complete_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "status.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2')
    tail = FileTail(path)
    assert tail.records() == [{"step": 1}]
    with path.open("a") as fh:
        fh.write("}\nnot json\n[1, 2]\n")
    assert tail.records() == [{"step": 2}]  # garbage and non-objects are skipped
    assert tail.records() == []
