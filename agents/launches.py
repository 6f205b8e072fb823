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

The launcher is started, watched and ended through the site's backend
(agents/backends/): `local` runs it as this agent's child, `slurm` as one batch job for
every node of the site in the order (each node's files then in `node-K/` of the run
directory). Final states come from the backend's status and each node's `result.json`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agents.backends import BackendError, Handle, LaunchSpec, NodeShare, SiteBackend, State, Status
from agents.backends.base import HEAD_PLACEHOLDER, LOCAL_PLACEHOLDER, PORT_PLACEHOLDER
from agents.backends.local import LocalBackend
from agents.logs import Outbox, new_lines
from agents.status import status_file
from agents.tasks import MAX_MESSAGE, TaskUpdate, with_metrics, with_status_line
from cpn.train.links_file import write_links
from cpn.train.run_files import RunFiles
from cpn.train.tail import FileTail
from proto.cpn.v1 import agent_pb2 as pb

log = logging.getLogger("cpn.agent")

STATUS_POLL_S = 0.25
#: How long a launch may be unknown to its engine before it counts as failed.
UNKNOWN_LIMIT_S = 30.0
#: A rank's states before its worker process exists.
_NOT_STARTED = (pb.TASK_STATE_STARTING, pb.TASK_STATE_PENDING)
#: Ends of a launch that the site decided, not the workers nor cpn.
_TAKEN_BY_SITE = frozenset({State.CANCELLED, State.PREEMPTED, State.NODE_LOST})


@dataclass
class _Rank:
    """One plan rank of a launch, as the agent follows it."""

    rank: int
    node: str
    gpu: int
    files: RunFiles  # its node's launcher's run directory
    metrics: FileTail
    status: FileTail
    log: FileTail
    last: TaskUpdate


