"""cpn against DT-FM's genetic algorithm on DT-FM's own heterogeneous scenarios.

    .venv/bin/python bench/dtfm.py --markdown     # about 5 minutes
    .venv/bin/python bench/dtfm.py --quick        # DT-FM's own scale only (64 GPUs)

DT-FM (Yuan et al., NeurIPS 2022) schedules a dp × pp job over devices spread across
regions with a memetic genetic algorithm (`cpn/scheduler/dtfm.py`). Here both schedulers
place the same job on the same topology in the same run, and both are scored by cpn's cost
model for the objective compared (the GA's fitness *is* that objective):

  - DT-FM's scale: its multi-universities (2 regions), regional (4 US regions) and
    worldwide (8 regions, measured AWS links) scenarios with 64 A100s, one site per
    region, and its task shape: GPT-3 XL (1.3B), dp 8 × tp 1 × pp 8;
  - scaled to the scheduler bench's sizes: every region split into several sites (joined
    at DT-FM's in-region 2 Gb/s, 10 ms) and the bench's 13B GPT at tp = 8.

cpn gets 10 s; the GA gets the same unless `--ga-seconds` gives it more (it stops earlier
after DT-FM's 4900 trials). Columns: objective value of each plan, seconds, cpn ÷ GA
(≤ 1: cpn is as good or better), the gap cpn proves, and how many partitions the GA
scored.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from cpn.contracts import JobSpec
from cpn.costmodel import Workload
from cpn.scheduler import Objective, SolverSettings, plan_job
from cpn.scheduler.dtfm import GaSettings, dtfm_ga
from cpn.scheduler.instance import build_instance
from cpn.scheduler.solve import objective_key
from cpn.synthetic import benchmark_job, dtfm_topology

BUDGET = 10.0
#: Relative slack for the time objective: CP-SAT's time model rounds its coefficients.
TIME_TOLERANCE = 2e-3


def gpt3_xl() -> JobSpec:
    """DT-FM's task: GPT-3 XL, 8 × 8 devices, ~1M tokens per iteration, fp16."""
    return JobSpec.model_validate(
        {
            "name": "gpt3-xl",
            "model": {"layers": 24, "hidden": 2048, "heads": 16, "seq_len": 2048, "vocab": 50257},
            "train": {"global_batch": 512, "micro_batch": 1, "dtype": "fp16", "steps": 1000},
            "parallel": {"dp": 8, "tp": 1, "pp": 8},
        }
    )


#: (scenario, sites per region, nodes per site, job maker)
SETTINGS = [
    ("multi-universities", 1, 4, gpt3_xl),
    ("regional", 1, 2, gpt3_xl),
    ("worldwide", 1, 1, gpt3_xl),
    ("regional", 4, 4, lambda: benchmark_job(512)),
    ("worldwide", 2, 4, lambda: benchmark_job(512)),
    ("worldwide", 8, 8, lambda: benchmark_job(4096)),
]


@dataclass
class Row:
    scenario: str
    sites: int
    gpus: int
    layout: str
    objective: str
    cpn: float
    cpn_seconds: float
    cpn_gap: float
    ga: float
    ga_seconds: float
    ga_evaluations: int
    ga_trials: int

    @property
    def ratio(self) -> float:
        return self.cpn / self.ga if self.ga else 1.0

    @property
    def holds(self) -> bool:
        slack = TIME_TOLERANCE if self.objective == "iteration_time" else 0.0
        return self.cpn <= self.ga * (1 + slack) and self.cpn_seconds <= BUDGET * 1.05


