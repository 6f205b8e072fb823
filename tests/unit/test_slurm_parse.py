"""The Slurm backend's readers and its state table on recorded outputs of two Slurm
versions: 22.05.8 (this host's Debian Slurm) and 24.11.5 (Debian 13's, run from a private
prefix), both recorded by tests/fixtures/slurm/record.py, plus the 23.11 JSON shape
reconstructed from the 22.05 recording (see tests/fixtures/slurm/README.md for how each
was made). Every state cpn maps is read from each recording's `squeue --json`, `squeue`
text, `scontrol -o show job` and jobcomp log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agents.backends import BackendError, State
from agents.backends.slurm import SLURM_STATES, SlurmBackend, SlurmOptions, slurm_status
from agents.backends.slurm_parse import (
    SlurmJob,
    SlurmOutputError,
    gres_gpus,
    job_from_json,
    key_values,
    parse_jobcomp,
    parse_nodes,
    parse_scontrol_jobs,
    parse_squeue_json,
    parse_squeue_text,
    slurm_minutes,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "slurm"
V22, V24, V23 = FIXTURES / "22.05.8", FIXTURES / "24.11.5", FIXTURES / "23.11"
RECORDED = pytest.mark.parametrize("version", [V22, V24], ids=["22.05.8", "24.11.5"])

#: What each recorded job is (ids.txt) and the cpn state and Slurm state it must read as,
#: with the exit code its status carries.
EXPECTED = {
    "done": (State.SUCCEEDED, "COMPLETED", 0),
    "failed": (State.FAILED, "FAILED", 3),
    "cancelled": (State.CANCELLED, "CANCELLED", 0),
    "timeout": (State.FAILED, "TIMEOUT", 0),
    "lost": (State.NODE_LOST, "NODE_FAIL", 0),
    "preempted": (State.PREEMPTED, "PREEMPTED", 0),
    "urgent": (State.RUNNING, "RUNNING", None),
    "pending": (State.PENDING, "PENDING", None),
}
#: The signal Slurm reports per job, where not 0: SIGTERM for the ones it ended, and on
#: 24.11 SIGHUP (`ExitCode=0:1`) for the job of the node that died.
SIGNALS = {
    V22: {"cancelled": 15, "timeout": 15, "preempted": 15},
    V24: {"cancelled": 15, "timeout": 15, "preempted": 15, "lost": 1},
}


def _ids(version: Path) -> dict[str, str]:
    return dict(line.split() for line in (version / "ids.txt").read_text().splitlines())


def _json_all(version: Path) -> dict[str, SlurmJob]:
    """Every recorded job from JSON: 22.05's `squeue --json` prints all of them, 23.02+
    apply squeue's default filter (squeue-all.json is `squeue --json -t all`)."""
    path = version / "squeue-all.json"
    text = (path if path.exists() else version / "squeue.json").read_text()
    return {j.job_id: j for j in parse_squeue_json(text)}


def _check(job: SlurmJob, what: str, exit_code: bool = True) -> None:
    """`job` is the recorded job `what` and maps to its cpn state (and exit code, where
    the form carries one: squeue's text does not)."""
    state, native, code = EXPECTED[what]
    assert job.name == f"cpn-{what}-e0"
    assert job.state == native, what
    status = slurm_status(job)
    assert status.state is state, what
    assert status.native == native
    assert status.restarts == 0
    if exit_code:
        assert status.exit_code == code, what


@pytest.mark.parametrize("version", [V22, V24, V23], ids=["22.05.8", "24.11.5", "23.11-rebuilt"])
def test_every_state_from_squeue_json(version: Path) -> None:
    jobs = _json_all(version)
    signals = SIGNALS.get(version, SIGNALS[V22])
    for what, job_id in _ids(V22 if version == V23 else version).items():
        _check(jobs[job_id], what)
        assert jobs[job_id].signal == signals.get(what, 0), what
    assert jobs["1"].comment == "cpn/done/0/agent-a"
    assert jobs["8"].reason == "Resources"
    assert jobs["5"].reason == "NodeDown"
    hup = " (signal 1)" if "lost" in signals else ""
    assert slurm_status(jobs["5"]).reason == f"Slurm job 5 NODE_FAIL: NodeDown{hup}"


