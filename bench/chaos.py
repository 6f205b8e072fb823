"""Chaos soak: a stream of small jobs on real processes while agents, workers and the
control plane are killed at random (SIGKILL), seeded so that a run can be repeated.

    .venv/bin/python bench/chaos.py                    # 10 minutes of faults, seed 0
    .venv/bin/python bench/chaos.py --minutes 20 --seed 7
    .venv/bin/python bench/chaos.py --quick            # 2 minutes: a smoke run
    .venv/bin/python bench/chaos.py --json             # the figures as JSON at the end

It starts `cpn serve` (SQLite) and three agents of 2 virtual GPUs each with the suite's
harness (tests/service_harness.py), keeps `--in-flight` small GPT jobs submitted (random
layouts of 1–4 ranks, 12–30 steps, a checkpoint every 3 steps, `on_worker_error: restart`)
and injects a fault every few seconds (tests/chaos.py says which and how): an agent
killed and its site down for up to 3 s, one worker killed, or `cpn serve` killed and
started again. After `--minutes` (and at least `--min-agent-kills` 20 agent and
`--min-control-kills` 5 control-plane kills; not with --quick) it stops injecting and
submitting and waits for every job to end. Counted: jobs submitted, succeeded, lost (not
succeeded; the goal is 0), restarts (user-code failures and infrastructure losses apart),
succeeded jobs whose per-step series is not every step once, kills by kind, and time to
recover (p50/max).
Also: launch orders delivered against the launches the agents started (never more
started: nothing carried out twice). Exit status 1 when a job was lost, a series broken or a launch
doubled.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tests.chaos import ChaosConfig, ChaosReport, ChaosRun, run_chaos


def _figures(report: ChaosReport, load: tuple[str, str]) -> dict[str, object]:
    p50, worst = report.recover_p50_max()
    return {
        "seed": report.seed,
        "wall_s": round(report.wall_s, 1),
        "submitted": report.submitted,
        "succeeded": report.succeeded,
        "lost": report.lost,
        "failed": report.failed,
        "unfinished": report.unfinished,
        "broken_series": report.broken_series,
        "restarts_user": report.restarts_user,
        "restarts_infra": report.restarts_infra,
        "launch_orders": report.launch_orders,
        "launches_started": report.launches_started,
        "repeated_orders": report.repeated_orders,
        "kills": dict(report.kills),
        "faults_touching_running_jobs": sum(1 for f in report.faults if f.touched),
        "unrecovered": report.unrecovered(),
        "recover_p50_s": None if p50 is None else round(p50, 1),
        "recover_max_s": None if worst is None else round(worst, 1),
        "loadavg_before": load[0],
        "loadavg_after": load[1],
        "failures": report.failures,
    }


def _table(fig: dict[str, object]) -> Table:
    table = Table(title=f"chaos soak, seed {fig['seed']}", show_header=False)
    for key, value in fig.items():
        if key != "failures":
            table.add_row(key, str(value))
    return table


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="minutes of faults (then drain)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2 minutes: a smoke run")
    ap.add_argument(
        "--min-agent-kills", type=int, default=20, help="go on after --minutes until this many"
    )
    ap.add_argument(
        "--min-control-kills", type=int, default=5, help="go on after --minutes until this many"
    )
    ap.add_argument("--in-flight", type=int, default=2, help="jobs kept submitted, not ended")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--keep", type=Path, help="run in this directory and keep every log")
    args = ap.parse_args()
    minutes = 2.0 if args.quick else args.minutes
    config = replace(
        ChaosConfig(),
        seed=args.seed,
        seconds=minutes * 60,
        in_flight=args.in_flight,
        min_kills=()
        if args.quick
        else (("agent", args.min_agent_kills), ("control", args.min_control_kills)),
    )
    console = Console(stderr=True)
    before = _loadavg()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        bar = progress.add_task("starting the cluster…", total=config.seconds)
        started: list[float] = []

        def tick(run: ChaosRun, phase: str) -> None:
            if not started:
                started.append(time.monotonic())
            r = run.report
            ok = sum(1 for j in run.jobs.values() if j.state.value == "succeeded")
            bad = sum(1 for j in run.jobs.values() if j.state.value == "failed")
            kills = " ".join(f"{k} {r.kills[k]}" for k in ("agent", "worker", "control"))
            progress.update(
                bar,
                completed=min(time.monotonic() - started[0], config.seconds),
                description=f"{phase}: jobs {r.submitted} ok {ok} failed {bad} | kills {kills}",
            )

        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            report = run_chaos(args.keep, config, tick)
        else:
            with tempfile.TemporaryDirectory(prefix="cpn-chaos-") as tmp:
                report = run_chaos(Path(tmp), config, tick)
    fig = _figures(report, (before, _loadavg()))
    if args.json:
        print(json.dumps(fig, indent=2))
    else:
        console.print(_table(fig))
        for line in report.failures:
            console.print(f"[red]{line}")
    doubled = report.repeated_orders or report.launches_started > report.launch_orders
    return 1 if report.lost or report.broken_series or doubled else 0


if __name__ == "__main__":
    raise SystemExit(main())
