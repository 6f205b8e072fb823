"""Checkpoints keyed by parameter name and global offsets: a run checkpointed under one
dp × tp × pp resumes under another and follows the uninterrupted run's losses (AdamW
moments included); top-k error feedback that has no place in the new layout is flushed
with one dense step; a checkpoint that cannot be used is one line naming the file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from cpn.train.report import StepSummary
from tests.integration.runtime import replica_per_site, run, tiny_job, write_run

pytestmark = pytest.mark.slow

STEPS = 12


def assert_follows(got: list[StepSummary], want: list[StepSummary], rel: float = 1e-4) -> None:
    assert [s.step for s in got] == [s.step for s in want]
    for a, b in zip(got, want, strict=True):
        assert abs(a.loss - b.loss) <= rel * abs(b.loss), (a.step, a.loss, b.loss)


def test_a_dense_run_resumes_on_other_layouts_and_follows_its_curve(tmp_path: Path) -> None:
    # The uninterrupted curve from one process: with dense sync every layout follows it
    # to 1e-4 (test_train_runs), and one worker costs an eighth of (2, 2, 2)'s start-up.
    reference = run(tmp_path, "reference", tiny_job(1, 1, 1, STEPS))
    store = tmp_path / "at-6"
    first = run(
        tmp_path, "first", tiny_job(2, 2, 2, STEPS), checkpoint_store=str(store), stop_after=6
    )
    assert [s.step for s in first] == list(range(6))
    # (2,2,2) → (4,1,1): every tensor-parallel shard joined, more replicas, no pipeline.
    other = tmp_path / "for-4-1-1"
    shutil.copytree(store, other)
    # (the store given as an fsspec URL this time)
    wide = run(
        tmp_path, "wide", tiny_job(4, 1, 1, STEPS), checkpoint_store=other.as_uri(), resume=True
    )
    assert_follows(wide, reference[6:])
    # (2,2,2) → (1,2,1) for three steps, then that checkpoint → (1,1,4).
    narrow = run(
        tmp_path,
        "narrow",
        tiny_job(1, 2, 1, STEPS),
        checkpoint_store=str(store),
        resume=True,
        stop_after=9,
    )
    deep = run(tmp_path, "deep", tiny_job(1, 1, 4, STEPS), checkpoint_store=str(store), resume=True)
    assert_follows(narrow + deep, reference[6:])
    info = json.loads((store / "step-00000009" / "cpn.json").read_text())
    assert info["parallel"] == {"dp": 1, "tp": 2, "pp": 1}


def _log_lines(tmp: Path, name: str) -> str:
    return "\n".join(p.read_text() for p in sorted((tmp / name / "work").glob("rank-*.log")))


def test_topk_resumes_on_another_layout_flushing_what_it_cannot_map(tmp_path: Path) -> None:
    steps = 16
    doc = tiny_job(2, 1, 1, steps, wan="topk", density=0.05, warmup_steps=0)
    straight = run(tmp_path, "straight", doc, replica_per_site(doc))
    store = tmp_path / "ckpt"
    run(tmp_path, "first", doc, replica_per_site(doc), checkpoint_store=str(store), stop_after=8)
    # Both sites again, now with tp = 2: sharded parameters' residuals are resharded, the
    # LayerNorms' (synced dense with tp > 1) are flushed.
    copy = tmp_path / "ckpt-tp2"
    shutil.copytree(store, copy)
    doc_tp = tiny_job(2, 2, 1, steps, wan="topk", density=0.05, warmup_steps=0)
    tp2 = run(
        tmp_path, "tp2", doc_tp, replica_per_site(doc_tp), checkpoint_store=str(copy), resume=True
    )
    # One site only: the other site's residuals have nowhere to go but the flush.
    doc_one = tiny_job(1, 1, 1, steps, wan="topk", density=0.05, warmup_steps=0)
    one = run(tmp_path, "one", doc_one, checkpoint_store=str(store), resume=True)
    assert "flushed with one dense step" in _log_lines(tmp_path, "one")
    assert "flushed with one dense step" in _log_lines(tmp_path, "tp2")
    for resumed in (tp2, one):
        assert [s.step for s in resumed] == list(range(8, steps))
        # It keeps training: the loss stays near the uninterrupted run's and goes down.
        assert resumed[-1].loss < resumed[0].loss
        assert abs(resumed[-1].loss - straight[-1].loss) <= 0.05 * straight[-1].loss


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cpn", "train", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _one_line(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


def test_unusable_checkpoints_are_one_line_naming_the_file(tmp_path: Path) -> None:
    doc = tiny_job(2, 1, 1, 6)
    store = tmp_path / "ckpt"
    run(tmp_path, "first", doc, checkpoint_store=str(store), stop_after=3)
    job_path, plan_path, _ = write_run(tmp_path, "again", doc)
    base = ["--plan", str(plan_path), "--job", str(job_path), "--resume"]

    def broken(name: str, damage: Any) -> str:
        copy = tmp_path / name
        shutil.copytree(store, copy)
        damage(copy / "step-00000003")
        return _one_line(_train(*base, "--checkpoint-store", str(copy)))

    line = broken("no-marker", lambda d: (d / "COMPLETE").unlink())
    assert "no complete checkpoint" in line
    line = broken("bad-index", lambda d: (d / ".metadata").write_bytes(b"\x80garbage"))
    # (its size no longer matches the one recorded in cpn.json: that is said first)
    assert "step-00000003/.metadata: truncated" in line
    line = broken("cut-short", lambda d: _truncate(next(d.glob("*.distcp"))))
    assert "truncated" in line and ".distcp" in line
    line = broken("lost-file", lambda d: next(d.glob("*.distcp")).unlink())
    assert "missing" in line and ".distcp" in line
    # Damaged in place, the size kept: torch would load it into wrong weights without a
    # word; the CRC-32s the (background) save recorded in cpn.json name the file.
    recorded = json.loads((store / "step-00000003" / "cpn.json").read_text())["files"]
    written = {p.name for p in (store / "step-00000003").iterdir()}
    assert set(recorded) == written - {"cpn.json", "COMPLETE"} and ".metadata" in recorded
    line = broken("damaged", lambda d: _xor_middle(sorted(d.glob("*.distcp"))[-1]))
    assert "step-00000003/__1_0.distcp: corrupt (CRC-32" in line
    # A checkpoint of another model cannot be resharded into this one.
    bigger = dict(doc, model=dict(doc["model"], hidden=128))
    job_big, plan_big, _ = write_run(tmp_path, "bigger", bigger)
    line = _one_line(
        _train(
            "--plan",
            str(plan_big),
            "--job",
            str(job_big),
            "--resume",
            "--checkpoint-store",
            str(store),
        )
    )
    assert "cpn.json: written for another model" in line and "hidden 64" in line
    assert yaml.safe_load(job_big.read_text())["model"]["hidden"] == 128


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _xor_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle - 2048 : middle + 2048] = bytes(
        b ^ 0xFF for b in data[middle - 2048 : middle + 2048]
    )
    path.write_bytes(bytes(data))
