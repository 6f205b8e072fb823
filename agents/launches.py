"""Running the workers a launch order puts on this node, and ending them on a stop order.

For each order the agent starts one `cpn launch` process (cpn/train/launcher.py: torch's
elastic agent, c10d rendezvous at the order's endpoint, one node of the run) for the plan
ranks on its node, in its own session so that a stop reaches all of it. The launcher
starts the workers with the torch.distributed environment plus CPN_PLAN_RANKS,
CPN_JOB_ID, CPN_SITE, CPN_NODE, CPN_RUN_DIR, CUDA_VISIBLE_DEVICES (real GPUs, in local-rank
order) and the order's extra `env`; a worker that fails ends the node's others within
seconds, and the launcher writes what failed to `result.json`.

Files per plan rank in `<work dir>/<job id>/` (the launcher's run directory): `rank-R.log`
(output), `rank-R.metrics.jsonl` (`cpn worker`'s per-step records) and, for workers of
other kinds, `rank-R.status.jsonl` (agents/status.py). The agent follows them as they grow
and reports STARTING (the launcher is up, the rendezvous may still be waiting for other
nodes), RUNNING (the worker process exists: its log file was opened), every change, then
SUCCEEDED / FAILED / STOPPED per rank (agents/tasks.py), with new log lines and steps on
the way (agents/logs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agents.logs import Outbox, new_lines
from agents.status import status_file
from agents.tasks import TaskUpdate, with_metrics, with_status_line
from cpn.train.launcher import RunFiles
from cpn.train.tail import FileTail
from proto.cpn.v1 import agent_pb2 as pb

log = logging.getLogger("cpn.agent")

STATUS_POLL_S = 0.25


@dataclass
class _Rank:
    """One plan rank of a launch, as the agent follows it."""

    rank: int
    gpu: int
    metrics: FileTail
    status: FileTail
    log: FileTail
    last: TaskUpdate


@dataclass
class _Launch:
    job_id: str
    node: str
    process: asyncio.subprocess.Process
    files: RunFiles
    ranks: list[_Rank]
    stopping: bool = False
    stop_reason: str = ""
    monitor: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.process.returncode is None


@dataclass
class LaunchManager:
    site: str
    node: str
    work_dir: Path
    report: Callable[[TaskUpdate], None]
    outbox: Outbox = field(default_factory=Outbox)
    real_gpus: bool = False
    #: A worker command instead of `cpn worker` ({python} {plan} {job} {metrics}).
    worker_command: str | None = None
    advertise_host: str | None = None  # the address other nodes reach this one on
    stop_grace_s: float = 10.0
    _launches: dict[str, _Launch] = field(default_factory=dict)

    def running(self, job_id: str) -> list[int]:
        run = self._launches.get(job_id)
        return [r.rank for r in run.ranks] if run is not None and run.running else []

    def busy_gpus(self) -> set[tuple[str, int]]:
        return {
            (run.node, r.gpu) for run in self._launches.values() if run.running for r in run.ranks
        }

    # -- launching -------------------------------------------------------------------------
    async def launch(self, order: pb.LaunchOrder) -> list[int]:
        # Forget launches that have ended (their final states were reported).
        for job_id in [j for j, run in self._launches.items() if not run.running]:
            if all(r.last.ended for r in self._launches[job_id].ranks):
                del self._launches[job_id]
        mine = sorted(
            (r for r in order.ranks if r.site == self.site and r.node == self.node),
            key=lambda r: r.rank,
        )
        if not mine:
            log.info("job %s: no ranks on this agent", order.job_id)
            return []
        if order.job_id in self._launches and self._launches[order.job_id].running:
            log.warning("job %s is already running here; launch order ignored", order.job_id)
            return []
        files = RunFiles(self.work_dir / order.job_id)
        files.root.mkdir(parents=True, exist_ok=True)
        plan_path, job_path = files.root / "plan.json", files.root / "job.yaml"
        plan_path.write_text(order.plan_json)
        job_path.write_text(order.job_yaml)
        (files.root / "result.json").unlink(missing_ok=True)
        ranks = []
        for r in mine:
            for path in (
                files.metrics(r.rank),
                status_file(files.root, r.rank),
                files.log(r.rank),
                files.stdout(r.rank),
                files.error(r.rank),
            ):
                path.unlink(missing_ok=True)
            base = TaskUpdate(job_id=order.job_id, rank=r.rank, state=pb.TASK_STATE_STARTING)
            ranks.append(
                _Rank(
                    rank=r.rank,
                    gpu=r.gpu,
                    metrics=FileTail(files.metrics(r.rank)),
                    status=FileTail(status_file(files.root, r.rank)),
                    log=FileTail(files.log(r.rank)),
                    last=base,
                )
            )
            self.report(base)
        argv = self._launcher_argv(order, [r.rank for r in mine], files, plan_path, job_path)
        try:
            process = await self._start(argv, self._env(order, mine, files), files.root)
        except OSError as exc:
            for followed in ranks:
                self._final(followed, pb.TASK_STATE_FAILED, 127, f"cannot start: {exc}")
            return []
        run = _Launch(order.job_id, self.node, process, files, ranks)
        run.monitor = asyncio.create_task(self._monitor(run), name=f"launch-{order.job_id}")
        self._launches[order.job_id] = run
        log.info(
            "job %s: ranks %s started (launcher pid %d)",
            order.job_id,
            [r.rank for r in ranks],
            process.pid,
        )
        return [r.rank for r in ranks]

    def _launcher_argv(
        self,
        order: pb.LaunchOrder,
        mine: list[int],
        files: RunFiles,
        plan_path: Path,
        job_path: Path,
    ) -> list[str]:
        nodes = {(r.site, r.node) for r in order.ranks}
        first = min(order.ranks, key=lambda r: r.rank)
        host = (first.site, first.node) == (self.site, self.node)
        argv = [
            sys.executable, "-m", "cpn", "launch",
            "--plan", str(plan_path), "--job", str(job_path),
            "--ranks", ",".join(str(r) for r in mine),
            "--nnodes", str(len(nodes)),
            "--rdzv-endpoint", f"{order.master_addr}:{order.master_port}",
            "--host" if host else "--no-host",
            "--run-id", order.job_id,
            "--workdir", str(files.root),
        ]  # fmt: skip
        if self.advertise_host:
            argv += ["--local-addr", self.advertise_host]
        if self.worker_command is not None:
            argv += ["--command", self.worker_command]
        return argv

    def _env(
        self, order: pb.LaunchOrder, mine: list[pb.RankAssignment], files: RunFiles
    ) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            CPN_JOB_ID=order.job_id,
            CPN_SITE=self.site,
            CPN_NODE=self.node,
            CPN_RUN_DIR=str(files.root),
        )
        if self.real_gpus:  # worker i uses cuda:i, the i-th GPU the plan gave this node
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(r.gpu) for r in mine)
        env.update(dict(order.env))
        return env

    async def _start(
        self, argv: list[str], env: dict[str, str], cwd: Path
    ) -> asyncio.subprocess.Process:
        with (cwd / "launcher.log").open("ab") as out:
            return await asyncio.create_subprocess_exec(
                *argv,
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,  # its own process group: a stop reaches all of it
            )

    # -- following -------------------------------------------------------------------------
    def _update(self, r: _Rank, update: TaskUpdate, forwarded: bool = False) -> None:
        if update != r.last or forwarded:
            r.last = update
            self.report(update)

    def _read(self, r: _Rank, final: bool = False) -> None:
        update = r.last
        if update.state == pb.TASK_STATE_STARTING and r.log.path.exists():
            # torch's agent opens a worker's log as it starts the process: it runs.
            update = replace(update, state=pb.TASK_STATE_RUNNING)
        records = r.metrics.records(final)
        for record in records:
            update = with_metrics(update, record)
        for fields in r.status.records(final):
            update = with_status_line(update, fields)
        forwarded = self.outbox.collect(update.job_id, r.rank, records, new_lines(r.log, final))
        self._update(r, update, forwarded)

    async def _monitor(self, run: _Launch) -> None:
        while run.running:
            for r in run.ranks:
                self._read(r)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.process.wait(), STATUS_POLL_S)
        for r in run.ranks:
            self._read(r, final=True)
        self._finish(run)

    def _finish(self, run: _Launch) -> None:
        """Final states from the launcher's exit status and its result.json."""
        code = run.process.returncode
        result = _result(run.files.root / "result.json")
        failures = {int(f["rank"]): f for f in result.get("failures", []) if "rank" in f}
        for r in run.ranks:
            if code == 0:
                self._final(r, pb.TASK_STATE_SUCCEEDED, 0, "")
            elif r.rank in failures:
                f = failures[r.rank]
                status = int(f.get("status", 1))
                self._final(
                    r, pb.TASK_STATE_FAILED, status, f"exited with {status}: {f.get('reason', '')}"
                )
            elif run.stopping:
                self._final(r, pb.TASK_STATE_STOPPED, code or 0, run.stop_reason or "stop order")
            elif failures:
                first = next(iter(failures))
                self._final(
                    r, pb.TASK_STATE_STOPPED, code or 0, f"ended because worker {first} failed"
                )
            else:  # the launcher itself died (killed, out of memory): its workers died with it
                self._final(
                    r,
                    pb.TASK_STATE_FAILED,
                    code if code is not None else -1,
                    f"the launcher exited with {code}",
                )
        log.info("job %s: launcher exited with %s", run.job_id, code)

    def _final(self, r: _Rank, state: pb.TaskState.ValueType, code: int, message: str) -> None:
        self._update(r, replace(r.last, state=state, exit_code=code, message=message[:4096]))

    # -- stopping --------------------------------------------------------------------------
    async def stop(self, job_id: str, reason: str = "") -> int:
        """SIGTERM the launcher (it ends its workers), SIGKILL its group after the grace."""
        run = self._launches.get(job_id)
        if run is None or not run.running:
            return 0
        run.stopping, run.stop_reason = True, reason
        log.info("job %s: stopping %d workers (%s)", job_id, len(run.ranks), reason or "stop order")
        _signal_group(run.process, signal.SIGTERM)
        try:
            await asyncio.wait_for(run.process.wait(), self.stop_grace_s)
        except TimeoutError:
            _signal_group(run.process, signal.SIGKILL)
            await run.process.wait()
        if run.monitor is not None:
            await run.monitor
        return len(run.ranks)

    async def stop_all(self) -> None:
        for job_id in list(self._launches):
            await self.stop(job_id, "agent shutting down")


def _signal_group(process: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def _result(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}
