"""The Slurm backend's readers and its state table on recorded outputs: Slurm 22.05.8
(recorded on this host, tests/fixtures/slurm/22.05.8) and the 23.11 JSON shape
(tests/fixtures/slurm/23.11; see the README there for how each was made)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.backends import State
from agents.backends.slurm import SLURM_STATES, slurm_status
from agents.backends.slurm_parse import (
    SlurmOutputError,
    gres_gpus,
    key_values,
    parse_jobcomp,
    parse_nodes,
    parse_scontrol_jobs,
    parse_squeue_json,
    parse_squeue_text,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "slurm"
V22, V23 = FIXTURES / "22.05.8", FIXTURES / "23.11"

#: What each recorded job is (ids.txt) and the cpn state, Slurm state, exit code and
#: signal it must read as.
EXPECTED = {
    "done": (State.SUCCEEDED, "COMPLETED", 0, 0),
    "failed": (State.FAILED, "FAILED", 3, 0),
    "cancelled": (State.CANCELLED, "CANCELLED", 0, 15),
    "timeout": (State.FAILED, "TIMEOUT", 0, 15),
    "lost": (State.NODE_LOST, "NODE_FAIL", 0, 0),
    "preempted": (State.PREEMPTED, "PREEMPTED", 0, 15),
    "urgent": (State.RUNNING, "RUNNING", None, 0),
    "pending": (State.PENDING, "PENDING", None, 0),
}


def _ids() -> dict[str, str]:
    return dict(line.split() for line in (V22 / "ids.txt").read_text().splitlines())


@pytest.mark.parametrize("version", [V22, V23], ids=["22.05", "23.11"])
def test_every_state_from_squeue_json(version: Path) -> None:
    jobs = {j.job_id: j for j in parse_squeue_json((version / "squeue.json").read_text())}
    for what, job_id in _ids().items():
        state, native, code, signal = EXPECTED[what]
        job = jobs[job_id]
        assert job.name == f"cpn-{what}-e0"
        assert job.state == native, what
        status = slurm_status(job)
        assert status.state is state, what
        assert status.native == native
        assert status.exit_code == code, what
        assert job.signal == signal, what
        assert status.restarts == 0
    assert jobs["1"].comment == "cpn/done/0/agent-a"
    assert jobs["8"].reason == "Resources"
    assert jobs["5"].reason == "NodeDown"
    assert slurm_status(jobs["5"]).reason == "Slurm job 5 NODE_FAIL: NodeDown"


def test_23_11_state_lists_with_flags() -> None:
    jobs = {j.job_id: j for j in parse_squeue_json((V23 / "squeue.json").read_text())}
    completing = jobs["9"]
    assert (completing.state, completing.flags) == ("CANCELLED", ("COMPLETING",))
    assert completing.native == "CANCELLED+COMPLETING"
    assert slurm_status(completing).state is State.CANCELLED


def test_text_forms_agree_with_json() -> None:
    """squeue's text, scontrol -o show job and the jobcomp log (no slurmdbd) read as the
    same states as the JSON."""
    by_json = {j.job_id: j for j in parse_squeue_json((V22 / "squeue.json").read_text())}
    by_text = {j.job_id: j for j in parse_squeue_text((V22 / "squeue.txt").read_text())}
    by_scontrol = {
        j.job_id: j for j in parse_scontrol_jobs((V22 / "scontrol-jobs.txt").read_text())
    }
    jobcomp = (V22 / "jobcomp.txt").read_text()
    for job_id, job in by_json.items():
        assert by_text[job_id].state == job.state
        assert by_scontrol[job_id].state == job.state
        assert by_scontrol[job_id].exit_code == job.exit_code
        assert by_scontrol[job_id].signal == job.signal
        assert by_scontrol[job_id].comment == job.comment
        assert by_scontrol[job_id].work_dir == job.work_dir
        ended = parse_jobcomp(jobcomp, job_id)
        if job.state in ("RUNNING", "PENDING"):
            assert ended is None
        else:
            assert ended is not None and ended.state == job.state
            assert ended.exit_code == job.exit_code


def test_every_slurm_state_has_a_mapping_and_unknown_ones_are_unknown() -> None:
    for native in ("COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL"):
        assert native in SLURM_STATES
    job = parse_squeue_json('{"jobs": [{"job_id": 1, "job_state": ["SOMETHING_NEW"]}]}')[0]
    assert slurm_status(job).state is State.UNKNOWN
    assert slurm_status(job).native == "SOMETHING_NEW"


def test_nodes_and_gres() -> None:
    nodes = {n.name: n for n in parse_nodes((V22 / "scontrol-nodes.txt").read_text())}
    assert sorted(nodes) == ["node1", "node2", "node3", "node4"]
    assert nodes["node1"].gpus == 2 and nodes["node1"].address == "127.0.0.1"
    assert nodes["node1"].partitions == ("cpn", "urgent")
    assert nodes["node4"].state.startswith("DOWN") and not nodes["node4"].usable
    assert all(nodes[n].usable for n in ("node1", "node2", "node3"))
    assert gres_gpus("gpu:a100:8(S:0-1)") == (8, "a100")
    assert gres_gpus("gpu:a100:4,gpu:h100:4") == (8, "a100")
    assert gres_gpus("(null)") == (0, "")
    assert key_values("JobId=3 Comment=two words here WorkDir=/x") == {
        "JobId": "3",
        "Comment": "two words here",
        "WorkDir": "/x",
    }


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("not json", "not JSON"),
        ('{"meta": {}}', "no 'jobs' list"),
        ('{"jobs": [], "errors": [{"description": "Unable to contact slurm controller"}]}',
         "Unable to contact"),
        ('{"jobs": [{"job_id": 1, "job_state": 7}]}', "job_state"),
    ],
)  # fmt: skip
def test_bad_json_is_one_clear_error(text: str, error: str) -> None:
    with pytest.raises(SlurmOutputError, match=error):
        parse_squeue_json(text)
