"""Per-step metrics of a run, as the workers write them, summed up per step."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class StepSummary:
    """One training step over all workers."""

    step: int
    loss: float  # mean over replicas of their last stage's mean loss
    seconds: float  # the slowest worker's step
    compute: float  # max over workers
    pipeline: float
    dp_sync: float
    bytes: dict[str, int] = field(default_factory=dict)  # summed over workers
    tokens: int = 0  # summed over replicas
    skipped: bool = False  # the gradient was not finite: no optimizer step


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of every worker's metrics file in `run_dir` (`rank-R.metrics.jsonl`)."""
    records: list[dict[str, Any]] = []
    for path in sorted(run_dir.glob("rank-*.metrics.jsonl")):
        with path.open() as f:
            records.extend(json.loads(line) for line in f if line.strip())
    return records


def summarise(records: Sequence[dict[str, Any]]) -> list[StepSummary]:
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_step[r["step"]].append(r)
    out = []
    for step in sorted(by_step):
        rs = by_step[step]
        losses = [r["loss"] for r in rs if r["loss"] is not None and r["tp_index"] == 0]
        total: dict[str, int] = defaultdict(int)
        for r in rs:
            for k, v in r["bytes"].items():
                total[k] += v
        out.append(
            StepSummary(
                step=step,
                loss=sum(losses) / len(losses) if losses else float("nan"),
                seconds=max(r["seconds"]["step"] for r in rs),
                compute=max(r["seconds"]["compute"] for r in rs),
                pipeline=max(r["seconds"]["pipeline"] for r in rs),
                dp_sync=max(r["seconds"]["dp_sync"] for r in rs),
                bytes=dict(total),
                tokens=sum(r["tokens"] for r in rs if r["stage"] == 0 and r["tp_index"] == 0),
                skipped=any(r.get("skipped", False) for r in rs),
            )
        )
    return out
