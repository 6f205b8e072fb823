"""The environment a launcher gives its workers, read without importing torch.

`cpn worker` checks its files and this environment before it imports torch (seconds on a
GPU host), so a wrong path or a missing variable is one line at once.
"""

from __future__ import annotations

import os

from cpn.errors import InputError

#: Environment of every worker: the plan ranks of this launcher, by local rank.
PLAN_RANKS_ENV = "CPN_PLAN_RANKS"
#: Set for `cpn worker`: send standard output to the log too, in order.
MERGE_OUTPUT_ENV = "CPN_MERGE_OUTPUT"


def world_from_env() -> tuple[int, int | None]:
    """WORLD_SIZE (required) and RANK (optional) from the torch.distributed environment."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        if not os.environ.get(name):
            raise InputError(f"{name}: not set (the usual torch.distributed environment)")
    try:
        world = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ["RANK"]) if os.environ.get("RANK") else None
    except ValueError as exc:
        raise InputError(f"WORLD_SIZE/RANK: not an integer ({exc})") from None
    return world, rank
