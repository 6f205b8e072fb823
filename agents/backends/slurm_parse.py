"""What Slurm's commands print, read into plain data — pure functions, tested on recorded
outputs of two Slurm versions, 22.05.8 and 24.11.5 (tests/fixtures/slurm/).

Slurm's JSON changed between versions, and the readers accept both shapes:

  field          22.05 (openapi v0.0.38)        23.02 and later (data_parser v0.0.39+)
  job_state      "RUNNING"                      ["RUNNING"] or ["RUNNING", "COMPLETING"]
  exit_code      768 (a wait status: 3 << 8)    {"status": [...], "return_code": {"set":
                                                  true, "number": 7}, "signal": {...}}
  numbers        2                              {"set": true, "infinite": false, "number": 2}

22.05's `squeue --json` also ignores squeue's filters (-j, --name): every job comes back
and the caller picks its own. 23.02+ apply them, the default one too: plain `squeue
--json` there shows only pending and running jobs (24.11.5 recorded), so the backend
asks for `-t all`. 24.11 leaves `return_code` unset
for a job ended by a signal; it reads as 0, as its `ExitCode=0:15` does. Where JSON is
missing (`squeue: unrecognized option '--json'`, before 21.08) the text forms are read:
`squeue -h -o`, `scontrol -o show job`, and the job-completion log (`jobcomp/filetxt`),
none of which need slurmdbd.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

#: Slurm's job states that are not ends (the rest are, as Slurm's own IS_JOB_FINISHED).
ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "RESIZING",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
    }
)
#: Flags that ride in a state list (23.02+) or after a '+' (text), never a base state.
STATE_FLAGS = frozenset(
    {
        "COMPLETING",
        "CONFIGURING",
        "REQUEUED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "LAUNCH_FAILED",
        "UPDATE_DB",
        "RECONFIG_FAIL",
        "POWER_UP_NODE",
        "REVOKED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "SPECIAL_EXIT",
        "STOPPED",
        "RESV_DEL_HOLD",
    }
)


class SlurmOutputError(ValueError):
    """A Slurm command printed something this module cannot read."""


@dataclass(frozen=True)
class SlurmJob:
    """One Slurm job as cpn needs it, whatever command and version it came from."""

    job_id: str
    name: str
    state: str  # the base state: PENDING, RUNNING, COMPLETED, NODE_FAIL, ...
    flags: tuple[str, ...] = ()  # COMPLETING, CONFIGURING, ... (state flags)
    reason: str = ""  # state_reason: None, Resources, Priority, NodeDown, ...
    exit_code: int | None = None  # the batch script's return code
    signal: int = 0  # the signal that ended it, if any
    restarts: int = 0
    comment: str = ""
    nodes: str = ""  # hostlist expression
    work_dir: str = ""
    partition: str = ""

    @property
    def native(self) -> str:
        """Slurm's words, flags included (RUNNING+COMPLETING)."""
        return "+".join((self.state, *self.flags))


@dataclass(frozen=True)
class SlurmNode:
    name: str
    address: str
    gpus: int
    state: str  # IDLE, MIXED, ALLOCATED, DOWN*, IDLE+DRAIN, ...
    partitions: tuple[str, ...] = field(default_factory=tuple)
    gpu_type: str = ""

    @property
    def usable(self) -> bool:
        """Up and accepting work: not down, drained or draining, failing, powered off,
        not responding (`*`), or FUTURE."""
        bad = ("DOWN", "DRAIN", "FAIL", "POWER", "FUTURE", "NOT_RESPONDING", "REBOOT", "MAINT")
        return not self.state.endswith("*") and not any(b in self.state for b in bad)


# ---------------------------------------------------------------------------- JSON


