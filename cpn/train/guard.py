"""`python -m cpn.train.guard PROGRAM ARGS...`: run PROGRAM so that it dies with its parent.

The launcher starts every worker through this: it asks the kernel (Linux
`PR_SET_PDEATHSIG`) to SIGKILL the process when its parent — torch's elastic agent, in the
launcher — dies, then replaces itself with PROGRAM (the request survives exec). A
launcher ended by SIGKILL, or an agent's launcher killed after its grace period, never
leaves workers behind. torch's agent starts workers in sessions of their own, so killing
the launcher's process group alone would not reach them. Elsewhere than Linux it just
runs PROGRAM.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m cpn.train.guard PROGRAM [ARGS...]")
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the request took effect
            sys.exit(1)
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv)
