"""The `slurm` backend: a site's shards as one Slurm batch job, through the Slurm CLI.

One `sbatch` per (job, epoch): `--nodes` and `--nodelist` (the plan's nodes: pipeline
stages land where the plan put them), `--ntasks-per-node=1`, `--gres=gpu:N`, a finite
`--time`, `--no-requeue` (cpn owns retries and re-planning), `--job-name=cpn-JOB-eEPOCH`
and `--comment=cpn/JOB/EPOCH/AGENT` (how a restarted agent finds its jobs; no spaces or
`=`, so that scontrol's `Key=Value` text keeps it whole).
The batch script runs `srun` once per node; each node picks its own `cpn launch` command
by its Slurm node name (`$SLURMD_NODENAME`), so node rank k is the plan's node k whatever
order Slurm lists them in. The launcher of node rank 0 serves the rendezvous on its
`NodeAddr`; when the launch is this site's alone it picks a free port there at start and
the other nodes read it from the run directory, so launches sharing a host never clash.

States come from `squeue --me --json -t all` (22.05's string `job_state` and 23.02+'s list
both read), then `scontrol -o show job`, then the job-completion log — never from `sacct`,
which needs slurmdbd. A job pending for a reason that cannot pass (bad partition
configuration, a held failed launch) is cancelled and reported FAILED: it must not sit
in the queue. Capacity comes from `scontrol -o show node` (GRES `gpu`); a node that is
down or drained offers no GPUs.

The agent finds the cluster as every Slurm client does (`SLURM_CONF`, else the default
configuration or DNS SRV records). The run directory must be on storage every node and
the agent share, and cpn installed at the same path on the nodes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agents.backends.base import (
    FINAL,
    HEAD_PLACEHOLDER,
    LOCAL_PLACEHOLDER,
    PORT_PLACEHOLDER,
    BackendError,
    Capacity,
    Handle,
    LaunchSpec,
    NodeCapacity,
    NodeShare,
    State,
    Status,
)
from agents.backends.slurm_parse import (
    SQUEUE_TEXT_ARGS,
    SlurmJob,
    SlurmNode,
    SlurmOutputError,
    key_values,
    parse_jobcomp,
    parse_nodes,
    parse_scontrol_jobs,
    parse_squeue_json,
    parse_squeue_text,
    slurm_minutes,
)

log = logging.getLogger("cpn.agent")

#: Slurm's base job states → cpn's, one comment each (`man squeue`, JOB STATE CODES).
SLURM_STATES: dict[str, State] = {
    "PENDING": State.PENDING,  # queued, waiting for resources or priority
    "CONFIGURING": State.STARTING,  # nodes allocated, booting or being set up
    "RUNNING": State.RUNNING,  # the batch script runs (the launchers start in it)
    "COMPLETING": State.RUNNING,  # processes ending, epilogs running; the end state follows
    "SUSPENDED": State.PENDING,  # stopped by an admin or gang scheduling; holds no CPU time
    "RESIZING": State.RUNNING,  # the allocation changes size
    "SIGNALING": State.RUNNING,  # a signal is being delivered
    "STAGE_OUT": State.RUNNING,  # burst-buffer stage-out after the script ended
    "STOPPED": State.RUNNING,  # SIGSTOPped, still holding its nodes
    "REQUEUED": State.PENDING,  # requeued (cpn submits --no-requeue; only an admin does this)
    "REQUEUE_FED": State.PENDING,  # requeued by a federation sibling
    "REQUEUE_HOLD": State.FAILED,  # requeued and held: would wait for ever; cpn re-plans
    "COMPLETED": State.SUCCEEDED,  # the script exited 0 on every node
    "FAILED": State.FAILED,  # the script exited non-zero (a worker failed)
    "CANCELLED": State.CANCELLED,  # scancel: by cpn's stop order or by someone else
    "TIMEOUT": State.FAILED,  # past its --time limit
    "DEADLINE": State.FAILED,  # past its --deadline
    "OUT_OF_MEMORY": State.FAILED,  # a step ran out of memory
    "PREEMPTED": State.PREEMPTED,  # ended for a higher-priority job (PreemptMode=CANCEL)
    "NODE_FAIL": State.NODE_LOST,  # a node of the allocation failed (slurmd gone, DOWN)
    "BOOT_FAIL": State.NODE_LOST,  # a node failed to boot for it
    "REVOKED": State.CANCELLED,  # a federation sibling started it elsewhere
    "SPECIAL_EXIT": State.FAILED,  # held after a special exit code
    "LAUNCH_FAILED": State.FAILED,  # the batch script could not be started on the node
}

#: Pending reasons that can never pass by waiting: the job is cancelled, not left queued.
#: What the launch asked for cannot be granted: the launch failed.
FATAL_PENDING = (
    "PartitionConfig",
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "BadConstraints",
    "JobHeldAdmin",
    "launch failed requeued held",
    "InvalidAccount",
    "InvalidQOS",
    "AssocMaxNodesPerJobLimit",
    "AssocMaxWallDurationPerJobLimit",
)
#: The site took the planned nodes or partition away (drained, down): the site's loss, not
#: the job's fault, so NODE_LOST, which the control plane plans again without restarts.
SITE_LOST_PENDING = (
    "PartitionDown",
    "PartitionInactive",
    "ReqNodeNotAvail, UnavailableNodes",
)

#: A job's run directory keeps the spec here, for adopt().
SPEC_FILE = "slurm-spec.json"
_COMMENT = re.compile(r"^cpn/([^/\s]+)/(\d+)/([^/\s]+)$")
_JSON_UNSUPPORTED = ("unrecognized option", "invalid option", "not supported", "plugin")


@dataclass(frozen=True)
class SlurmOptions:
    """What the site's admin gave cpn: a partition, maybe an account."""

    partition: str
    account: str | None = None
    #: Extra sbatch options, verbatim (a QOS, a reservation, constraints).
    extra_args: tuple[str, ...] = ()
    command_timeout_s: float = 30.0
    #: Seconds before the time limit at which Slurm warns the workers (SIGUSR2).
    signal_lead_s: int = 120
    #: The launches' --time (the agent's --time-limit), checked at start against the
    #: partition's MaxTime (None: not checked).
    time_limit_s: int | None = None


