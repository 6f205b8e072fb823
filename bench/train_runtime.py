"""Runtime benchmark: tokens/s and where a step's time goes, for several 3D layouts.

    .venv/bin/python bench/train_runtime.py            # table
    .venv/bin/python bench/train_runtime.py --json     # one JSON object

Every layout trains the same small GPT (4 layers, hidden 256, 8 heads, seq 128, byte
vocabulary; global batch 16 in micro-batches of 2, fp32) for a few steps on this machine,
all workers real processes on one site (gloo on CPU), data parallelism through the
runtime's default hierarchical sync. Tokens/s is the global batch's
tokens over the median step time after warm-up, and the ratio is against the
single-process run measured in the same invocation. On a machine with fewer cores than
workers the parallel layouts share cores, so the ratios say what the runtime's overhead
costs here, not what a cluster would gain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml
from rich.console import Console
from rich.table import Table

from cpn.contracts import JobSpec, Topology
from cpn.scheduler import SolverSettings, plan_job
from cpn.train.launcher import train_local
from cpn.train.report import StepSummary, summarise
from cpn.train.trainer import TrainOptions

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]
WARMUP = 2


@dataclass
class Row:
    layout: str
    workers: int
    tokens_per_s: float
    vs_single: float
    step_s: float
    compute_s: float
    pipeline_s: float
    dp_sync_s: float
    final_loss: float


def job_doc(dp: int, tp: int, pp: int, steps: int) -> dict[str, object]:
    return {
        "name": "runtime-bench",
        "model": {"layers": 4, "hidden": 256, "heads": 8, "seq_len": 128, "vocab": 256},
        "train": {
            "global_batch": 16,
            "micro_batch": 2,
            "dtype": "fp32",
            "steps": steps,
            "lr": 0.001,
        },
        "parallel": {"dp": dp, "tp": tp, "pp": pp},
    }


def run_layout(root: Path, dp: int, tp: int, pp: int, steps: int) -> list[StepSummary]:
    topo = Topology.model_validate(
        {
            "sites": [
                {
                    "name": "local",
                    "intra_site_gbps": 100,
                    "nodes": [
                        {
                            "name": "n",
                            "count": 4,
                            "gpu": {"model": "cpu", "count": 2, "memory_gb": 16, "tflops": 1},
                            "intra_node_gbps": 100,
                        }
                    ],
                }
            ],
            "links": [],
        }
    )
    doc = job_doc(dp, tp, pp, steps)
    plan = plan_job(topo, JobSpec.model_validate(doc), settings=SolverSettings(time_limit=2))
    d = root / f"{dp}x{tp}x{pp}"
    d.mkdir()
    (d / "job.yaml").write_text(yaml.safe_dump(doc))
    (d / "plan.json").write_text(plan.model_dump_json())
    records = train_local(d / "plan.json", d / "job.yaml", TrainOptions(), d / "work", dp * tp * pp)
    return summarise(records)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    rows: list[Row] = []
    err = Console(stderr=True)
    with tempfile.TemporaryDirectory() as tmp, err.status("") as status:
        for dp, tp, pp in LAYOUTS:
            status.update(f"dp={dp} tp={tp} pp={pp}: {dp * tp * pp} workers")
            steps = run_layout(Path(tmp), dp, tp, pp, args.steps)[WARMUP:]
            step = statistics.median(s.seconds for s in steps)
            tokens = steps[0].tokens
            rows.append(
                Row(
                    layout=f"{dp}×{tp}×{pp}",
                    workers=dp * tp * pp,
                    tokens_per_s=tokens / step,
                    vs_single=0.0,
                    step_s=step,
                    compute_s=statistics.median(s.compute for s in steps),
                    pipeline_s=statistics.median(s.pipeline for s in steps),
                    dp_sync_s=statistics.median(s.dp_sync for s in steps),
                    final_loss=steps[-1].loss,
                )
            )
    for r in rows:
        r.vs_single = r.tokens_per_s / rows[0].tokens_per_s
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return
    cols = (
        "dp×tp×pp",
        "workers",
        "tokens/s",
        "÷ single",
        "step",
        "compute",
        "pipeline",
        "dp sync",
        "loss",
    )
    cells = [
        (
            r.layout,
            str(r.workers),
            f"{r.tokens_per_s:,.0f}",
            f"{r.vs_single:.2f}×",
            f"{r.step_s * 1e3:.0f} ms",
            f"{r.compute_s * 1e3:.0f} ms",
            f"{r.pipeline_s * 1e3:.0f} ms",
            f"{r.dp_sync_s * 1e3:.0f} ms",
            f"{r.final_loss:.4f}",
        )
        for r in rows
    ]
    if args.markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---:|" * len(cols))
        for c in cells:
            print("| " + " | ".join(c) + " |")
        return
    table = Table(
        title="3D-parallel runtime on this machine (times: median per step, slowest worker)"
    )
    for col in cols:
        table.add_column(col, justify="right")
    for cell in cells:
        table.add_row(*cell)
    Console().print(table)


if __name__ == "__main__":
    main()
