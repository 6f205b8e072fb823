"""A value every rank contributes to each step, agreed by every rank a step later without
waiting for it (the maximum over the ranks).

What it is for: a site's engine warns some workers that their time is nearly up (Slurm's
`--signal=USR2@N` before a time limit or a preemption); a checkpoint is collective, so
every rank must choose the same step for it. Each step, every rank adds its value (the
time of the newest request it saw) to one asynchronous MAX all-reduce over the world and
reads the previous step's result: the exchange overlaps a whole step, and all ranks read
the same sequence of results, so they agree on where to act. One eight-byte all-reduce
per step; it is a control message, like the rendezvous, and not counted in `Traffic`
(which holds the training's data bytes, the ones the cost model predicts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpn.comm.collectives import guarded
from cpn.comm.traffic import Traffic

OPERATION = "agree on a checkpoint request"


class StepMax:
    """`exchange(value)` once per step on every rank, in the same place of the loop."""

    def __init__(self, device: torch.device, traffic: Traffic) -> None:
        self.device, self.traffic = device, traffic
        self._ranks = tuple(range(dist.get_world_size()))
        self._buf: torch.Tensor | None = None
        self._work: dist.Work | None = None

    def exchange(self, value: int) -> int:
        """Send this step's value; the maximum of the previous exchange (0 at first)."""
        agreed = self._finish()
        self._buf = torch.tensor([value], dtype=torch.int64, device=self.device)
        buf = self._buf
        self._work = guarded(
            OPERATION,
            self._ranks,
            self.traffic,
            lambda: dist.all_reduce(buf, op=dist.ReduceOp.MAX, async_op=True),
        )
        return agreed

    def close(self) -> int:
        """Wait for the last exchange (before the process group goes); its result."""
        return self._finish()

    def _finish(self) -> int:
        work, buf = self._work, self._buf
        self._work = self._buf = None
        if work is None or buf is None:
            return 0
        guarded(OPERATION, self._ranks, self.traffic, work.wait)
        return int(buf.item())
