"""Where a launch keeps each plan rank's files, by name.

Its own module, without torch: the site agent follows these files (logs, metrics, the
checkpoint request, the WAN links it writes) and never starts a worker itself, so it does
not pay torch's import (seconds of CPU per agent start).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

#: Lines of a failed worker's log that its error carries.
TAIL_LINES = 20


@dataclass(frozen=True)
class RunFiles:
    """Where a launch keeps each plan rank's files."""

    root: Path

    def log(self, rank: int) -> Path:
        return self.root / f"rank-{rank}.log"

    @property
    def checkpoint_request(self) -> Path:
        """Touched to ask the node's workers for a checkpoint (checkpoint_request.py)."""
        return self.root / "checkpoint-request"

    @property
    def wan_links(self) -> Path:
        """wan: auto — the site agent's newest WAN measurements (cpn.train.links_file)."""
        return self.root / "wan-links.json"

    def stdout(self, rank: int) -> Path:
        return self.root / f"rank-{rank}.out"

    def error(self, rank: int) -> Path:
        return self.root / f"rank-{rank}.error.json"

    def metrics(self, rank: int) -> Path:
        return self.root / f"rank-{rank}.metrics.jsonl"

    @property
    def metrics_template(self) -> str:
        """What `cpn worker --metrics` takes: the path with {rank} in it."""
        return str(self.root / "rank-{rank}.metrics.jsonl")

    def tail(self, rank: int, lines: int = TAIL_LINES) -> list[str]:
        out: list[str] = []
        for path in (self.log(rank), self.stdout(rank)):
            with contextlib.suppress(OSError):
                out.extend(path.read_text(errors="replace").splitlines())
        return [line for line in out if line.strip()][-lines:]