@dataclass
class SlurmBackend:
    options: SlurmOptions
    agent_id: str
    name: str = "slurm"
    site_wide: bool = True
    poll_interval_s: float = 1.0
    _json: bool | None = None  # does squeue --json work here (None: not tried yet)
    _nodes: dict[str, SlurmNode] = field(default_factory=dict)
    _jobcomp: Path | None = None
    _known: dict[tuple[str, int], Handle] = field(default_factory=dict)
    _partition: dict[str, str] = field(default_factory=dict)  # scontrol's fields

    # ------------------------------------------------------------------ the CLI
    async def _run(self, *argv: str, stdin: str | None = None, check: bool = True) -> str:
        if shutil.which(argv[0]) is None:
            raise BackendError(f"slurm: {argv[0]} is not on the PATH (install slurm-client)")
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            raise BackendError(f"slurm: cannot run {argv[0]}: {exc.strerror or exc}") from None
        try:
            async with asyncio.timeout(self.options.command_timeout_s):  # see agents/events.py
                out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise BackendError(
                f"slurm: {argv[0]} did not answer in {self.options.command_timeout_s:.0f} s "
                "(is the controller reachable?)"
            ) from None
        if check and proc.returncode != 0:
            said = err.decode(errors="replace").strip() or out.decode(errors="replace")
            raise BackendError(f"slurm: {_first_line(said, argv[0])}")
        return out.decode(errors="replace")

    # ------------------------------------------------------------------ start-up
    async def check(self) -> None:
        """The cluster answers, the partition exists and has nodes: else one line."""
        for binary in ("sbatch", "squeue", "scontrol", "scancel"):
            if shutil.which(binary) is None:
                raise BackendError(f"slurm: {binary} is not on the PATH (install slurm-client)")
        conf = os.environ.get("SLURM_CONF")
        if conf and not Path(conf).is_file():
            raise BackendError(f"slurm: SLURM_CONF={conf}: no such file")
        ping = await self._run("scontrol", "ping", check=False)
        if "UP" not in ping:
            where = os.environ.get("SLURM_CONF", "the default slurm.conf")
            raise BackendError(
                f"slurm: the controller does not answer ({_first_line(ping, 'scontrol ping')}; "
                f"configuration: {where})"
            )
        capacity = await self.capacity()
        if not capacity.nodes:
            raise BackendError(f"slurm: partition {self.options.partition!r} has no nodes")
        self._check_time_limit()

    def _check_time_limit(self) -> None:
        """A --time above the partition's MaxTime keeps every launch pending for ever
        (PartitionTimeLimit), each then failed: refused at start, in one line."""
        wanted = self.options.time_limit_s
        if wanted is None:
            return
        max_time = self._partition.get("MaxTime", "UNLIMITED")
        try:
            most = slurm_minutes(max_time)
        except SlurmOutputError as exc:
            log.info("partition %s: MaxTime not checked (%s)", self.options.partition, exc)
            return
        if most is not None and math.ceil(wanted / 60) > most:
            fits = math.floor(most * 60)
            hint = f"pass --time-limit {fits} or less" if fits >= 60 else "no launch fits"
            raise BackendError(
                f"slurm: partition {self.options.partition!r} allows {max_time} "
                f"(MaxTime) per job, but launches would ask for {wanted} s; {hint}"
            )

    async def capacity(self) -> Capacity:
        """The partition's nodes and their GPUs (GRES); down or drained nodes offer none."""
        out = await self._run(
            "scontrol", "-o", "show", "partition", self.options.partition, check=False
        )
        fields = key_values(out.strip())
        if fields.get("PartitionName") != self.options.partition:
            raise BackendError(f"slurm: partition {self.options.partition!r} not found")
        self._partition = fields
        names = set()
        if fields.get("Nodes") not in (None, "", "(null)"):
            hosts = await self._run("scontrol", "show", "hostnames", fields["Nodes"])
            names = {h.strip() for h in hosts.splitlines() if h.strip()}
        try:
            nodes = [n for n in parse_nodes(await self._run("scontrol", "-o", "show", "node"))]
        except SlurmOutputError as exc:
            raise BackendError(f"slurm: {exc}") from None
        self._nodes = {n.name: n for n in nodes if n.name in names}
        return Capacity(
            tuple(
                NodeCapacity(n.name, n.gpus if n.usable else 0, n.usable, n.state, n.address)
                for n in sorted(self._nodes.values(), key=lambda n: _natural(n.name))
            )
        )

    def node_health(self, registered: set[str]) -> tuple[str, list[str]]:
        """(worst, what) for the nodes the agent registered, from a fresh `scontrol show
        node` (blocking: the agent's health check runs in a thread). worst is "ok",
        "degraded" (some offer no GPUs now: down, drained, not responding) or "failing"
        (none does, or the controller does not answer)."""
        try:
            done = subprocess.run(
                ["scontrol", "-o", "show", "node"],
                capture_output=True,
                text=True,
                timeout=self.options.command_timeout_s,
                check=False,
            )
            nodes = {n.name: n for n in parse_nodes(done.stdout)} if done.returncode == 0 else {}
        except (OSError, subprocess.TimeoutExpired, SlurmOutputError) as exc:
            return "failing", [f"scontrol show node: {exc}"]
        if not nodes:
            return "failing", [_first_line(done.stderr, "scontrol show node")]
        lost = sorted(
            f"{name} ({nodes[name].state if name in nodes else 'gone'})"
            for name in registered
            if name not in nodes or not nodes[name].usable
        )
        if not lost:
            return "ok", []
        return ("failing" if len(lost) == len(registered) else "degraded"), lost

    def gpu_type(self, node: str) -> str:
        found = self._nodes.get(node)
        return found.gpu_type if found is not None else ""

    # ------------------------------------------------------------------ submit
    async def submit(self, spec: LaunchSpec) -> Handle:
        key = (spec.job_id, spec.epoch)
        if key in self._known:
            return self._known[key]
        for job in await self._queue():  # a retry, or a restart that did not adopt yet
            if job.name == spec.key and self._mine(job) and job.state != "CANCELLED":
                handle = Handle(spec.job_id, spec.epoch, job.job_id, spec.run_dir, spec.nodes)
                self._known[key] = handle
                return handle
        if not self._nodes:
            await self.capacity()
        unknown = [n.node for n in spec.nodes if n.node not in self._nodes]
        if unknown:
            raise BackendError(
                f"slurm: node {unknown[0]} is not in partition {self.options.partition!r}"
            )
        short = [
            n.node for n in spec.nodes if len(n.gpus) > self._nodes[n.node].gpus
        ]  # GRES: what the node has at all, busy or not
        if short:
            node = self._nodes[short[0]]
            raise BackendError(
                f"slurm: the launch wants {spec.gpus_per_node} GPUs on {node.name}, which has "
                f"{node.gpus} (partition {self.options.partition!r})"
            )
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        script = self._write_scripts(spec)
        argv = [
            "sbatch", "--parsable",
            f"--job-name={spec.key}",
            f"--comment=cpn/{spec.job_id}/{spec.epoch}/{self.agent_id}",
            f"--partition={self.options.partition}",
            f"--nodes={len(spec.nodes)}",
            f"--nodelist={','.join(n.node for n in spec.nodes)}",
            "--ntasks-per-node=1",
            f"--time={max(1, math.ceil(spec.time_limit_s / 60))}",
            # SIGUSR2 to the steps' processes this long before the time limit (Slurm may
            # send it up to a minute early), and at preemption where the site has
            # `PreemptParameters=send_user_signal`: the workers checkpoint on it.
            f"--signal=USR2@{self.options.signal_lead_s}",
            "--no-requeue",
            f"--chdir={spec.run_dir}",
            f"--output={spec.run_dir}/slurm-%j.out",
            "--export=ALL",
        ]  # fmt: skip
        if spec.gpus_per_node:
            argv.append(f"--gres=gpu:{spec.gpus_per_node}")
        if self.options.account:
            argv.append(f"--account={self.options.account}")
        argv += [*self.options.extra_args, str(script)]
        out = await self._run(*argv)
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise BackendError(f"slurm: sbatch printed {out.strip()!r:.80}, not a job id")
        handle = Handle(spec.job_id, spec.epoch, job_id, spec.run_dir, spec.nodes)
        self._known[key] = handle
        log.info("job %s epoch %d: Slurm job %s", spec.job_id, spec.epoch, job_id)
        return handle

    def _write_scripts(self, spec: LaunchSpec) -> Path:
        """batch.sh (srun once per node) and node.sh (what node rank k runs)."""
        run = spec.run_dir
        port_file = run / f"rdzv-e{spec.epoch}.port"
        port_file.unlink(missing_ok=True)
        names, commands = [], []
        head = self._nodes[spec.nodes[0].node].address
        for k, (share, argv) in enumerate(zip(spec.nodes, spec.commands, strict=True)):
            names.append(f"  {shlex.quote(share.node)}) K={k} ;;")
            mine = self._nodes[share.node].address
            filled = [
                a.replace(HEAD_PLACEHOLDER, head).replace(LOCAL_PLACEHOLDER, mine) for a in argv
            ]
            cmd = " ".join(_quote_with_port(a) for a in filled)
            commands.append(f"  {k}) CMD=({cmd}) ;;")
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(spec.env.items()))
        if spec.rdzv_port:
            port = f"CPN_RDZV_PORT={spec.rdzv_port}\n"
        else:  # node rank 0 picks a free port on its host; the others read it
            # Outside the ephemeral range: the launcher binds it seconds later, after
            # importing torch, and an outgoing connection could take a kernel's pick.
            pick = "from cpn.listen_ports import free_port; print(free_port())"
            port = (
                f"PORT_FILE={shlex.quote(str(port_file))}\n"
                'if [ "$K" = 0 ]; then\n'
                f"  CPN_RDZV_PORT=$({shlex.quote(sys.executable)} -c {shlex.quote(pick)})"
                ' || { echo "cpn: cannot pick a rendezvous port" >&2; exit 1; }\n'
                '  echo "$CPN_RDZV_PORT" > "$PORT_FILE.tmp" && mv "$PORT_FILE.tmp" "$PORT_FILE"\n'
                "else\n"
                '  for _ in $(seq 600); do [ -s "$PORT_FILE" ] && break; sleep 0.1; done\n'
                '  CPN_RDZV_PORT=$(cat "$PORT_FILE")\n'
                "fi\n"
            )
        node_sh = (
            "#!/bin/bash\n"
            "# cpn: one node of a launch; written by the agent's Slurm backend.\n"
            'case "$SLURMD_NODENAME" in\n'
            + "\n".join(names)
            + '\n  *) echo "cpn: node $SLURMD_NODENAME is not in this launch" >&2; exit 3 ;;\n'
            "esac\n"
            f"{exports}{port}"
            'case "$K" in\n' + "\n".join(commands) + "\nesac\n"
            f"DIR={shlex.quote(str(run))}/node-$K\n"
            'mkdir -p "$DIR"\n'
            'exec "${CMD[@]}" > "$DIR/launcher.log" 2>&1\n'
        )
        batch_sh = (
            "#!/bin/bash\n"
            "# cpn: one launch of a job's shards on this site (see node.sh).\n"
            "exec srun --kill-on-bad-exit=1 --ntasks-per-node=1 "
            f"bash {shlex.quote(str(run / 'node.sh'))}\n"
        )
        (run / "node.sh").write_text(node_sh)
        (run / "batch.sh").write_text(batch_sh)
        doc = {
            "job_id": spec.job_id,
            "epoch": spec.epoch,
            "nodes": [{"node": n.node, "ranks": n.ranks, "gpus": n.gpus} for n in spec.nodes],
        }
        (run / SPEC_FILE).write_text(json.dumps(doc) + "\n")
        return run / "batch.sh"

    # ------------------------------------------------------------------ watch
    async def _queue(self) -> list[SlurmJob]:
        """Every job Slurm still keeps, ended ones too: `-t all`, since 23.02+ apply
        squeue's default filter (pending and running only) to --json as well (22.05's
        --json ignores filters); adopt must see jobs that ended while the agent was away."""
        # --me: only this agent's user's jobs (the agent submits them), not every user's
        # queue, which on a shared cluster is megabytes of JSON per poll per launch.
        if self._json is not False:
            done = await self._run("squeue", "--me", "--json", "-t", "all", check=False)
            try:
                jobs = parse_squeue_json(done)
                self._json = True
                return jobs
            except SlurmOutputError as exc:
                if self._json:  # it worked before: the controller is in trouble
                    raise BackendError(f"slurm: {exc}") from None
                self._json = False
                log.info("squeue --json unusable here (%s); reading squeue's text", exc)
        text = await self._run("squeue", "--me", "-t", "all", *SQUEUE_TEXT_ARGS)
        try:
            return parse_squeue_text(text)
        except SlurmOutputError as exc:
            raise BackendError(f"slurm: {exc}") from None

    async def _find(self, job_id: str) -> SlurmJob | None:
        for job in await self._queue():
            if job.job_id == job_id:
                return job
        text = await self._run("scontrol", "-o", "show", "job", job_id, check=False)
        if "Invalid job id" not in text and text.strip():
            try:
                return parse_scontrol_jobs(text)[0]
            except (SlurmOutputError, IndexError):
                pass
        return await self._from_jobcomp(job_id)

    async def _from_jobcomp(self, job_id: str) -> SlurmJob | None:
        if self._jobcomp is None:
            config = await self._run("scontrol", "show", "config", check=False)
            kind = re.search(r"^JobCompType\s*=\s*(\S+)", config, re.M)
            where = re.search(r"^JobCompLoc\s*=\s*(\S+)", config, re.M)
            if kind and where and kind.group(1) == "jobcomp/filetxt":
                self._jobcomp = Path(where.group(1))
        if self._jobcomp is None:
            return None
        try:
            return parse_jobcomp(self._jobcomp.read_text(errors="replace"), job_id)
        except (OSError, SlurmOutputError):  # unreadable: the job's end stays unknown
            return None

    async def poll(self, handle: Handle) -> Status:
        job = await self._find(handle.native_id)
        if job is None:
            return Status(State.UNKNOWN, "", f"Slurm job {handle.native_id} is not known")
        status = slurm_status(job)
        if job.state == "PENDING":
            for reasons, state in (
                (FATAL_PENDING, State.FAILED),
                (SITE_LOST_PENDING, State.NODE_LOST),
            ):
                if any(r in job.reason for r in reasons):
                    await self._run("scancel", handle.native_id, check=False)
                    return Status(
                        state,
                        job.native,
                        f"Slurm cannot start it ({job.reason}); cancelled",
                        job.restarts,
                    )
        return status

    async def wait(self, handle: Handle, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)

    async def cancel(self, handle: Handle, grace_s: float) -> None:
        """SIGTERM to every step and the batch shell, `scancel` after the grace (Slurm
        then kills what is left after its KillWait); returns once the job has ended."""
        job_id = handle.native_id
        await self._run("scancel", "--full", "--signal=TERM", job_id, check=False)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if (await self.poll(handle)).ended:
                return
            await asyncio.sleep(min(0.5, self.poll_interval_s))
        await self._run("scancel", job_id, check=False)
        deadline = time.monotonic() + max(30.0, grace_s)
        while time.monotonic() < deadline:
            status = await self.poll(handle)
            if status.ended or status.state is State.UNKNOWN:
                return
            await asyncio.sleep(0.5)
        raise BackendError(f"slurm: job {job_id} still runs after scancel")

    def logs(self, handle: Handle, node_rank: int) -> Path:
        return handle.run_dir / f"node-{node_rank}" / "launcher.log"

    async def adopt(self) -> Sequence[Handle]:
        """This agent's jobs that Slurm still shows, found by their comment: running or
        queued ones to follow again, and ones that ended while the agent was away (Slurm
        keeps them MinJobAge seconds), whose final states must still be reported."""
        handles = []
        for job in await self._queue():
            m = _COMMENT.match(job.comment)
            if m is None or m.group(3) != self.agent_id:
                continue
            run_dir = Path(job.work_dir) if job.work_dir else None
            if run_dir is None:
                text = await self._run("scontrol", "-o", "show", "job", job.job_id, check=False)
                run_dir = Path(key_values(text.strip()).get("WorkDir", "."))
            nodes = _spec_nodes(run_dir)
            if nodes is None:
                log.warning(
                    "Slurm job %s: no %s in %s; not adopted", job.job_id, SPEC_FILE, run_dir
                )
                continue
            handle = Handle(m.group(1), int(m.group(2)), job.job_id, run_dir, nodes)
            self._known[(handle.job_id, handle.epoch)] = handle
            handles.append(handle)
        return handles

    def forget(self, handle: Handle) -> None:
        self._known.pop((handle.job_id, handle.epoch), None)

    def _mine(self, job: SlurmJob) -> bool:
        m = _COMMENT.match(job.comment)
        return m is not None and m.group(3) == self.agent_id


