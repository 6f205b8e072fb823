"""A real Slurm cluster on this host, for the Slurm backend's tests.

Debian's `slurmctld`, `slurmd` and `munge` (scripts/setup.sh installs them) run from a
temporary directory: one munge daemon on its own socket and key, one controller and one
`slurmd -N nodeK` per node, all on 127.0.0.1 with free ports (one per daemon), spool, log
and pid paths per node (`%n`). Each node has fake GPUs: GRES on character devices made
with mknod (gres.conf refuses plain files). `proctrack/linuxproc` and `task/none` need no
cgroups; `jobcomp/filetxt` keeps finished jobs' states without slurmdbd. Two partitions on
the same nodes: `cpn` and `urgent`, whose jobs preempt `cpn`'s (PreemptMode=CANCEL), and
`short`, whose one-minute MaxTime keeps longer jobs pending for ever (PartitionConfig).

Every daemon runs in the foreground as a child of the test process and is stopped by its
PID. Clients find the cluster through `SLURM_CONF`, as every Slurm client does.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from cpn.listen_ports import free_port

BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "munged")
GPUS_PER_NODE = 2


class ClusterError(RuntimeError):
    pass


@dataclass
class SlurmCluster:
    root: Path
    nodes: list[str]
    gpus: int = GPUS_PER_NODE
    ctld_port: int = 0
    node_ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    #: More slurm.conf lines (record.py's PluginDir= for a Slurm unpacked elsewhere).
    conf_extra: tuple[str, ...] = ()

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        done = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise ClusterError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    # ------------------------------------------------------------------ configuration
    def write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "dev", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        self.ctld_port = free_port()
        self.node_ports = {n: free_port() for n in self.nodes}
        lines = [
            "ClusterName=cpntest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={r}/munge/sock",
            "CredType=cred/munge",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={r}/jobcomp.txt",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "ReturnToService=2",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SlurmdParameters=config_overrides",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=CANCEL",
            "SlurmdTimeout=5",
            "SlurmctldTimeout=5",
            "MessageTimeout=5",
            "KillWait=3",
            "InactiveLimit=0",
            "MinJobAge=600",
            "SchedulerParameters=sched_interval=1",
            "HealthCheckInterval=0",
        ]
        gres = []
        for i, node in enumerate(self.nodes):
            first = i * self.gpus
            for g in range(first, first + self.gpus):
                dev = r / "dev" / f"gpu{g}"
                if not dev.exists():
                    os.mknod(dev, 0o600 | 0o020000, os.makedev(1, 3))  # like /dev/null
            lines.append(
                f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 "
                f"Port={self.node_ports[node]} CPUs=2 Gres=gpu:{self.gpus} RealMemory=1000"
            )
            last = first + self.gpus - 1
            files = f"gpu{first}" if first == last else f"gpu[{first}-{last}]"
            gres.append(f"NodeName={node} Name=gpu File={r}/dev/{files}")
        names = ",".join(self.nodes)
        lines += [
            f"PartitionName=cpn Nodes={names} Default=YES MaxTime=INFINITE State=UP",
            f"PartitionName=urgent Nodes={names} PriorityTier=10 MaxTime=INFINITE State=UP",
            f"PartitionName=short Nodes={names} MaxTime=1 State=UP",
            *self.conf_extra,
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        (r / "gres.conf").write_text("\n".join(gres) + "\n")
        key = r / "munge" / "key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        (r / "munge").chmod(0o700)

    # ------------------------------------------------------------------ daemons
    def _start(self, name: str, argv: list[str]) -> None:
        log = (self.root / "log" / f"{name}.out").open("ab")
        self.procs[name] = subprocess.Popen(argv, env=self.env, stdout=log, stderr=log)

    def start(self) -> None:
        m = self.root / "munge"
        self._start(
            "munged",
            [
                "munged", "-F", "--force", f"--socket={m}/sock", f"--key-file={m}/key",
                f"--log-file={m}/log", f"--pid-file={m}/pid", f"--seed-file={m}/seed",
            ],
        )  # fmt: skip
        _wait((m / "sock").exists, 10, "munged did not create its socket")
        self._start("slurmctld", ["slurmctld", "-D", "-i"])
        for node in self.nodes:
            self.start_node(node)
        _wait(self._all_idle, 30, "the nodes did not come up idle", self._logs)

    def start_node(self, node: str) -> None:
        self._start(f"slurmd-{node}", ["slurmd", "-D", "-N", node])

    def kill_node(self, node: str) -> None:
        """The node crashes: SIGKILL its slurmd, its step daemons (slurmstepd, which Slurm
        detaches from slurmd) and their processes (SLURMD_NODENAME=node), as a power loss
        would; the controller then finds it unresponsive and fails its jobs (NODE_FAIL).

        Every one of them is frozen (SIGSTOP) before any is killed: a daemon that outlives
        another by a moment reports what it sees — srun losing its step's daemon exits
        non-zero, and the batch step's daemon reported that as FAILED, exit 233, instead of
        the node's loss. Step daemons are found by their title, `slurmstepd: [JOB.STEP]`,
        for the jobs the controller has on the node (found as the parents of processes
        with the node's environment, a batch step's daemon was missed: 2 CI runs in many),
        the node's other processes by their environment, and everything below them."""
        jobs = self.run("squeue", "-h", "-w", node, "-o", "%A", check=False).split()
        titles = tuple(f"slurmstepd: [{job}.".encode() for job in jobs)
        slurmd = self.procs.pop(f"slurmd-{node}")
        marker = f"SLURMD_NODENAME={node}".encode()
        mine = f"SLURM_CONF={self.conf}".encode()
        parents: dict[int, int] = {}
        doomed: set[int] = set()
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            pid = int(pid_dir.name)
            with suppress(OSError, IndexError, ValueError):
                parents[pid] = int((pid_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if titles and (pid_dir / "cmdline").read_bytes().startswith(titles):
                    doomed.add(pid)
                names = (pid_dir / "environ").read_bytes().split(b"\0")
                if marker in names and mine in names:
                    doomed.add(pid)
        # With their step daemons, every process below them (the batch script, srun, the
        # workers), whatever their environment says.
        grown = True
        while grown:
            below = {pid for pid, parent in parents.items() if parent in doomed} - doomed
            doomed |= below
            grown = bool(below)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in [slurmd.pid, *sorted(doomed)]:
                with suppress(OSError):
                    os.kill(pid, sig)
        slurmd.wait(10)

    def _all_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-p", "cpn", "-o", "%N %t", check=False)
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return len(states) == len(self.nodes) and all(s == "idle" for s in states.values())

    def _logs(self) -> str:
        out = []
        for p in sorted((self.root / "log").glob("*")):
            out.append(
                f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            )
        return "\n".join(out)

    def stop(self) -> None:
        # Daemons first, munge last: slurmd's and slurmctld's shutdowns still authenticate.
        order = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.reap_jobs()

    def reap_jobs(self) -> None:
        """Kill what jobs left behind: processes of a job of this cluster (their
        environment has its SLURM_CONF and a SLURM_JOB_ID), and its slurmstepd daemons;
        both outlive a SIGKILLed slurmd."""
        mine = f"SLURM_CONF={self.conf}".encode()
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
                continue
            try:
                environ = (pid_dir / "environ").read_bytes()
                cmdline = (pid_dir / "cmdline").read_bytes()
            except OSError:
                continue
            names = environ.split(b"\0")
            in_job = mine in names and any(n.startswith(b"SLURM_JOB_ID=") for n in names)
            if in_job or (b"slurmstepd" in cmdline and mine in names):
                with suppress(OSError):
                    os.kill(int(pid_dir.name), signal.SIGKILL)

    def squeue_ids(self) -> list[str]:
        """Ids of jobs still pending or running (what `squeue` shows by default)."""
        out = self.run("squeue", "-h", "-t", "PD,CF,R,CG,S", "-o", "%i")
        return [line.strip() for line in out.splitlines() if line.strip()]


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _wait(
    ok: Callable[[], bool], timeout: float, what: str, detail: Callable[[], str] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.1)
    extra = detail() if detail is not None else ""
    raise ClusterError(f"{what} within {timeout} s\n{extra}")


@contextmanager
def slurm_cluster(
    root: Path, nodes: int = 4, gpus: int = GPUS_PER_NODE, conf_extra: tuple[str, ...] = ()
) -> Iterator[SlurmCluster]:
    """A running cluster of `nodes` nodes (node1…nodeN) in `root`; stopped on exit.

    Raises ClusterError (the tests fail) when a binary is missing or a daemon does not
    come up: CI installs Slurm, so a cluster that cannot start is a failure, not a skip."""
    missing = missing_binaries()
    if missing:
        raise ClusterError(
            f"Slurm is not installed here (missing {', '.join(missing)}): run scripts/setup.sh "
            "as root (apt-get install slurmctld slurmd slurm-client munge)"
        )
    cluster = SlurmCluster(
        root, [f"node{i + 1}" for i in range(nodes)], gpus, conf_extra=conf_extra
    )
    cluster.write_config()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
