"""`cpn worker` refuses a bad launch at once, with one line, before any process group."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from cpn.scheduler import SolverSettings, plan_job
from tests.factories import job, site, topology


def worker(
    tmp: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"}
    }
    return subprocess.run(
        [sys.executable, "-m", "cpn", "worker", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
        check=False,
    )


def files(tmp: Path, dp: int = 2, tp: int = 1, pp: int = 2) -> tuple[str, str]:
    spec = job(dp, tp, pp, layers=4, hidden=64, heads=4, seq_len=16, vocab=256)
    plan = plan_job(
        topology([site("a", nodes=1, gpus=8)], []), spec, settings=SolverSettings(time_limit=2)
    )
    (tmp / "plan.json").write_text(plan.model_dump_json())
    (tmp / "job.yaml").write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    return str(tmp / "plan.json"), str(tmp / "job.yaml")


def one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


def test_bad_launches(tmp_path: Path) -> None:
    plan, spec = files(tmp_path)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WORLD_SIZE": "4"}
    start = time.monotonic()
    msg = one_line_error(
        worker(
            tmp_path, "--plan", plan, "--job", spec, "--rank", "0", env={**env, "WORLD_SIZE": "3"}
        )
    )
    assert "WORLD_SIZE: 3, but the plan has dp×tp×pp = 4 workers" in msg
    assert time.monotonic() - start < 30, "no process group was waited on"
    assert "MASTER_ADDR: not set" in one_line_error(
        worker(tmp_path, "--plan", plan, "--job", spec, "--rank", "0")
    )
    assert "no complete checkpoint" in one_line_error(
        worker(
            tmp_path,
            "--plan",
            plan,
            "--job",
            spec,
            "--rank",
            "1",
            "--resume",
            "--checkpoint-dir",
            str(tmp_path / "none"),
            env=env,
        )
    )
    assert "--schedule: 'zigzag'" in one_line_error(
        worker(
            tmp_path, "--plan", plan, "--job", spec, "--rank", "1", "--schedule", "zigzag", env=env
        )
    )
    (tmp_path / "broken.json").write_text("{not json")
    assert "not valid JSON at line 1" in one_line_error(
        worker(tmp_path, "--plan", str(tmp_path / "broken.json"), "--job", spec, env=env)
    )
    other = job(4, 1, 1, layers=4, hidden=64, heads=4, seq_len=16)
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other.model_dump(mode="json")))
    assert "differs from the job's" in one_line_error(
        worker(
            tmp_path, "--plan", plan, "--job", str(tmp_path / "other.yaml"), "--rank", "0", env=env
        )
    )
