"""What a site's engine must do for the agent: the site-backend interface.

An agent hands each launch order to its site's backend: `local` starts the launcher as a
child process (cpn/train/launcher.py through `cpn launch`), `slurm` submits one batch job
per (job, epoch) to the site's Slurm, `kubernetes` creates one Indexed Job. Whatever the
engine, the workers write the same files per plan rank into the launch's run directory
(which must be on storage the agent reads: a shared filesystem on a cluster), so the
agent follows steps, losses and log lines the same way for every backend; the backend
only starts, watches and ends the launch.

The contract, per method:

  submit(spec)     start the launch and return its handle. Idempotent on (job id, epoch):
                   a second submit of the same pair returns the first one's handle and
                   starts nothing, so a retried order never launches twice.
  poll(handle)     the launch's state now (a `Status`: cpn's state, the engine's own
                   state, why, restarts, exit code).
  cancel(h, grace) end it: a signal the workers can checkpoint on, then a kill after
                   `grace` seconds; returns once the engine no longer runs it.
  logs(h, node)    where node rank `node`'s launcher writes its own output.
  capacity()       the nodes and GPUs the engine offers now (what the agent registers).
  adopt()          the launches of this agent that the engine still runs: an agent that
                   restarts follows them again instead of launching new ones.

States (`State`, one comment each below): every backend maps its engine's native states
onto these in one table (`local.py: LOCAL_STATES`, `slurm.py: SLURM_STATES`). cpn owns
retries and re-planning: no backend asks its engine to restart or requeue a launch.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from proto.cpn.v1 import agent_pb2 as pb

#: In a command of a LaunchSpec, filled in by the backend: the rendezvous port (where it
#: picks the port itself: rdzv_port 0), the head node's address, and the address other
#: nodes reach this node's workers on (a Slurm node's NodeAddr, a pod's IP).
PORT_PLACEHOLDER = "{rdzv_port}"
HEAD_PLACEHOLDER = "{rdzv_addr}"
LOCAL_PLACEHOLDER = "{local_addr}"


class State(enum.Enum):
    """A launch's state, the same for every engine."""

    PENDING = "PENDING"  # accepted by the engine, waiting for resources
    STARTING = "STARTING"  # resources given, processes starting (rendezvous may wait)
    RUNNING = "RUNNING"  # the workers run
    SUCCEEDED = "SUCCEEDED"  # every worker exited 0
    FAILED = "FAILED"  # a worker (or the launch itself) failed: exit code and why
    CANCELLED = "CANCELLED"  # ended by a cancel: cpn's stop order, or someone else's
    PREEMPTED = "PREEMPTED"  # the engine took the resources back for other work
    NODE_LOST = "NODE_LOST"  # a node under the launch failed (down, unreachable)
    UNKNOWN = "UNKNOWN"  # the engine says something this table does not know


#: States after which nothing more happens to a launch.
FINAL: frozenset[State] = frozenset(
    {State.SUCCEEDED, State.FAILED, State.CANCELLED, State.PREEMPTED, State.NODE_LOST}
)


@dataclass(frozen=True)
class Status:
    """A launch's state as its engine reports it, with the engine's own words."""

    state: State
    native: str = ""  # the engine's state, verbatim (Slurm's `job_state`, a Job condition)
    reason: str = ""  # why, one line (the engine's reason, a failed worker's error)
    restarts: int = 0  # how often the engine restarted it (cpn asks for none)
    exit_code: int | None = None  # None while it runs, or when the engine does not say

    @property
    def ended(self) -> bool:
        return self.state in FINAL

    def task_state(self) -> tuple[pb.TaskState.ValueType, str]:
        """The protocol's TaskState for this status, and the message to send with it: the
        state's name and the engine's own words ("PREEMPTED: Slurm job 12 PREEMPTED"), so
        that a rank's message says what the site's engine said. UNKNOWN (the engine has
        no record) is FAILED on the wire: the agent reports it only once it gave up."""
        state, detail = self.state, self.reason or self.native
        said = f"{state.value}: {detail}" if detail else state.value
        if state is State.STARTING:
            return pb.TASK_STATE_STARTING, ""
        if state is State.RUNNING:
            return pb.TASK_STATE_RUNNING, ""
        if state is State.SUCCEEDED:
            return pb.TASK_STATE_SUCCEEDED, ""
        if state is State.FAILED:  # the wire says FAILED itself
            return pb.TASK_STATE_FAILED, detail or "FAILED"
        return _WIRE.get(state, pb.TASK_STATE_FAILED), said


