"""What `cpn plan` says about the gap: what it bounds, how far, and what proved it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cpn.cli.render import solver_line
from cpn.contracts import SolverReport

ROOT = Path(__file__).resolve().parents[2]
TOPO = ROOT / "examples" / "topologies" / "three-sites.yaml"


def _report(**fields: object) -> SolverReport:
    base: dict[str, object] = {
        "status": "FEASIBLE",
        "seconds": 9.41,
        "objective": 393.37e9,
        "bound": 387.53e9,
        "gap": (393.37 - 387.53) / 393.37,
        "proved_by": "pattern bound",
    }
    return SolverReport.model_validate(base | fields)


def test_gap_line_names_the_objective_the_bound_and_its_proof() -> None:
    assert solver_line(_report()) == (
        "solver: FEASIBLE in 9.41 s; gap 1.5% on WAN bytes per iteration: this plan "
        "393.37 GB, no placement moves fewer than 387.53 GB (proved by: pattern bound)"
    )
    optimal = _report(status="OPTIMAL", bound=393.37e9, gap=0.0, proved_by="CP-SAT")
    assert solver_line(optimal) == (
        "solver: OPTIMAL in 9.41 s; gap 0% on WAN bytes per iteration: this plan's "
        "393.37 GB is optimal, no placement moves fewer (proved by: CP-SAT)"
    )
    auto = _report(
        objective=1.986,
        bound=1.476,
        gap=(1.986 - 1.476) / 1.986,
        objective_name="iteration_time",
        objective_unit="seconds",
        proved_by="time bound",
        layouts_considered=20,
    )
    assert solver_line(auto) == (
        "solver: FEASIBLE in 9.41 s; gap 25.7% on predicted iteration time: this plan "
        "1.986 s, no placement of any layout is faster than 1.476 s (proved by: time bound)"
    )
    heuristic = _report(status="HEURISTIC", bound=0.0, gap=1.0, proved_by=None)
    assert solver_line(heuristic) == (
        "solver: HEURISTIC in 9.41 s; gap unknown on WAN bytes per iteration: this plan "
        "393.37 GB, no bound proved"
    )  # not "gap 100%": nothing was proved either way
    # Optimal on the time model, whose coefficients are rounded: the bound it proves is
    # a little below the plan, and the line says so rather than "is optimal".
    rounded = _report(
        status="OPTIMAL",
        objective=1.986,
        bound=1.982,
        gap=0.0,
        objective_name="iteration_time",
        objective_unit="seconds",
        proved_by="CP-SAT",
    )
    assert solver_line(rounded) == (
        "solver: OPTIMAL in 9.41 s; gap 0% on predicted iteration time up to the time "
        "model's rounding: this plan 1.986 s, no placement is faster than 1.982 s "
        "(proved by: CP-SAT)"
    )


def test_cpn_plan_prints_and_stores_what_proved_the_bound() -> None:
    job = ROOT / "examples" / "jobs" / "gpt-13b.yaml"
    cmd = [sys.executable, "-m", "cpn", "plan", "-t", str(TOPO), "-j", str(job)]
    human = subprocess.run(
        [*cmd, "--time-limit", "3"], capture_output=True, text=True, timeout=120, check=False
    )
    assert human.returncode == 0, human.stderr
    text = " ".join(human.stdout.split())  # rich wraps long lines
    assert "on WAN bytes per iteration" in text
    assert "(proved by: pattern bound)" in text or "(proved by: CP-SAT)" in text
    raw = subprocess.run(
        [*cmd, "--time-limit", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert raw.returncode == 0, raw.stderr
    solver = json.loads(raw.stdout)["solver"]
    assert solver["proved_by"] in ("pattern bound", "CP-SAT")
    assert solver["bound"] <= solver["objective"]
