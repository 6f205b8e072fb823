"""Running the workers of a launch order, and ending them on a stop order.

For each rank the order places on this agent's nodes, the agent starts the configured
worker command (placeholders `{python}`, `{plan}`, `{job}`, `{rank}`, `{job_id}`,
`{metrics}`, `{status}`) with the torch.distributed environment: MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK and LOCAL_RANK, plus CPN_JOB_ID, CPN_SITE, CPN_NODE, CPN_GPU,
CPN_STATUS_FILE, CUDA_VISIBLE_DEVICES for real GPUs, and the order's extra `env`.
Output goes to `<work dir>/<job id>/rank-<R>.log`.

A worker tells the agent how it is doing through either of two JSON-lines files, both
tailed:

- `$CPN_STATUS_FILE` (`{status}`): the agent's own format (agents/status.py): `step`,
  `loss`, `bytes` sent so far by link class, `checkpoint_id`, `message`;
- `{metrics}`: what `cpn worker --metrics` writes, one record per training step
  (`step` counted from 0, `loss`, and the `bytes` *that step* sent, by link class), which
  the agent turns into steps done and bytes so far.

Status goes out through `report` as `TaskUpdate`s: STARTING, RUNNING, then every change,
then SUCCEEDED / FAILED (exit code) or STOPPED.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agents.logs import LogTail, Outbox
from proto.cpn.v1 import agent_pb2 as pb

log = logging.getLogger("cpn.agent")

STATUS_POLL_S = 0.25
_ENDED = {pb.TASK_STATE_SUCCEEDED, pb.TASK_STATE_FAILED, pb.TASK_STATE_STOPPED}


@dataclass(frozen=True)
class TaskUpdate:
    job_id: str
    rank: int
    state: pb.TaskState.ValueType
    step: int = 0
    loss: float | None = None
    bytes_intra_node: int = 0
    bytes_intra_site: int = 0
    bytes_wan: int = 0
    checkpoint_id: str = ""
    exit_code: int = 0
    message: str = ""


@dataclass
class _Tail:
    """New complete JSON-object lines of a file that another process appends to."""

    path: Path
    offset: int = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []  # a line still being written
        self.offset += end + 1
        out = []
        for line in data[: end + 1].splitlines():
            try:
                fields = json.loads(line)
            except ValueError:
                continue
            if isinstance(fields, dict):
                out.append(fields)
        return out


@dataclass
class _Worker:
    rank: int
    node: str
    gpu: int
    process: asyncio.subprocess.Process
    status: _Tail
    metrics: _Tail
    last: TaskUpdate
    log: LogTail
    stopping: bool = False
    monitor: asyncio.Task[None] | None = None


@dataclass
class WorkerManager:
    site: str
    nodes: set[str]
    command: str
    work_dir: Path
    report: Callable[[TaskUpdate], None]
    real_gpus: bool = False
    stop_grace_s: float = 10.0
    #: Where new log lines and per-step records wait for the next report (agents/logs.py).
    outbox: Outbox = field(default_factory=Outbox)
    _jobs: dict[str, list[_Worker]] = field(default_factory=dict)

    def running(self, job_id: str) -> list[int]:
        return [w.rank for w in self._jobs.get(job_id, []) if w.process.returncode is None]

    def busy_gpus(self) -> set[tuple[str, int]]:
        out = set()
        for workers in self._jobs.values():
            for w in workers:
                if w.process.returncode is None:
                    out.add((w.node, w.gpu))
        return out

    async def launch(self, order: pb.LaunchOrder) -> list[int]:
        # Forget jobs whose workers have all ended (their status was reported).
        for job_id in [
            j for j, ws in self._jobs.items() if all(w.last.state in _ENDED for w in ws)
        ]:
            del self._jobs[job_id]
        mine = [r for r in order.ranks if r.site == self.site and r.node in self.nodes]
        if not mine:
            log.info("job %s: no ranks on this agent", order.job_id)
            return []
        if order.job_id in self._jobs and any(
            w.process.returncode is None for w in self._jobs[order.job_id]
        ):
            log.warning("job %s is already running here; launch order ignored", order.job_id)
            return []
        job_dir = self.work_dir / order.job_id
        job_dir.mkdir(parents=True, exist_ok=True)
        plan_path = job_dir / "plan.json"
        job_path = job_dir / "job.yaml"
        plan_path.write_text(order.plan_json)
        job_path.write_text(order.job_yaml)
        workers = []
        local_rank: dict[str, int] = {}
        for r in sorted(mine, key=lambda r: r.rank):
            local = local_rank.get(r.node, 0)
            local_rank[r.node] = local + 1
            worker = await self._start(order, r, local, job_dir, plan_path, job_path)
            if worker is not None:
                workers.append(worker)
        self._jobs[order.job_id] = workers
        return [w.rank for w in workers]

    async def _start(
        self,
        order: pb.LaunchOrder,
        r: pb.RankAssignment,
        local_rank: int,
        job_dir: Path,
        plan_path: Path,
        job_path: Path,
    ) -> _Worker | None:
        status_file = job_dir / f"rank-{r.rank}.status.jsonl"
        metrics_file = job_dir / f"rank-{r.rank}.metrics.jsonl"
        status_file.write_text("")
        metrics_file.write_text("")
        argv = shlex.split(
            self.command.format(
                python=shlex.quote(sys.executable),
                plan=shlex.quote(str(plan_path)),
                job=shlex.quote(str(job_path)),
                rank=r.rank,
                job_id=order.job_id,
                metrics=shlex.quote(str(metrics_file)),
                status=shlex.quote(str(status_file)),
            )
        )
        env = dict(os.environ)
        env.update(
            MASTER_ADDR=order.master_addr,
            MASTER_PORT=str(order.master_port),
            WORLD_SIZE=str(order.world_size),
            RANK=str(r.rank),
            LOCAL_RANK=str(local_rank),
            CPN_JOB_ID=order.job_id,
            CPN_SITE=r.site,
            CPN_NODE=r.node,
            CPN_GPU=str(r.gpu),
            CPN_STATUS_FILE=str(status_file),
        )
        if self.real_gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(r.gpu)
        env.update(dict(order.env))
        base = TaskUpdate(job_id=order.job_id, rank=r.rank, state=pb.TASK_STATE_STARTING)
        self.report(base)
        log_path = job_dir / f"rank-{r.rank}.log"
        try:
            with log_path.open("ab") as out:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    env=env,
                    cwd=job_dir,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True,  # its own process group: a stop ends its children
                )
        except OSError as exc:
            self.report(
                replace(
                    base, state=pb.TASK_STATE_FAILED, exit_code=127, message=f"cannot start: {exc}"
                )
            )
            return None
        running = replace(base, state=pb.TASK_STATE_RUNNING)
        self.report(running)
        worker = _Worker(
            rank=r.rank,
            node=r.node,
            gpu=r.gpu,
            process=process,
            status=_Tail(status_file),
            metrics=_Tail(metrics_file),
            last=running,
            log=LogTail(log_path),
        )
        worker.monitor = asyncio.create_task(self._monitor(worker), name=f"worker-{r.rank}")
        log.info("job %s rank %d started (pid %d): %s", order.job_id, r.rank, process.pid, argv)
        return worker

    def _read_status(self, worker: _Worker, final: bool = False) -> TaskUpdate | None:
        update = worker.last
        records = worker.metrics.read()
        for record in records:
            update = _merge_metrics(update, record)
        for fields in worker.status.read():
            update = _merge(update, fields)
        # New output and steps ride on the next report, even when the state is unchanged.
        forwarded = self.outbox.collect(update.job_id, update.rank, records, worker.log.read(final))
        return update if update != worker.last or forwarded else None

    async def _monitor(self, worker: _Worker) -> None:
        while worker.process.returncode is None:
            update = self._read_status(worker)
            if update is not None:
                worker.last = update
                self.report(update)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.process.wait(), STATUS_POLL_S)
        code = worker.process.returncode
        last = self._read_status(worker, final=True) or worker.last
        if worker.stopping:
            final = replace(last, state=pb.TASK_STATE_STOPPED, exit_code=code)
        elif code == 0:
            final = replace(last, state=pb.TASK_STATE_SUCCEEDED, exit_code=0)
        else:
            final = replace(
                last, state=pb.TASK_STATE_FAILED, exit_code=code, message=f"exited with {code}"
            )
        worker.last = final
        self.report(final)
        log.info(
            "job %s rank %d ended: %s", final.job_id, final.rank, pb.TaskState.Name(final.state)
        )

    async def stop(self, job_id: str, reason: str = "") -> int:
        """SIGTERM the job's workers (their process groups), SIGKILL after the grace."""
        workers = [w for w in self._jobs.get(job_id, []) if w.process.returncode is None]
        for w in workers:
            w.stopping = True
            _signal_group(w.process, signal.SIGTERM)
        if workers:
            log.info(
                "job %s: stopping %d workers (%s)", job_id, len(workers), reason or "stop order"
            )
        for w in workers:
            try:
                await asyncio.wait_for(w.process.wait(), self.stop_grace_s)
            except TimeoutError:
                _signal_group(w.process, signal.SIGKILL)
                await w.process.wait()
        for w in workers:
            if w.monitor is not None:
                await w.monitor
        return len(workers)

    async def stop_all(self) -> None:
        for job_id in list(self._jobs):
            await self.stop(job_id, "agent shutting down")