#: The engine's states that have a protocol state of their own (the rest: task_state()).
_WIRE: dict[State, pb.TaskState.ValueType] = {
    State.PENDING: pb.TASK_STATE_PENDING,
    State.CANCELLED: pb.TASK_STATE_CANCELLED,
    State.PREEMPTED: pb.TASK_STATE_PREEMPTED,
    State.NODE_LOST: pb.TASK_STATE_NODE_LOST,
}


@dataclass(frozen=True)
class NodeShare:
    """One node of a launch: the plan ranks it runs, in local-rank order, and the GPUs
    the plan gave them on that node (same order)."""

    node: str  # the plan's node name
    ranks: tuple[int, ...]
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class LaunchSpec:
    """One launch of a job's shards on this site, as every backend takes it.

    Node rank k runs `commands[k]` (a full argv) with `nodes[k]`'s ranks; node rank 0 is
    the head node, which serves the rendezvous when `rdzv_host` is True."""

    job_id: str
    nodes: tuple[NodeShare, ...]
    commands: tuple[tuple[str, ...], ...]  # per node rank
    run_dir: Path  # the launch's files (shared storage on a cluster)
    env: Mapping[str, str] = field(default_factory=dict)
    time_limit_s: int = 24 * 3600  # finite: an engine never holds GPUs for ever
    rdzv_port: int = 0  # the rendezvous port (0: the backend picks a free one)
    rdzv_addr: str = ""  # where the rendezvous is ("": the head node)
    rdzv_host: bool = True  # this site's head node serves the rendezvous store
    epoch: int = 0  # the launch's epoch: (job id, epoch) names one launch
    #: Seconds the workers have between the stop signal and the kill (the agent's stop
    #: grace): engines that kill by themselves (Kubernetes' pods) are told it up front.
    stop_grace_s: float = 10.0

    @property
    def procs_per_node(self) -> int:
        return max(len(n.ranks) for n in self.nodes)

    @property
    def gpus_per_node(self) -> int:
        return max(len(n.gpus) for n in self.nodes)

    @property
    def key(self) -> str:
        """The launch's name at the engine: the same for a retried submit."""
        return f"cpn-{self.job_id}-e{self.epoch}"

    def node_dir(self, node_rank: int) -> Path:
        """Node rank k's own directory in the run directory (its launcher's result)."""
        return self.run_dir / f"node-{node_rank}"


@dataclass
class Handle:
    """A launch the engine knows: enough to poll, cancel and adopt it."""

    job_id: str
    epoch: int
    native_id: str  # Slurm's job id, a Job's name, a local launcher's pid
    run_dir: Path
    nodes: tuple[NodeShare, ...] = ()


@dataclass(frozen=True)
class NodeCapacity:
    name: str
    gpus: int
    usable: bool = True  # False: down, drained, not ready (its GPUs are lost to cpn)
    state: str = ""  # the engine's words for the node
    address: str = ""


@dataclass(frozen=True)
class Capacity:
    nodes: tuple[NodeCapacity, ...]

    @property
    def gpus(self) -> int:
        return sum(n.gpus for n in self.nodes if n.usable)


class BackendError(Exception):
    """The engine refused or cannot be reached; the message is one line, sent to the
    control plane as the launch's reason (or printed at agent start)."""


class SiteBackend(Protocol):
    """The interface every site engine implements (see the module's docstring)."""

    name: str
    #: True: the agent serves every node of its site through this engine (Slurm,
    #: Kubernetes); False: only its own node (local processes).
    site_wide: bool
    #: Seconds between polls of one launch.
    poll_interval_s: float

    async def check(self) -> None:
        """At agent start: raise BackendError (one line) when the engine cannot serve."""

    async def submit(self, spec: LaunchSpec) -> Handle: ...

    async def poll(self, handle: Handle) -> Status: ...

    async def wait(self, handle: Handle, timeout_s: float) -> None:
        """Return after `timeout_s`, or sooner when the launch may have changed."""

    async def cancel(self, handle: Handle, grace_s: float) -> None: ...

    def logs(self, handle: Handle, node_rank: int) -> Path: ...

    async def capacity(self) -> Capacity: ...

    async def adopt(self) -> Sequence[Handle]: ...

    def forget(self, handle: Handle) -> None:
        """The launch ended and was reported: drop what the backend keeps for it."""