def test_plain_squeue_json_shows_only_active_jobs_from_23_02_on() -> None:
    """Plain `squeue --json`: 22.05 prints every job, 24.11 only pending and running
    ones, which is why the backend asks for `squeue --json -t all` (squeue-all.json)."""
    ids = _ids(V24)
    jobs = {j.job_id for j in parse_squeue_json((V24 / "squeue.json").read_text())}
    assert jobs == {ids["urgent"], ids["pending"]}
    assert len(parse_squeue_json((V22 / "squeue.json").read_text())) == len(_ids(V22))


@RECORDED
def test_every_state_from_text_forms(version: Path) -> None:
    """squeue's text, scontrol -o show job and the jobcomp log (no slurmdbd) read as the
    same states, mapped the same way, as the JSON."""
    by_json = _json_all(version)
    by_text = {j.job_id: j for j in parse_squeue_text((version / "squeue.txt").read_text())}
    by_scontrol = {
        j.job_id: j for j in parse_scontrol_jobs((version / "scontrol-jobs.txt").read_text())
    }
    jobcomp = (version / "jobcomp.txt").read_text()
    for what, job_id in _ids(version).items():
        job = by_json[job_id]
        _check(by_text[job_id], what, exit_code=False)
        _check(by_scontrol[job_id], what)
        assert by_text[job_id].reason == job.reason
        assert by_scontrol[job_id].exit_code == job.exit_code
        assert by_scontrol[job_id].signal == job.signal
        assert by_scontrol[job_id].comment == job.comment
        assert by_scontrol[job_id].work_dir == job.work_dir
        ended = parse_jobcomp(jobcomp, job_id)
        if job.state in ("RUNNING", "PENDING"):
            assert ended is None
        else:
            assert ended is not None
            _check(ended, what)
            assert ended.exit_code == job.exit_code
    assert by_scontrol[_ids(version)["done"]].comment == "cpn/done/0/agent-a"


def test_23_11_state_lists_with_flags() -> None:
    jobs = {j.job_id: j for j in parse_squeue_json((V23 / "squeue.json").read_text())}
    completing = jobs["9"]
    assert (completing.state, completing.flags) == ("CANCELLED", ("COMPLETING",))
    assert completing.native == "CANCELLED+COMPLETING"
    assert slurm_status(completing).state is State.CANCELLED


def test_every_slurm_state_has_a_mapping_and_unknown_ones_are_unknown() -> None:
    for native in ("COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL"):
        assert native in SLURM_STATES
    job = parse_squeue_json('{"jobs": [{"job_id": 1, "job_state": ["SOMETHING_NEW"]}]}')[0]
    assert slurm_status(job).state is State.UNKNOWN
    assert slurm_status(job).native == "SOMETHING_NEW"


@RECORDED
def test_nodes_partitions_and_gres(version: Path) -> None:
    nodes = {n.name: n for n in parse_nodes((version / "scontrol-nodes.txt").read_text())}
    assert sorted(nodes) == ["node1", "node2", "node3", "node4"]
    assert nodes["node1"].gpus == 2 and nodes["node1"].address == "127.0.0.1"
    assert {"cpn", "urgent"} <= set(nodes["node1"].partitions)
    # node4's slurmd was killed: `DOWN+NOT_RESPONDING`; 24.11's node1 and node2, held for
    # the pending job, read `IDLE+PLANNED` and are usable
    assert nodes["node4"].state.startswith("DOWN") and not nodes["node4"].usable
    assert all(nodes[n].usable for n in ("node1", "node2", "node3"))
    assert version != V24 or nodes["node1"].state == "IDLE+PLANNED"
    lines = (version / "scontrol-partitions.txt").read_text().splitlines()
    parts = {f["PartitionName"]: f for f in map(key_values, lines) if f}
    assert parts["cpn"]["Nodes"] == "node[1-4]" and parts["cpn"]["State"] == "UP"
    assert parts["urgent"]["PriorityTier"] == "10"