def _number(value: Any) -> int | None:
    """A plain number (22.05) or {"set", "infinite", "number"} (23.02+)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        return int(value)
    if isinstance(value, dict):
        if value.get("set") is False or value.get("infinite") is True:
            return None
        return _number(value.get("number"))
    return None


def _states(value: Any) -> tuple[str, tuple[str, ...]]:
    """(base state, flags) from `job_state`: a string (22.05) or a list (23.02+)."""
    if isinstance(value, str):
        names = [s for s in value.split("+") if s]
    elif isinstance(value, list) and all(isinstance(s, str) for s in value):
        names = list(value)
    else:
        raise SlurmOutputError(f"job_state: expected a string or a list, got {value!r:.60}")
    base = [s for s in names if s not in STATE_FLAGS]
    flags = tuple(s for s in names if s in STATE_FLAGS)
    if base:
        return base[0], flags
    if flags:  # a state that is only a flag (CONFIGURING alone, say)
        return flags[0], flags[1:]
    raise SlurmOutputError("job_state: empty")


def _exit(value: Any) -> tuple[int | None, int]:
    """(return code, signal) from `exit_code`: a wait status (22.05: exit 3 is 768, SIGTERM
    is 15) or a dict (23.02+)."""
    if isinstance(value, dict):
        code = _number(value.get("return_code"))
        sig = value.get("signal")
        signo = _number(sig.get("id") if isinstance(sig, dict) else None) or 0
        if code is None and signo:  # 24.11 leaves return_code unset for a signalled job;
            code = 0  # its `ExitCode=0:15` and 22.05's wait status both read as 0
        return code, signo
    status = _number(value)
    if status is None:
        return None, 0
    return (status >> 8) & 0xFF, status & 0x7F


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):  # 23.02+ nests the comment: {"job": ..., "admin": ...}
        return str(value.get("job") or "")
    return ""


def _reason(value: Any) -> str:
    """`state_reason`, "" for Slurm's "None" (as the text forms read it)."""
    return "" if value in (None, "None") else str(value)


def job_from_json(doc: dict[str, Any]) -> SlurmJob:
    if "job_id" not in doc:
        raise SlurmOutputError("a job without job_id")
    state, flags = _states(doc.get("job_state"))
    code, signo = _exit(doc.get("exit_code"))
    return SlurmJob(
        job_id=str(_number(doc["job_id"])),
        name=str(doc.get("name") or ""),
        state=state,
        flags=flags,
        reason=_reason(doc.get("state_reason")),
        exit_code=code,
        signal=signo,
        restarts=_number(doc.get("restart_cnt")) or 0,
        comment=_text(doc.get("comment")),
        nodes=str(doc.get("nodes") or ""),
        work_dir=str(doc.get("current_working_directory") or ""),
        partition=str(doc.get("partition") or ""),
    )


