"""A site's request for a checkpoint soon: SIGUSR2, turned into a file's newer mtime.

A site engine warns a launch before it ends it (Slurm: `sbatch --signal=USR2@N`, N
seconds before the time limit, and at preemption where the site sets
`PreemptParameters=send_user_signal`). The signal may reach the node's launcher, its
workers, or both (Slurm signals a step's processes as its process tracking finds them):
each of them, given a request file, touches it on SIGUSR2 instead of dying of the
signal's default action, and each worker asks for a checkpoint when the file's mtime is
newer than the last request it saw. The workers then agree on the step through
`cpn.comm.flag.StepMax` (a checkpoint is collective).
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from types import FrameType

#: The signal a site engine sends to ask for a checkpoint.
CHECKPOINT_SIGNAL = signal.SIGUSR2


def touch_on_signal(path: Path) -> None:
    """Touch `path` on CHECKPOINT_SIGNAL (main thread only, as every Python handler)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        # A full disk must not end the process that the signal only warned.
        with contextlib.suppress(OSError):
            path.touch()

    signal.signal(CHECKPOINT_SIGNAL, handler)


class CheckpointRequest:
    """The time of the newest request in the file (its mtime, ns), or 0 while there is
    none newer than when this object was made (an earlier epoch's does not count)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._start = self._mtime()

    def _mtime(self) -> int:
        try:
            return self.path.stat().st_mtime_ns
        except OSError:
            return 0

    def newest(self) -> int:
        mtime = self._mtime()
        return mtime if mtime > self._start else 0