def run(
    scenario: str,
    per_region: int,
    nodes: int,
    job: JobSpec,
    objective: Objective,
    ga_seconds: float,
) -> Row:
    topo = dtfm_topology(scenario, per_region, nodes)
    inst = build_instance(topo, Workload.of(job))
    start = time.perf_counter()
    plan = plan_job(topo, job, objective=objective, settings=SolverSettings(time_limit=BUDGET))
    cpn_seconds = time.perf_counter() - start
    ga = dtfm_ga(inst, objective_key(objective), GaSettings(time_limit=ga_seconds))
    if ga is None:
        raise RuntimeError(f"the GA found no placement on {scenario}")
    value = (
        (lambda ev: float(ev.wan))
        if objective is Objective.WAN_BYTES
        else (lambda ev: ev.iteration_seconds)
    )
    p = job.fixed_parallel
    return Row(
        scenario=scenario,
        sites=len(topo.sites),
        gpus=sum(n.spec.gpu.count for n in topo.nodes()),
        layout=f"{p.dp}×{p.tp}×{p.pp}",
        objective=objective.value,
        cpn=plan.solver.objective,
        cpn_seconds=cpn_seconds,
        cpn_gap=plan.solver.gap,
        ga=value(ga.evaluation),
        ga_seconds=ga.seconds,
        ga_evaluations=ga.evaluations,
        ga_trials=ga.trials,
    )


def fmt(objective: str, x: float) -> str:
    return f"{x / 1e9:.2f} GB" if objective == "wan_bytes" else f"{x:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="DT-FM's own scale (64 GPUs) only")
    ap.add_argument(
        "--ga-seconds", type=float, default=BUDGET, help="the GA's budget (default: cpn's)"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    settings = SETTINGS[:3] if args.quick else SETTINGS
    started, load_before = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg()[0]
    rows = [
        run(scenario, per_region, nodes, make(), objective, args.ga_seconds)
        for scenario, per_region, nodes, make in settings
        for objective in (Objective.WAN_BYTES, Objective.ITERATION_TIME)
    ]
    summary: dict[str, Any] = {
        "rows_where_cpn_holds": sum(r.holds for r in rows),
        "rows": len(rows),
        "worst_cpn_over_ga": max(r.ratio for r in rows),
        "worst_cpn_seconds": max(r.cpn_seconds for r in rows),
        "started": started,
        "load_average_before_and_after": [load_before, os.getloadavg()[0]],
    }
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "summary": summary}, indent=2))
        return
    columns = (
        "scenario",
        "sites",
        "GPUs",
        "dp×tp×pp",
        "objective",
        "cpn",
        "cpn s",
        "cpn gap",
        "DT-FM GA",
        "GA s",
        "GA partitions",
        "cpn ÷ GA",
    )
    cells = [
        (
            r.scenario,
            str(r.sites),
            str(r.gpus),
            r.layout,
            r.objective,
            fmt(r.objective, r.cpn),
            f"{r.cpn_seconds:.1f}",
            f"{r.cpn_gap:.1%}",
            fmt(r.objective, r.ga),
            f"{r.ga_seconds:.1f}",
            str(r.ga_evaluations),
            "∞" if math.isinf(r.ratio) else f"{r.ratio:.3f}",
        )
        for r in rows
    ]
    out = Console(width=240)
    if args.markdown:
        print("| " + " | ".join(columns) + " |")
        print("|" + "---:|" * len(columns))
        for row in cells:
            print("| " + " | ".join(row) + " |")
    else:
        title = f"cpn vs DT-FM's GA (cpn {BUDGET:.0f} s, GA {args.ga_seconds:.0f} s)"
        table = Table(title=title)
        for col in columns:
            table.add_column(col, justify="right")
        for row in cells:
            table.add_row(*row)
        out.print(table)
    out.print(
        f"cpn ≤ GA within {BUDGET:.0f} s on {summary['rows_where_cpn_holds']} of "
        f"{summary['rows']} rows; worst cpn ÷ GA {summary['worst_cpn_over_ga']:.3f}; "
        f"slowest cpn solve {summary['worst_cpn_seconds']:.1f} s"
    )
    load = summary["load_average_before_and_after"]
    out.print(f"started {started}, load average {load[0]:.1f} before, {load[1]:.1f} after")


if __name__ == "__main__":
    main()
