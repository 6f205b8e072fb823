"""`cpn plan` as a user runs it: a real process, its output, its exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cpn.contracts import Plan

ROOT = Path(__file__).resolve().parents[2]
TOPO = ROOT / "examples" / "topologies" / "three-sites.yaml"
JOB = ROOT / "examples" / "jobs" / "gpt-13b.yaml"
CPN = [sys.executable, "-m", "cpn"]


def cpn(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CPN, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def test_json_plan_has_the_documented_keys() -> None:
    out = cpn("plan", "--topology", TOPO, "--job", JOB, "--json", "--time-limit", "3")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    for key in (
        "parallel",
        "shards",
        "bytes_per_iteration",
        "predicted_iteration_seconds",
        "breakdown",
        "price_per_hour",
        "solver",
    ):
        assert key in doc
    assert set(doc["bytes_per_iteration"]) == {
        "intra_node", "intra_site", "wan", "wan_links", "exchange",
    }  # fmt: skip
    assert doc["bytes_per_iteration"]["exchange"] is None  # only under wan: outer
    assert set(doc["breakdown"]) == {"compute", "pipeline", "dp_sync", "bubble"}
    assert {"status", "seconds", "objective", "bound", "gap"} <= set(doc["solver"])
    assert set(doc["shards"][0]) == {"replica", "stage", "site", "node", "gpus"}
    plan = Plan.model_validate(doc)
    assert plan.parallel.world_size == 256 and len(plan.shards) == 32


def test_human_output_shows_placement_bytes_time_and_solver() -> None:
    out = cpn("plan", "-t", TOPO, "-j", JOB, "--time-limit", "3", "--objective", "iteration_time")
    assert out.returncode == 0, out.stderr
    for text in (
        "Placement",
        "Bytes per iteration",
        "Predicted time per iteration",
        "solver:",
        "gap",
        "price:",
    ):
        assert text in out.stdout


def test_help_is_there() -> None:
    assert cpn("--help").returncode == 0
    out = cpn("plan", "--help")
    assert out.returncode == 0 and "--objective" in out.stdout and "--time-limit" in out.stdout


def bad(tmp_path: Path, topo: dict | None = None, job: dict | None = None, *extra: str) -> str:
    t, j = TOPO, JOB
    if topo is not None:
        t = tmp_path / "t.yaml"
        t.write_text(yaml.safe_dump(topo))
    if job is not None:
        j = tmp_path / "j.yaml"
        j.write_text(yaml.safe_dump(job))
    out = cpn("plan", "-t", t, "-j", j, "--time-limit", "2", *extra)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


@pytest.fixture
def topo_doc() -> dict:
    return yaml.safe_load(TOPO.read_text())


@pytest.fixture
def job_doc() -> dict:
    return yaml.safe_load(JOB.read_text())


def test_bad_inputs_exit_2_with_one_line(tmp_path: Path, topo_doc: dict, job_doc: dict) -> None:
    broken = yaml.safe_load(yaml.safe_dump(topo_doc))
    del broken["sites"][0]["intra_site_gbps"]
    assert "sites[0].intra_site_gbps: field required" in bad(tmp_path, topo=broken)

    broken = yaml.safe_load(yaml.safe_dump(topo_doc))
    broken["links"][0]["bandwidth_gbps"] = -1
    assert "links[0].bandwidth_gbps" in bad(tmp_path, topo=broken)

    broken = yaml.safe_load(yaml.safe_dump(topo_doc))
    broken["links"][0]["a"] = "tianjin"
    assert "links[0].a: unknown site 'tianjin'" in bad(tmp_path, topo=broken)

    assert "parallel.pp: 3 does not divide model.layers (40)" in bad(
        tmp_path, job=dict(job_doc, parallel={"dp": 8, "tp": 8, "pp": 3})
    )

    huge = dict(
        job_doc,
        parallel={"dp": 64, "tp": 8, "pp": 4},
        train=dict(job_doc["train"], global_batch=1024),
    )
    msg = bad(tmp_path, job=huge)
    assert "needs 2048 GPUs (256 groups of 8 in one node) with ≥" in msg and "384 free" in msg

    assert "--objective: 'cheapest' is not one of wan_bytes, iteration_time" in bad(
        tmp_path, None, None, "--objective", "cheapest"
    )
    assert "no such file" in bad(tmp_path, None, None, "--held", str(tmp_path / "nope.yaml"))
