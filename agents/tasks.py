"""A worker's state as the agent reports it: one place for the task states, for what a
worker writes about itself, and for the ReportTaskStatus message.

The states (proto `TaskState`, one comment each):
  STARTING   the agent started the node's launcher; the rendezvous may be waiting;
  RUNNING    the worker process runs (and may report steps);
  SUCCEEDED  the worker exited 0;
  FAILED     the worker exited non-zero or could not start (exit code and why);
  STOPPED    a stop order ended it, or the launcher did because another worker failed;
and from a site engine (Slurm, Kubernetes), whose word says who ended the work:
  PENDING    queued by the engine, not started yet;
  CANCELLED  cancelled at the site, not by cpn (an operator's scancel);
  PREEMPTED  the engine took the nodes back for other work;
  NODE_LOST  a node of the launch failed.
All but STARTING, RUNNING and PENDING are terminal: nothing follows them for that launch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from proto.cpn.v1 import agent_pb2 as pb

ENDED: frozenset[pb.TaskState.ValueType] = frozenset(
    {
        pb.TASK_STATE_SUCCEEDED,
        pb.TASK_STATE_FAILED,
        pb.TASK_STATE_STOPPED,
        pb.TASK_STATE_CANCELLED,
        pb.TASK_STATE_PREEMPTED,
        pb.TASK_STATE_NODE_LOST,
    }
)
LINK_CLASSES = ("intra_node", "intra_site", "wan")
MAX_MESSAGE = 4096
MAX_CHECKPOINT_ID = 256


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
    epoch: int = 0  # the launch order's epoch (fencing: the control plane drops older ones)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def request(self, site: str, agent_id: str, lease_id: str) -> pb.ReportTaskStatusRequest:
        """This update as the protocol's ReportTaskStatus request."""
        request = pb.ReportTaskStatusRequest(
            site=site,
            agent_id=agent_id,
            lease_id=lease_id,
            job_id=self.job_id,
            rank=self.rank,
            state=self.state,
            step=self.step,
            bytes=pb.LinkBytes(
                intra_node=self.bytes_intra_node,
                intra_site=self.bytes_intra_site,
                wan=self.bytes_wan,
            ),
            checkpoint_id=self.checkpoint_id,
            exit_code=self.exit_code,
            message=self.message[:MAX_MESSAGE],
            epoch=self.epoch,
        )
        if self.loss is not None:
            request.loss = self.loss
        return request


def with_status_line(update: TaskUpdate, fields: dict[str, Any]) -> TaskUpdate:
    """One line of the agents.status format: totals that override field by field."""
    changes: dict[str, Any] = {}
    if isinstance(fields.get("step"), int):
        changes["step"] = max(0, fields["step"])
    if isinstance(fields.get("loss"), int | float):
        changes["loss"] = float(fields["loss"])
    sent = fields.get("bytes")
    if isinstance(sent, dict):
        for key in LINK_CLASSES:
            if isinstance(sent.get(key), int):
                changes[f"bytes_{key}"] = max(0, sent[key])
    if isinstance(fields.get("checkpoint_id"), str):
        changes["checkpoint_id"] = fields["checkpoint_id"][:MAX_CHECKPOINT_ID]
    if isinstance(fields.get("message"), str):
        changes["message"] = fields["message"][:MAX_MESSAGE]
    return replace(update, **changes)


def with_metrics(update: TaskUpdate, record: dict[str, Any]) -> TaskUpdate:
    """One `cpn worker --metrics` record: step `n` done means n + 1 steps; bytes are that
    step's, added to the running totals."""
    changes: dict[str, Any] = {}
    if isinstance(record.get("step"), int):
        changes["step"] = max(update.step, record["step"] + 1)
    if isinstance(record.get("loss"), int | float):
        changes["loss"] = float(record["loss"])
    sent = record.get("bytes")
    if isinstance(sent, dict):
        for key in LINK_CLASSES:
            if isinstance(sent.get(key), int):
                name = f"bytes_{key}"
                changes[name] = getattr(update, name) + max(0, sent[key])
    return replace(update, **changes)