def slurm_status(job: SlurmJob) -> Status:
    """One Slurm job's state in cpn's words (SLURM_STATES), with Slurm's own."""
    state = SLURM_STATES.get(job.state, State.UNKNOWN)
    reason = job.reason if job.reason not in ("", "None") else ""
    if job.signal:
        reason = f"{reason} (signal {job.signal})".strip()
    ended = state in FINAL
    return Status(
        state,
        job.native,
        f"Slurm job {job.job_id} {job.native}" + (f": {reason}" if reason else ""),
        job.restarts,
        job.exit_code if ended else None,
    )


def _spec_nodes(run_dir: Path) -> tuple[NodeShare, ...] | None:
    try:
        doc = json.loads((run_dir / SPEC_FILE).read_text())
        return tuple(
            NodeShare(str(n["node"]), tuple(n["ranks"]), tuple(n["gpus"])) for n in doc["nodes"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _quote_with_port(arg: str) -> str:
    """A shell word for `arg`, with {rdzv_port} left to the shell ($CPN_RDZV_PORT)."""
    parts = arg.split(PORT_PLACEHOLDER)
    return '"$CPN_RDZV_PORT"'.join(shlex.quote(p) if p else "" for p in parts) or "''"


def _first_line(text: str, what: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:300]
    return f"{what} failed with no message"


def _natural(name: str) -> tuple[str, int]:
    m = re.match(r"^(.*?)(\d+)$", name)
    return (m.group(1), int(m.group(2))) if m else (name, -1)