def test_gres_and_key_values() -> None:
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
    ],
)  # fmt: skip
def test_bad_json_is_one_clear_error(text: str, error: str) -> None:
    with pytest.raises(SlurmOutputError, match=error):
        parse_squeue_json(text)


def test_a_job_it_cannot_read_does_not_hide_the_others() -> None:
    """squeue lists every user's jobs: one with a state this parser cannot read is left
    out, the others kept (outside review: one odd job failed the whole queue, every cpn
    job's poll with it, for as long as it stayed queued)."""
    queue = json.loads((V24 / "squeue-all.json").read_text())
    readable = {j.job_id for j in parse_squeue_json(json.dumps(queue))}
    first = queue["jobs"][0]
    odd = [dict(first, job_id=999_999, job_state=[]), dict(first, job_id=999_998, job_state=7)]
    queue["jobs"] = odd + queue["jobs"]
    assert {j.job_id for j in parse_squeue_json(json.dumps(queue))} == readable
    with pytest.raises(SlurmOutputError, match="job_state"):
        job_from_json(odd[0])


def test_a_line_it_cannot_read_does_not_hide_the_others_in_text_form() -> None:
    """The text form (clusters without squeue --json) keeps the same promise."""
    good = "42|cpn-job-1-e1|RUNNING|None|node1|cpn/job-1/1/site-s"
    text = "\n".join(["7|someone's job|PENDING", good, "8|x|+|None||", ""])
    (job,) = parse_squeue_text(text)
    assert (job.job_id, job.state, job.comment) == ("42", "RUNNING", "cpn/job-1/1/site-s")


@given(
    st.integers(0, 400), st.integers(0, 23), st.integers(0, 59), st.integers(0, 59),
    st.sampled_from(["d-h:m:s", "d-h:m", "d-h", "h:m:s", "m:s", "m"]),
)  # fmt: skip
def test_every_form_of_a_slurm_duration(d: int, h: int, m: int, s: int, form: str) -> None:
    """`man sbatch`'s forms of --time, as scontrol prints a partition's MaxTime."""
    text = {
        "d-h:m:s": f"{d}-{h:02}:{m:02}:{s:02}",
        "d-h:m": f"{d}-{h}:{m}",
        "d-h": f"{d}-{h}",
        "h:m:s": f"{h}:{m:02}:{s:02}",
        "m:s": f"{m}:{s}",
        "m": f"{m}",
    }[form]
    want = {
        "d-h:m:s": d * 1440 + h * 60 + m + s / 60,
        "d-h:m": d * 1440 + h * 60 + m,
        "d-h": d * 1440 + h * 60,
        "h:m:s": h * 60 + m + s / 60,
        "m:s": m + s / 60,
        "m": m,
    }[form]
    assert slurm_minutes(text) == want


@pytest.mark.parametrize("text", ["UNLIMITED", "INFINITE", "infinite"])
def test_no_time_limit(text: str) -> None:
    assert slurm_minutes(text) is None


@pytest.mark.parametrize("text", ["", "1:2:3:4", "-1", "1-", "a", "1.5", "1-2-3"])
def test_a_duration_slurm_never_prints_is_an_error(text: str) -> None:
    with pytest.raises(SlurmOutputError, match="not a Slurm duration"):
        slurm_minutes(text)


@pytest.mark.parametrize(
    ("max_time", "wanted", "said"),
    [
        ("00:01:00", 61, "pass --time-limit 60 or less"),
        ("1-00:00:00", 86401, "pass --time-limit 86400 or less"),
        ("00:00:00", 60, "no launch fits"),  # the agent's least --time-limit is 60 s
    ],
)
def test_a_time_limit_above_the_partitions_max_time_says_what_fits(
    max_time: str, wanted: int, said: str
) -> None:
    backend = SlurmBackend(SlurmOptions("p", time_limit_s=wanted), "agent")
    backend._partition = {"PartitionName": "p", "MaxTime": max_time}
    with pytest.raises(BackendError, match=f"allows {max_time} \\(MaxTime\\).*; {said}$"):
        backend._check_time_limit()
    backend._partition["MaxTime"] = "UNLIMITED"
    backend._check_time_limit()  # no limit: nothing to refuse
