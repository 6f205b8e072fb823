"""Run every worker of a plan on this machine, and read their metrics back.

`cpn train` uses this for demos, tests and benchmarks; in production each site's agent
launches its own workers with `cpn worker`. Workers are real processes with the usual
torch.distributed environment; each writes its per-step metrics as JSON lines to
`WORKDIR/metrics-rank-<r>.jsonl` and its output to `WORKDIR/rank-<r>.log`. If one fails,
the others are stopped and the error names it with the end of its log.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpn.contracts.plan import Plan
from cpn.errors import CpnError


class WorkerFailed(CpnError):
    """A worker exited with an error; the message carries the end of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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


def read_metrics(workdir: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for path in sorted(workdir.glob("metrics-rank-*.jsonl")):
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
            )
        )
    return out


def launch_local(
    plan_path: Path,
    job_path: Path,
    workdir: Path,
    worker_args: Sequence[str] = (),
    progress: Callable[[dict[str, Any]], None] | None = None,
    timeout_s: float = 3600.0,
) -> list[StepSummary]:
    """Start one `cpn worker` per rank, wait for all, return the per-step summaries."""
    plan = Plan.model_validate_json(plan_path.read_text())
    world = plan.parallel.world_size
    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.glob("metrics-rank-*.jsonl"):
        old.unlink()
    env = dict(os.environ)
    env.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(world),
            # One math thread per worker: several workers share this machine's cores.
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        }
    )
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    # The worker that reports the loss: last stage, replica 0, tp index 0.
    reporter = (plan.parallel.pp - 1) * plan.parallel.dp * plan.parallel.tp
    try:
        for rank in range(world):
            log = (workdir / f"rank-{rank}.log").open("wb")
            logs.append(log)
            cmd = [
                sys.executable,
                "-m",
                "cpn",
                "worker",
                "--plan",
                str(plan_path),
                "--job",
                str(job_path),
                "--rank",
                str(rank),
                "--metrics",
                str(workdir / f"metrics-rank-{rank}.jsonl"),
                *worker_args,
            ]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        _wait(procs, workdir, reporter, progress, timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    return summarise(read_metrics(workdir))


def _wait(
    procs: list[subprocess.Popen[bytes]],
    workdir: Path,
    reporter: int,
    progress: Callable[[dict[str, Any]], None] | None,
    timeout_s: float,
) -> None:
    deadline = time.monotonic() + timeout_s
    seen = 0
    metrics = workdir / f"metrics-rank-{reporter}.jsonl"
    while True:
        codes = [p.poll() for p in procs]
        if progress is not None and metrics.exists():
            lines = metrics.read_text().splitlines()
            for line in lines[seen:]:
                if line.strip():
                    progress(json.loads(line))
            seen = len(lines)
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank = failed[0]
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            tail = (workdir / f"rank-{rank}.log").read_text(errors="replace").strip()
            last = tail.splitlines()[-1] if tail else "(no output)"
            raise WorkerFailed(f"worker {rank} exited with status {codes[rank]}: {last}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise WorkerFailed(f"workers still running after {timeout_s:.0f} s")
        time.sleep(0.1)
