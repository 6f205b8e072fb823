"""A short seeded chaos run (tests/chaos.py, the driver of `bench/chaos.py`): small jobs
on three sites while an agent, a worker and `cpn serve` are killed in turn (SIGKILL); no
job may be lost, every finished job has every step once, and every fault is recovered
from. Bounded: three faults, jobs of at most 10 steps."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.chaos import ChaosConfig, run_chaos

pytestmark = pytest.mark.slow


def test_a_short_chaos_run_loses_no_job(tmp_path: Path) -> None:
    config = ChaosConfig(
        seed=11,
        faults=3,
        schedule=("agent", "worker", "control"),
        fault_every_s=(2.0, 4.0),
        steps=(6, 10),
        recover_wait_s=30.0,
        drain_s=240.0,  # ends when every job has; a loaded CI host needs the headroom
    )
    report = run_chaos(tmp_path, config)
    assert report.kills == Counter(agent=1, worker=1, control=1)
    assert report.submitted >= 2
    # A job that never ended is printed whole: CI keeps nothing else of the run.
    assert report.lost == 0, "\n".join(report.failures + report.diagnoses)
    assert report.broken_series == 0, report.failures
    assert report.unrecovered() == 0, report.faults
    assert report.repeated_orders == 0
    assert report.launches_started <= report.launch_orders  # no launch carried out twice
