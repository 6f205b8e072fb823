"""Helpers for runtime tests: plan a tiny job with the real scheduler, run its workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cpn.contracts import JobSpec, Plan, Topology
from cpn.contracts.plan import ShardPlacement, SolverReport
from cpn.costmodel import Workload
from cpn.scheduler import Objective, SolverSettings, plan_job
from cpn.scheduler.instance import build_instance
from cpn.scheduler.realize import to_plan
from cpn.train.launcher import train_local
from cpn.train.report import StepSummary, summarise
from cpn.train.trainer import TrainOptions

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
    tmp: Path, name: str, job_doc: dict[str, Any], plan: Plan | None = None, **options: Any
) -> list[StepSummary]:
    """Every worker of the job's plan (or `plan`) through the launcher, as `cpn train` runs
    them; `options` are `TrainOptions` fields."""
    job_path, plan_path, planned = write_run(tmp, name, job_doc)
    if plan is not None:
        plan_path.write_text(plan.model_dump_json(indent=1))
    world = (plan or planned).parallel.world_size
    records = train_local(plan_path, job_path, TrainOptions(**options), tmp / name / "work", world)
    return summarise(records)


def replica_per_site(job_doc: dict[str, Any]) -> Plan:
    """A plan that puts replica r wholly at site r: data parallelism spans the sites.

    The scheduler would rather not do that for a tiny dense job; the runtime tests need
    it to exercise the cross-site exchange. Predictions come from the same cost model.
    """
    topology = Topology.model_validate(TOPOLOGY)
    job = JobSpec.model_validate(job_doc)
    w = Workload.of(job)
    sites = [s.name for s in topology.sites]
    shards = []
    for r in range(w.dp):
        site = topology.sites[r % len(sites)]
        nodes = [n.name for n in topology.nodes() if n.site == site.name]
        for p in range(w.pp):
            shards.append(
                ShardPlacement(
                    replica=r, stage=p, site=site.name, node=nodes[p], gpus=list(range(w.tp))
                )
            )
    inst = build_instance(topology, w)
    report = SolverReport(status="HEURISTIC", seconds=0.0, objective=0.0, bound=0.0, gap=0.0)
    return to_plan(inst, shards, report, "wan_bytes")
