"""Helpers for runtime tests: plan a tiny job with the real scheduler, run its workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cpn.contracts import JobSpec, Plan, Topology
from cpn.scheduler import Objective, SolverSettings, plan_job
from cpn.train.launch import StepSummary, launch_local

#: Two sites of two 2-GPU nodes: big enough for dp2×tp2×pp2 with both sites in use.
TOPOLOGY: dict[str, Any] = {
    "sites": [
        {
            "name": s,
            "intra_site_gbps": 100,
            "nodes": [
                {
                    "name": "n",
                    "count": 2,
                    "gpu": {"model": "V", "count": 2, "memory_gb": 16, "tflops": 10},
                    "intra_node_gbps": 200,
                }
            ],
        }
        for s in ("east", "west")
    ],
    "links": [
        {"a": "east", "b": "west", "bandwidth_gbps": 1, "latency_ms": 10, "transport": "tcp"}
    ],
}


def tiny_job(dp: int, tp: int, pp: int, steps: int = 20, **compression: Any) -> dict[str, Any]:
    return {
        "name": "tiny",
        "model": {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 256},
        "train": {
            "global_batch": 8,
            "micro_batch": 2,
            "dtype": "fp32",
            "steps": steps,
            "lr": 0.001,
        },
        "parallel": {"dp": dp, "tp": tp, "pp": pp},
        "compression": compression or {"wan": "none"},
    }


def write_run(
    tmp: Path, name: str, job_doc: dict[str, Any], objective: Objective = Objective.ITERATION_TIME
) -> tuple[Path, Path, Plan]:
    """Plan the job on TOPOLOGY and write job and plan files; returns their paths."""
    d = tmp / name
    d.mkdir(parents=True, exist_ok=True)
    job_path, plan_path = d / "job.yaml", d / "plan.json"
    job_path.write_text(yaml.safe_dump(job_doc))
    plan = plan_job(
        Topology.model_validate(TOPOLOGY),
        JobSpec.model_validate(job_doc),
        objective=objective,
        settings=SolverSettings(time_limit=3),
    )
    plan_path.write_text(plan.model_dump_json(indent=1))
    return job_path, plan_path, plan


def run(
    tmp: Path, name: str, job_doc: dict[str, Any], *args: str, plan: Plan | None = None
) -> list[StepSummary]:
    job_path, plan_path, _ = write_run(tmp, name, job_doc)
    if plan is not None:
        plan_path.write_text(plan.model_dump_json(indent=1))
    return launch_local(plan_path, job_path, tmp / name / "work", list(args), timeout_s=600)
