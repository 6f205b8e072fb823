"""Run a function on N real gloo ranks and collect what each returns.

Through the runtime's own launcher (`cpn.train.launcher.run_function`, torch's elastic
agent): each rank joins a real `torch.distributed` gloo group, calls `fn(rank, world,
*args)` and its return value comes back; a rank that raises fails the call with its
message after the others were ended. A hang is ended by pytest's timeout.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpn.train.launcher import run_function


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """`fn(rank, world, *args)` on every rank; the list of results by rank."""
    with tempfile.TemporaryDirectory() as run_dir:
        return run_function(fn, world, *args, run_dir=Path(run_dir))