def parse_squeue_json(text: str) -> list[SlurmJob]:
    """Every job of `squeue --json` (any version from 22.05 on)."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise SlurmOutputError(f"squeue --json: not JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise SlurmOutputError("squeue --json: no 'jobs' list")
    errors = [e for e in doc.get("errors") or [] if e]
    if errors:
        first = errors[0]
        what = first.get("description") or first.get("error") if isinstance(first, dict) else first
        raise SlurmOutputError(f"squeue --json: {what}")
    # squeue lists every user's jobs: one it cannot read (a state of a newer Slurm, say)
    # is left out rather than failing the whole queue, cpn's jobs with it.
    out = []
    for j in doc["jobs"]:
        if isinstance(j, dict):
            try:
                out.append(job_from_json(j))
            except SlurmOutputError:
                continue
    return out


# ---------------------------------------------------------------------------- text

_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:.]*)=")


def key_values(line: str) -> dict[str, str]:
    """`Key=Value Key2=Value with spaces` (scontrol -o, jobcomp/filetxt) → dict.

    A value runs to the next ` Key=`, so values with spaces (Comment, OS) survive."""
    marks = list(_KEY.finditer(line))
    out: dict[str, str] = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(line)
        out.setdefault(m.group(1), line[m.end() : end].strip())
    return out


def _exit_text(value: str) -> tuple[int | None, int]:
    """`ExitCode=2:0` → (2, 0); `0:15` → (0, 15)."""
    code, _, sig = value.partition(":")
    try:
        return int(code), int(sig or 0)
    except ValueError:
        return None, 0


def job_from_text(fields: dict[str, str]) -> SlurmJob:
    """A job from `scontrol -o show job` or a jobcomp/filetxt line."""
    if "JobId" not in fields or "JobState" not in fields:
        raise SlurmOutputError("no JobId/JobState in the line")
    state, flags = _states(fields["JobState"])
    code, signo = _exit_text(fields.get("ExitCode", ""))
    restarts = fields.get("Restarts", "0")
    return SlurmJob(
        job_id=fields["JobId"],
        name=fields.get("JobName", fields.get("Name", "")),
        state=state,
        flags=flags,
        reason="" if fields.get("Reason") in (None, "None") else fields["Reason"],
        exit_code=code,
        signal=signo,
        restarts=int(restarts) if restarts.isdigit() else 0,
        comment="" if fields.get("Comment") == "(null)" else fields.get("Comment", ""),
        nodes=fields.get("NodeList", ""),
        work_dir=fields.get("WorkDir", ""),
        partition=fields.get("Partition", ""),
    )


def parse_scontrol_jobs(text: str) -> list[SlurmJob]:
    """`scontrol -o show job [ID]`: one job per line."""
    return [job_from_text(key_values(line)) for line in text.splitlines() if line.strip()]


def parse_jobcomp(text: str, job_id: str) -> SlurmJob | None:
    """The last record of job `job_id` in a jobcomp/filetxt log (None if absent)."""
    found = None
    for line in text.splitlines():
        if line.startswith(f"JobId={job_id} "):
            found = job_from_text(key_values(line))
    return found


_SQUEUE_FORMAT = "%i|%j|%T|%r|%N|%k"
SQUEUE_TEXT_ARGS = ("-h", "-o", _SQUEUE_FORMAT)


def parse_squeue_text(text: str) -> list[SlurmJob]:
    """`squeue -h -o '%i|%j|%T|%r|%N|%k'` (before JSON existed): no exit codes there.

    squeue lists every user's jobs: a line this parser cannot read (too few fields, a
    state it does not know the form of) is left out rather than failing the whole queue,
    every cpn job's poll with it, as `parse_squeue_json` does.
    """
    jobs = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|", 5)
        if len(parts) != 6:
            continue
        job_id, name, state, reason, nodes, comment = parts
        try:
            base, flags = _states(state)
        except SlurmOutputError:
            continue
        jobs.append(
            SlurmJob(
                job_id=job_id,
                name=name,
                state=base,
                flags=flags,
                reason="" if reason == "None" else reason,
                nodes=nodes,
                comment="" if comment == "(null)" else comment,
            )
        )
    return jobs


_GPU_GRES = re.compile(r"(?:^|,)gpu(?::([A-Za-z0-9_.\-]+))?:(\d+)")


def gres_gpus(gres: str) -> tuple[int, str]:
    """GPUs in a node's `Gres=` (`gpu:4`, `gpu:a100:8(S:0-1)`, `gpu:a100:4,gpu:h100:4`)
    and the first type named ('' if none)."""
    total, kind = 0, ""
    for m in _GPU_GRES.finditer(gres):
        total += int(m.group(2))
        kind = kind or (m.group(1) or "")
    return total, kind


def parse_nodes(text: str) -> list[SlurmNode]:
    """`scontrol -o show node`: one node per line."""
    nodes = []
    for line in text.splitlines():
        if not line.strip():
            continue
        f = key_values(line)
        if "NodeName" not in f:
            raise SlurmOutputError(f"scontrol show node: no NodeName in {line!r:.80}")
        gpus, kind = gres_gpus(f.get("Gres", ""))
        parts = f.get("Partitions", "")
        nodes.append(
            SlurmNode(
                name=f["NodeName"],
                address=f.get("NodeAddr", f["NodeName"]),
                gpus=gpus,
                state=f.get("State", "UNKNOWN"),
                partitions=tuple(p for p in parts.split(",") if p and p != "(null)"),
                gpu_type=kind,
            )
        )
    return nodes


_DURATION = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def slurm_minutes(text: str) -> float | None:
    """A Slurm time limit in minutes (None: no limit), in the forms `man sbatch` gives
    for --time: "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
    "days-hours:minutes", "days-hours:minutes:seconds"; "UNLIMITED"/"INFINITE" is none.
    Raises SlurmOutputError on anything else."""
    value = text.strip()
    if value.upper() in ("UNLIMITED", "INFINITE", "NONE"):
        return None
    found = _DURATION.match(value)
    if found is None:
        raise SlurmOutputError(f"time limit {value!r:.40}: not a Slurm duration")
    days, a, b, c = found.groups()
    if days is not None:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = int(a), int(b or 0), int(c or 0)
        return int(days) * 1440 + hours * 60 + minutes + seconds / 60
    if c is not None:  # hours:minutes:seconds
        return int(a) * 60 + int(b) + int(c) / 60
    return int(a) + int(b or 0) / 60  # minutes[:seconds]