@dataclass
class _Launch:
    job_id: str
    handle: Handle
    ranks: list[_Rank]
    epoch: int = 0  # the launch order's (fencing: a stop or launch of an older one loses)
    status: Status = field(default_factory=lambda: Status(State.PENDING))
    stopping: bool = False
    stop_reason: str = ""
    #: The engine was already ending it (Slurm's COMPLETING) before any stop order: its
    #: final state, not the stop order, says why it ended.
    ending: bool = False
    monitor: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return not self.status.ended


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
    #: The site's engine (None: local processes on this node).
    backend: SiteBackend | None = None
    time_limit_s: int = 24 * 3600
    #: Awaited when the engine lost a node under a launch, before the ranks say so: the
    #: agent registers what its site still offers first, so that the job is not planned
    #: onto the lost node again. (A launch that ended otherwise on a node the engine no
    #: longer offers leaves it registered until the next capacity check, a few seconds:
    #: registering it away first would reach the control plane before the ranks' own
    #: word on how they ended, which is what judges the job.)
    on_node_lost: Callable[[], Awaitable[None]] | None = None
    #: The newest WAN measurement per peer site (`LinkBook.latest`), written into every
    #: launch's run directories for `wan: auto` jobs (`publish_links`).
    links: Callable[[], dict[str, dict[str, float]]] | None = None
    _launches: dict[str, _Launch] = field(default_factory=dict)
    #: (job, epoch) of every launch order carried out: a launch is done once per epoch.
    _epochs: set[tuple[str, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.backend is None:
            self.backend = LocalBackend(self.node)

    @property
    def engine(self) -> SiteBackend:
        assert self.backend is not None
        return self.backend

    def running(self, job_id: str) -> list[int]:
        run = self._launches.get(job_id)
        return [r.rank for r in run.ranks] if run is not None and run.running else []

    def followed(self) -> list[tuple[str, int]]:
        """(job, epoch) of every launch this process follows or has not forgotten yet."""
        return sorted((run.job_id, run.epoch) for run in self._launches.values())

    def busy_gpus(self) -> set[tuple[str, int]]:
        return {
            (r.node, r.gpu) for run in self._launches.values() if run.running for r in run.ranks
        }

    def started_gpus(self) -> set[tuple[str, int]]:
        """(node, GPU) of every launch not ended and not queued: what a node the engine no
        longer offers keeps registered (`agents.agent.site_inventory`). A launch still
        queued holds nothing there (the engine may never start it); one whose state the
        engine did not say for a moment (UNKNOWN) is still counted."""
        return {
            (r.node, r.gpu)
            for run in self._launches.values()
            if run.running and run.status.state is not State.PENDING
            for r in run.ranks
        }

    def publish_links(self) -> None:
        """Write the newest WAN measurements into every running launch's run directories
        (`RunFiles.wan_links`): workers of a `wan: auto` job move their WAN sync when the
        narrowest bandwidth changes (cpn.train.wan_auto)."""
        if self.links is None:
            return
        latest = self.links()
        roots = {r.files.root for run in self._launches.values() if run.running for r in run.ranks}
        for root in sorted(roots):
            try:
                write_links(RunFiles(root).wan_links, self.site, latest)
            except OSError as exc:  # a run directory removed under us: nothing to follow
                log.debug("cannot write %s: %s", RunFiles(root).wan_links, exc)

    # -- launching -------------------------------------------------------------------------
    def mine(self, order: pb.LaunchOrder) -> list[pb.RankAssignment]:
        """The order's ranks this agent runs: on its node, or anywhere on its site when its
        engine serves the whole site."""
        site_wide = self.engine.site_wide
        return sorted(
            (r for r in order.ranks if r.site == self.site and (site_wide or r.node == self.node)),
            key=lambda r: r.rank,
        )

    async def launch(self, order: pb.LaunchOrder) -> list[int]:
        # Forget launches that have ended (their final states were reported).
        for job_id in [j for j, run in self._launches.items() if not run.running]:
            if all(r.last.ended for r in self._launches[job_id].ranks):
                self.engine.forget(self._launches.pop(job_id).handle)
        mine = self.mine(order)
        if not mine:
            log.info("job %s: no ranks on this agent", order.job_id)
            return []
        if order.epoch and (order.job_id, order.epoch) in self._epochs:
            log.warning(
                "job %s epoch %d was launched here already; order ignored",
                order.job_id,
                order.epoch,
            )
            return []
        current = self._launches.get(order.job_id)
        if current is not None and current.running:
            if not order.epoch or current.epoch >= order.epoch:
                log.warning("job %s is already running here; launch order ignored", order.job_id)
                return []
            await self.stop(order.job_id, f"superseded by epoch {order.epoch}")
        if order.epoch:
            self._epochs.add((order.job_id, order.epoch))
        root = self.work_dir / order.job_id
        root.mkdir(parents=True, exist_ok=True)
        plan_path, job_path = root / "plan.json", root / "job.yaml"
        plan_path.write_text(order.plan_json)
        job_path.write_text(order.job_yaml)
        (root / "result.json").unlink(missing_ok=True)
        nodes: dict[str, list[pb.RankAssignment]] = {}
        for r in mine:  # nodes in order of their first rank: node rank 0 holds the lowest
            nodes.setdefault(r.node, []).append(r)
        site_wide = self.engine.site_wide
        shares, commands, ranks = [], [], []
        env = {"CPN_JOB_ID": order.job_id, "CPN_SITE": self.site}
        for k, (node, assigned) in enumerate(nodes.items()):
            files = RunFiles(root / f"node-{k}") if site_wide else RunFiles(root)
            files.root.mkdir(parents=True, exist_ok=True)
            (files.root / "result.json").unlink(missing_ok=True)
            for r in assigned:
                ranks.append(self._follow(order.job_id, r, files, epoch=order.epoch))
            shares.append(
                NodeShare(node, tuple(r.rank for r in assigned), tuple(r.gpu for r in assigned))
            )
            argv = self._launcher_argv(
                order, [r.rank for r in assigned], files, plan_path, job_path, node
            )
            node_env = {"CPN_NODE": node, "CPN_RUN_DIR": str(files.root)}
            if site_wide:  # one command per node, one environment for all: set it per node
                argv = ["env", *(f"{key}={value}" for key, value in node_env.items()), *argv]
            else:
                env.update(node_env)
                if self.real_gpus:  # worker i uses cuda:i, the i-th GPU the plan gave this node
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(r.gpu) for r in assigned)
            commands.append(tuple(argv))
        env.update(dict(order.env))
        alone = all(r.site == self.site for r in order.ranks)
        spec = LaunchSpec(
            job_id=order.job_id,
            nodes=tuple(shares),
            commands=tuple(commands),
            run_dir=root,
            env=env,
            time_limit_s=self.time_limit_s,
            stop_grace_s=self.stop_grace_s,
            rdzv_port=0 if site_wide and alone else order.master_port,
            rdzv_addr=order.master_addr,
            rdzv_host=min(order.ranks, key=lambda r: r.rank).site == self.site,
            epoch=order.epoch,
        )
        for followed in ranks:
            self.report(followed.last)
        try:
            handle = await self.engine.submit(spec)
        except (BackendError, OSError) as exc:
            for followed in ranks:
                self._final(followed, pb.TASK_STATE_FAILED, 127, f"cannot start: {exc}")
            return []
        self._watch(_Launch(order.job_id, handle, ranks, epoch=order.epoch))
        self.publish_links()  # what the workers follow from their first step
        log.info(
            "job %s: ranks %s started (%s %s)",
            order.job_id,
            [r.rank for r in ranks],
            self.engine.name,
            handle.native_id,
        )
        return [r.rank for r in ranks]

    def _follow(
        self,
        job_id: str,
        r: pb.RankAssignment,
        files: RunFiles,
        fresh: bool = True,
        epoch: int = 0,
    ) -> _Rank:
        """Follow plan rank r's files (removed first for a fresh launch, kept for an
        adopted one: its steps are read again, and the control plane keeps each step
        once)."""
        if fresh:
            for path in (
                files.metrics(r.rank),
                status_file(files.root, r.rank),
                files.log(r.rank),
                files.stdout(r.rank),
                files.error(r.rank),
            ):
                path.unlink(missing_ok=True)
        return _Rank(
            rank=r.rank,
            node=r.node,
            gpu=r.gpu,
            files=files,
            metrics=FileTail(files.metrics(r.rank)),
            status=FileTail(status_file(files.root, r.rank)),
            # An adopted rank's earlier output was forwarded before the restart: skip it.
            log=FileTail(files.log(r.rank), 0 if fresh else _size(files.log(r.rank))),
            last=TaskUpdate(job_id=job_id, rank=r.rank, state=pb.TASK_STATE_STARTING, epoch=epoch),
        )

    def _watch(self, run: _Launch) -> None:
        run.monitor = asyncio.create_task(self._monitor(run), name=f"launch-{run.job_id}")
        self._launches[run.job_id] = run

    async def adopt(self) -> list[str]:
        """Follow again the launches the engine still runs for this agent (after a
        restart): no new launch for them. Returns their job ids."""
        adopted = []
        for handle in await self.engine.adopt():
            if handle.job_id in self._launches:
                continue
            ranks = []
            for k, share in enumerate(handle.nodes):
                files = RunFiles(handle.run_dir / f"node-{k}")
                for rank, gpu in zip(share.ranks, share.gpus, strict=True):
                    r = pb.RankAssignment(rank=rank, site=self.site, node=share.node, gpu=gpu)
                    ranks.append(
                        self._follow(handle.job_id, r, files, fresh=False, epoch=handle.epoch)
                    )
            for followed in ranks:
                self.report(followed.last)
            if handle.epoch:
                self._epochs.add((handle.job_id, handle.epoch))
            # Its state now, before the agent registers: a launch that runs keeps its GPUs
            # registered on a node the engine stopped offering, one that ended does not.
            try:
                status = await self.engine.poll(handle)
            except BackendError as exc:  # asked again by the monitor
                log.warning("job %s: %s", handle.job_id, exc)
                status = Status(State.UNKNOWN, "", str(exc))
            run = _Launch(handle.job_id, handle, ranks, epoch=handle.epoch, status=status)
            if status.state is State.PENDING:  # still queued: its ranks say why
                self._pending(run, status)
            self._watch(run)
            adopted.append(handle.job_id)
            log.info("job %s: adopted %s %s", handle.job_id, self.engine.name, handle.native_id)
        return adopted

    def _launcher_argv(
        self,
        order: pb.LaunchOrder,
        mine: list[int],
        files: RunFiles,
        plan_path: Path,
        job_path: Path,
        node: str,
    ) -> list[str]:
        nodes = {(r.site, r.node) for r in order.ranks}
        first = min(order.ranks, key=lambda r: r.rank)
        host = (first.site, first.node) == (self.site, node)
        endpoint = f"{order.master_addr}:{order.master_port}"
        local_addr = self.advertise_host
        if self.engine.site_wide:  # the engine knows where each node's workers are
            local_addr = LOCAL_PLACEHOLDER
            if all(r.site == self.site for r in order.ranks):
                # This site's alone: the head node serves it, on a port the backend picks.
                endpoint = f"{HEAD_PLACEHOLDER}:{PORT_PLACEHOLDER}"
        argv = [
            # The launcher dies with this agent (and its workers with it, cpn.train.guard):
            # an agent killed with its host leaves nothing training behind.
            sys.executable, "-m", "cpn.train.guard",
            sys.executable, "-m", "cpn", "launch",
            "--plan", str(plan_path), "--job", str(job_path),
            "--ranks", ",".join(str(r) for r in mine),
            "--nnodes", str(len(nodes)),
            "--rdzv-endpoint", endpoint,
            "--host" if host else "--no-host",
            "--run-id", order.job_id,
            "--workdir", str(files.root),
        ]  # fmt: skip
        if local_addr:
            argv += ["--local-addr", local_addr]
        if self.worker_command is not None:
            argv += ["--command", self.worker_command]
        elif order.checkpoint_store:
            argv += ["--checkpoint-store", order.checkpoint_store]
            argv += ["--checkpoint-every", str(order.checkpoint_every)]
            # Every agent of the job alike (the ranks' agreement on a checkpoint step is
            # one collective over all of them): SIGUSR2 to a launch asks for a checkpoint
            # — Slurm's warning before a time limit, or an operator's `kill -USR2`.
            argv.append("--checkpoint-on-usr2")
        if self.worker_command is None and order.resume_from:
            argv += ["--resume-from", order.resume_from]
        return argv

    # -- following -------------------------------------------------------------------------
    def _update(self, r: _Rank, update: TaskUpdate, forwarded: bool = False) -> None:
        if update != r.last or forwarded:
            r.last = update
            self.report(update)

    def _read(self, r: _Rank, final: bool = False) -> None:
        update = r.last
        if update.state in _NOT_STARTED and r.log.path.exists():
            # torch's agent opens a worker's log as it starts the process: it runs.
            update = replace(update, state=pb.TASK_STATE_RUNNING, message="")
        records = r.metrics.records(final)
        for record in records:
            update = with_metrics(update, record)
        for fields in r.status.records(final):
            update = with_status_line(update, fields)
        forwarded = self.outbox.collect(update.job_id, r.rank, records, new_lines(r.log, final))
        self._update(r, update, forwarded)

    async def _monitor(self, run: _Launch) -> None:
        engine, unknown_since = self.engine, None
        while run.running:
            for r in run.ranks:
                self._read(r)
            await engine.wait(run.handle, engine.poll_interval_s)
            try:
                status = await engine.poll(run.handle)
            except BackendError as exc:  # the engine did not answer: ask again
                log.warning("job %s: %s", run.job_id, exc)
                continue
            if status.state is State.UNKNOWN:  # gone from every record the engine keeps
                unknown_since = unknown_since or asyncio.get_running_loop().time()
                if asyncio.get_running_loop().time() - unknown_since > UNKNOWN_LIMIT_S:
                    status = replace(status, state=State.FAILED)
            else:
                unknown_since = None
            if status != run.status:
                log.info("job %s: %s %s", run.job_id, status.state.value, status.reason)
                if status.state is State.PENDING:  # queued by the engine: its reason shown
                    self._pending(run, status)
            if "COMPLETING" in status.native and not run.stopping:
                run.ending = True
            run.status = status
        for r in run.ranks:
            self._read(r, final=True)
        if run.status.state is State.NODE_LOST and self.on_node_lost is not None:
            try:
                await self.on_node_lost()
            except Exception:  # the loss must still be reported
                log.exception("job %s: could not register the site's nodes again", run.job_id)
        self._finish(run)

    def _pending(self, run: _Launch, status: Status) -> None:
        """Ranks not started yet say that the engine holds them in its queue, and why."""
        state, message = status.task_state()
        for r in run.ranks:
            if r.last.state in _NOT_STARTED:
                self._update(r, replace(r.last, state=state, message=message[:MAX_MESSAGE]))

    def _finish(self, run: _Launch) -> None:
        """Final states from the backend's status and each node's result.json."""
        status = run.status
        failures: dict[int, dict[str, Any]] = {}
        # Why a node's launcher itself failed (its rendezvous, before any worker started;
        # or an error of the launcher's own), in its words.
        errors: dict[Path, str] = {}
        for root in {r.files.root for r in run.ranks}:
            result = _result(root / "result.json")
            failures.update({int(f["rank"]): f for f in result.get("failures", []) if "rank" in f})
            if isinstance(result.get("error"), str):
                errors[root] = result["error"]
        code = status.exit_code if status.exit_code is not None else -1
        # The site took the launch away (an outside cancel, a preemption, a lost node): its
        # word for every rank, before the workers' own failures, which follow from it.
        taken = status.state in _TAKEN_BY_SITE and not run.stopping
        for r in run.ranks:
            if status.state is State.SUCCEEDED:
                self._final(r, pb.TASK_STATE_SUCCEEDED, 0, "")
            elif taken:
                state, message = status.task_state()
                self._final(r, state, code, message)
            elif r.rank in failures:
                f = failures[r.rank]
                exit_status = int(f.get("status", 1))
                self._final(
                    r,
                    pb.TASK_STATE_FAILED,
                    exit_status,
                    f"exited with {exit_status}: {f.get('reason', '')}",
                )
            elif run.stopping and not run.ending:
                self._final(r, pb.TASK_STATE_STOPPED, code, run.stop_reason or "stop order")
            elif failures:
                first = next(iter(failures))
                self._final(r, pb.TASK_STATE_STOPPED, code, f"ended because worker {first} failed")
            elif r.files.root in errors and status.state is State.FAILED:
                self._final(r, pb.TASK_STATE_FAILED, code, errors[r.files.root])
            else:  # the launch itself ended badly: killed, preempted, a node lost, ...
                state, message = status.task_state()
                self._final(r, state, code, message)
        log.info(
            "job %s: %s %s ended %s", run.job_id, self.engine.name, run.handle.native_id,
            status.state.value,
        )  # fmt: skip

    def _final(self, r: _Rank, state: pb.TaskState.ValueType, code: int, message: str) -> None:
        self._update(r, replace(r.last, state=state, exit_code=code, message=message[:MAX_MESSAGE]))

    # -- stopping --------------------------------------------------------------------------
    async def stop(self, job_id: str, reason: str = "", epoch: int = 0) -> int:
        """End a launch through its backend: SIGTERM (the launchers end their workers),
        a kill after the grace. Only a launch of `epoch` or older (0: any)."""
        run = self._launches.get(job_id)
        if run is None or not run.running:
            return 0
        if epoch and run.epoch > epoch:
            log.info("job %s: stop of epoch %d ignored, epoch %d runs", job_id, epoch, run.epoch)
            return 0
        run.stopping, run.stop_reason = True, reason
        log.info("job %s: stopping %d workers (%s)", job_id, len(run.ranks), reason or "stop order")
        try:
            await self.engine.cancel(run.handle, self.stop_grace_s)
        except BackendError as exc:
            log.error("job %s: %s", job_id, exc)
        if run.monitor is not None:
            await run.monitor
        return len(run.ranks)

    def any_running(self) -> bool:
        return any(run.running for run in self._launches.values())

    async def stop_all(self, reason: str = "agent shutting down", *, fence: bool = False) -> None:
        """Stop every launch; at shutdown (not `fence`) a site engine's launches keep
        running instead, for the agent to adopt when it comes back. A fenced agent (its
        lease lost) stops them too: their jobs run elsewhere now."""
        if self.engine.site_wide and not fence:
            for run in self._launches.values():
                if run.monitor is not None:
                    run.monitor.cancel()
            return
        await asyncio.gather(*(self.stop(job_id, reason) for job_id in list(self._launches)))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _result(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}
