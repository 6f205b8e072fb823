"""Per-worker checkpoints, written atomically, and the marker that makes a step complete.

Layout: `DIR/step-00000100/rank-00003.pt` for every worker, then `DIR/step-00000100/COMPLETE`
written by rank 0 once every worker has written its file (after a barrier). Each file is
written to a temporary name and renamed, so a crash never leaves a half-written file
under the real name, and a step without COMPLETE is ignored on resume.

A worker's file holds its shard of the model, its optimizer state, its gradient-sync
state (top-k residuals differ from worker to worker), the step and the RNG states: what
it takes to continue the same trajectory exactly.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from cpn.errors import InputError

MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def rank_file(root: Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank-{rank:05d}.pt"


def save(root: Path, step: int, rank: int, state: dict[str, Any]) -> None:
    path = rank_file(root, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def mark_complete(root: Path, step: int) -> None:
    marker = step_dir(root, step) / MARKER
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(f"{step}\n")
    os.replace(tmp, marker)


def latest_complete(root: Path) -> int | None:
    """The last step with a complete checkpoint, or None."""
    if not root.is_dir():
        return None
    steps = [
        int(m.group(1))
        for p in root.iterdir()
        if (m := STEP_DIR.match(p.name)) and (p / MARKER).is_file()
    ]
    return max(steps, default=None)


def load(root: Path, step: int, rank: int) -> dict[str, Any]:
    path = rank_file(root, step, rank)
    if not path.is_file():
        raise InputError(f"checkpoint {path}: missing (written by a different layout?)")
    state: dict[str, Any] = torch.load(path, weights_only=False)
    return state