def _signal_group(process: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def _merge(update: TaskUpdate, fields: dict[str, Any]) -> TaskUpdate:
    changes: dict[str, Any] = {}
    if isinstance(fields.get("step"), int):
        changes["step"] = max(0, fields["step"])
    if isinstance(fields.get("loss"), int | float):
        changes["loss"] = float(fields["loss"])
    sent = fields.get("bytes")
    if isinstance(sent, dict):
        for key in ("intra_node", "intra_site", "wan"):
            if isinstance(sent.get(key), int):
                changes[f"bytes_{key}"] = max(0, sent[key])
    if isinstance(fields.get("checkpoint_id"), str):
        changes["checkpoint_id"] = fields["checkpoint_id"][:256]
    if isinstance(fields.get("message"), str):
        changes["message"] = fields["message"][:4096]
    return replace(update, **changes)


def _merge_metrics(update: TaskUpdate, record: dict[str, Any]) -> TaskUpdate:
    """One `cpn worker --metrics` record: step `n` done means n + 1 steps; bytes are that
    step's, added to the running totals."""
    changes: dict[str, Any] = {}
    if isinstance(record.get("step"), int):
        changes["step"] = max(update.step, record["step"] + 1)
    if isinstance(record.get("loss"), int | float):
        changes["loss"] = float(record["loss"])
    sent = record.get("bytes")
    if isinstance(sent, dict):
        for key in ("intra_node", "intra_site", "wan"):
            if isinstance(sent.get(key), int):
                field_name = f"bytes_{key}"
                changes[field_name] = getattr(update, field_name) + max(0, sent[key])
    return replace(update, **changes)
