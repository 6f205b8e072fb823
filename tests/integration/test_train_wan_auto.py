"""`wan: auto` as a schedule in the 3D runtime, two sites, real worker processes.

The plans come from the real scheduler on a topology whose WAN link is 10 Gbit/s or
50 Mbit/s (GPUs slow enough that the tiny model's compute makes the choice matter): the
fast link runs dense sync throughout, the narrow one a dense fp16 warm-up and then outer
steps; every metrics record names the sync that ran it, and the WAN bytes of the whole
run equal the cost model's for the phases run (`run_wan_bytes`). A run whose agent
rewrites the measured-links file mid-run (10 Gbit/s → 50 Mbit/s) moves to outer steps on
every rank at the same step, with the bytes still exact. A scheduled run stopped where its
warm-up ends and at an outer step, and resumed, repeats the straight run bit for bit.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from cpn.contracts import JobSpec, Plan, Topology
from cpn.contracts.job import CompressionSpec, WanCompression
from cpn.contracts.plan import WanPhase, predicted_bytes
from cpn.scheduler import SolverSettings, plan_job
from cpn.train.launcher import train_local
from cpn.train.links_file import write_links
from cpn.train.trainer import TrainOptions
from cpn.wan_schedule import LADDER, run_wan_bytes, rung_spec
from tests.integration.runtime import TOPOLOGY, tiny_job

pytestmark = pytest.mark.slow

STEPS = 40


def _topology(gbps: float) -> Topology:
    # One slow GPU per site: the replicas are at two sites, across the measured link.
    doc = copy.deepcopy(TOPOLOGY)
    for s in doc["sites"]:
        node = s["nodes"][0]
        node["count"], node["gpu"]["count"], node["gpu"]["tflops"] = 1, 1, 0.01
    doc["links"][0].update(bandwidth_gbps=gbps, latency_ms=1)
    return Topology.model_validate(doc)


def _run(
    tmp: Path, name: str, gbps: float, steps: int = STEPS, **opts: Any
) -> tuple[Plan, JobSpec, list[dict[str, Any]]]:
    d = tmp / name
    d.mkdir(parents=True)
    doc = tiny_job(2, 1, 1, steps, wan="auto")
    job = JobSpec.model_validate(doc)
    plan = plan_job(_topology(gbps), job, settings=SolverSettings(time_limit=3))
    (d / "job.yaml").write_text(yaml.safe_dump(doc))
    (d / "plan.json").write_text(plan.model_dump_json())
    on_metrics = opts.pop("on_metrics", None)
    records = train_local(
        d / "plan.json", d / "job.yaml", TrainOptions(**opts), d / "work", 2, on_metrics
    )
    return plan, job, records


def _segments(records: list[dict[str, Any]], rank: int) -> list[tuple[str, int]]:
    """(wan_sync, steps) runs of one rank's records, in step order."""
    out: list[tuple[str, int]] = []
    for r in sorted((r for r in records if r["rank"] == rank), key=lambda r: r["step"]):
        if out and out[-1][0] == r["wan_sync"]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((r["wan_sync"], 1))
    return out


def _wan_bytes(records: list[dict[str, Any]]) -> int:
    return sum(r["bytes"]["wan"] for r in records)


def _by_step(records: list[dict[str, Any]]) -> dict[int, dict[str, int]]:
    """Bytes by link class per step, summed over ranks."""
    out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in records:
        for k, v in r["bytes"].items():
            out[r["step"]][k] += v
    return {s: dict(b) for s, b in out.items()}


def _predicted_by_step(plan: Plan, steps: int) -> dict[int, dict[str, int]]:
    def through(done: int) -> dict[str, int]:
        return predicted_bytes(plan.bytes_per_iteration, plan.wan_auto, done, steps)

    return {s: {k: through(s + 1)[k] - through(s)[k] for k in through(s)} for s in range(steps)}


def test_fast_and_narrow_links_run_different_schedules_with_exact_bytes(tmp_path: Path) -> None:
    fast, job, fast_records = _run(tmp_path, "fast", 10.0)
    narrow, _, narrow_records = _run(tmp_path, "narrow", 0.05)
    assert fast.wan_auto is not None and narrow.wan_auto is not None
    fast_phases = fast.wan_auto.schedule()
    narrow_phases = narrow.wan_auto.schedule()
    assert [p.compression.wan for p in fast_phases] == [WanCompression.NONE]
    assert [p.compression.wan for p in narrow_phases] == [
        WanCompression.FP16,
        WanCompression.OUTER,
    ]
    warm = narrow_phases[1].start
    assert 0 < warm <= STEPS // 10
    outer = narrow_phases[1].compression
    assert (outer.outer_lr, outer.outer_momentum) == (1.0, 0.0)  # few outer steps: averaging
    # Every record names the sync that ran it, on every rank alike.
    for rank in (0, 1):
        assert _segments(fast_records, rank) == [("none", STEPS)]
        assert _segments(narrow_records, rank) == [("fp16", warm), (outer.summary, STEPS - warm)]
    switches = [r for r in narrow_records if "wan_switch" in r]
    assert {(r["rank"], r["step"]) for r in switches} == {(0, warm - 1), (1, warm - 1)}
    assert switches[0]["wan_switch"]["to"] == outer.summary
    # The cost model's bytes for the phases run equal the counted ones.
    par = job.fixed_parallel
    assert _wan_bytes(fast_records) == run_wan_bytes(job, par, 2, [(fast.compression, STEPS)])
    assert _wan_bytes(narrow_records) == run_wan_bytes(
        job, par, 2, [(narrow_phases[0].compression, warm), (outer, STEPS - warm)]
    )
    # And the plan's own prediction, step by step and per link class (what GET
    # /v1/jobs/{id}/metrics and progress show): the warm-up's and the outer phase's bytes.
    for plan, records in ((fast, fast_records), (narrow, narrow_records)):
        assert _by_step(records) == _predicted_by_step(plan, STEPS)
    # Between outer steps nothing crosses the WAN.
    by_step: dict[int, int] = defaultdict(int)
    for r in narrow_records:
        by_step[r["step"]] += r["bytes"]["wan"]
    every = outer.outer_every
    quiet = [s for s in range(warm, STEPS - 1) if (s - warm + 1) % every]
    assert quiet and all(by_step[s] == 0 for s in quiet)


def test_a_measured_drop_mid_run_moves_every_rank_at_the_same_step(tmp_path: Path) -> None:
    steps = 120
    links = tmp_path / "wan-links.json"
    write_links(links, "east", {"west": {"bandwidth_gbps": 10.0, "rtt_ms": 2.0}})
    written: list[int] = []

    def drop(rank: int, record: dict[str, Any]) -> None:
        # The agent measures 50 Mbit/s once the run is under way.
        if not written and record["step"] >= 3:
            write_links(links, "east", {"west": {"bandwidth_gbps": 0.05, "rtt_ms": 2.0}})
            written.append(record["step"])

    plan, job, records = _run(tmp_path, "drop", 10.0, steps, wan_links=links, on_metrics=drop)
    assert plan.wan_auto is not None and plan.compression.wan is WanCompression.NONE
    assert written
    switches = [r for r in records if "wan_switch" in r]
    assert len(switches) == 2, switches  # one per rank, once: the figure holds
    assert switches[0]["step"] == switches[1]["step"]
    at = switches[0]["step"]
    assert written[0] <= at < steps - 1
    moved = switches[0]["wan_switch"]
    assert moved["from"] == "none" and moved["to"].startswith("outer H=32 int8")
    assert moved["gbps"] == 0.05 and "measured 0.05 Gbit/s" in moved["why"]
    [after] = {r["wan_sync"] for r in records if r["step"] > at}
    for rank in (0, 1):
        assert _segments(records, rank) == [("none", at + 1), (after, steps - at - 1)]
        assert {r["wan_rung"] for r in records if r["rank"] == rank and r["step"] > at} == {3}
    spec = CompressionSpec.model_validate(
        {"wan": "outer", "every": 32, "values": "int8", "outer_lr": 1, "outer_momentum": 0}
    )
    assert spec.summary == after
    assert _wan_bytes(records) == run_wan_bytes(
        job, job.fixed_parallel, 2, [(plan.compression, at + 1), (spec, steps - at - 1)]
    )


def test_a_schedule_resumed_where_its_phase_changes_and_at_an_outer_step_is_exact(
    tmp_path: Path,
) -> None:
    plan, _, straight = _run(tmp_path, "straight", 0.05)
    assert plan.wan_auto is not None
    _, steady = plan.wan_auto.schedule()
    last_outer = steady.start + (STEPS - steady.start) // steady.compression.outer_every * (
        steady.compression.outer_every
    )
    # A stop where the warm-up ends (the checkpoint holds the first outer step's anchor),
    # one at an outer step.
    assert 0 < steady.start < last_outer < STEPS
    ckpt = str(tmp_path / "ckpt")
    parts = []
    for name, stop in (("first", steady.start), ("second", last_outer), ("third", None)):
        _, _, got = _run(
            tmp_path, name, 0.05, checkpoint_store=ckpt, resume=name != "first", stop_after=stop
        )
        parts += got

    def losses(records: list[dict[str, Any]]) -> list[tuple[int, int, float, str]]:
        return sorted((r["step"], r["rank"], r["loss"], r["wan_sync"]) for r in records)

    assert losses(parts) == losses(straight)
    assert _wan_bytes(parts) == _wan_bytes(straight)


def test_a_bad_links_file_rewritten_every_step_is_reported_once_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    # A figure beyond every link (it once overflowed the 64-bit agreement and killed the
    # rank, leaving the other waiting), rewritten all the time while the run goes on: the
    # ranks agree on no measurement, finish the plan, and each says once what is wrong.
    steps = 12
    links = tmp_path / "wan-links.json"  # both ranks read it: each finds its peer site
    bad = {"bandwidth_gbps": 1e300, "rtt_ms": 2.0}
    stop = threading.Event()

    def spoil() -> None:
        while not stop.is_set():
            write_links(links, "east", {"west": bad, "east": bad})
            time.sleep(0.005)

    spoil_once = threading.Thread(target=spoil, daemon=True)
    write_links(links, "east", {"west": bad, "east": bad})
    spoil_once.start()
    try:
        plan, _, records = _run(tmp_path, "bad", 10.0, steps, wan_links=links)
    finally:
        stop.set()
        spoil_once.join()
    assert plan.compression.wan is WanCompression.NONE
    assert sorted((r["step"], r["rank"]) for r in records) == [
        (s, r) for s in range(steps) for r in (0, 1)
    ]
    assert {r["wan_sync"] for r in records} == {"none"}
    assert not [r for r in records if "wan_switch" in r]
    for rank in (0, 1):
        log = (tmp_path / "bad" / "work" / f"rank-{rank}.log").read_text()
        assert log.count("wan: auto: ignoring") == 1, log
        assert ".bandwidth_gbps: 1e+300 is not in (0, 1e+06]" in log


def test_a_run_moved_to_outer_steps_still_checkpoints_and_resumes(tmp_path: Path) -> None:
    # Planned dense on 10 Gbit/s, measured 50 Mbit/s from the start: the rung moves to
    # outer steps a step or two in, so its outer steps do not fall on multiples of
    # --checkpoint-every. A due checkpoint is written at the next outer step (it was
    # skipped for good: such a run never checkpointed again), and a run stopped between
    # outer steps resumes from it, moving to outer steps again on every rank alike.
    steps, every, stop = 80, 10, 50
    links = tmp_path / "wan-links.json"
    write_links(links, "east", {"west": {"bandwidth_gbps": 0.05}, "east": {"bandwidth_gbps": 0.05}})
    store = tmp_path / "ckpt"
    opts: dict[str, Any] = {"wan_links": links, "checkpoint_store": str(store)}
    _, _, first = _run(
        tmp_path, "first", 10.0, steps, checkpoint_every=every, stop_after=stop, **opts
    )
    [at] = {r["step"] for r in first if "wan_switch" in r}
    h = 32
    assert {r["wan_rung"] for r in first if r["step"] > at} == {3}  # outer H=32 int8
    written = sorted(int(p.name.removeprefix("step-")) for p in store.glob("step-*"))
    # Dense up to step `at` (a boundary after every step), then outer steps every h; a
    # checkpoint due at a multiple of `every` is written at the first boundary from it.
    expected, due = [], False
    for done in range(1, stop + 1):
        due = due or done % every == 0
        if due and (done <= at + 1 or (done - at - 1) % h == 0):
            expected.append(done)
            due = False
    assert written == expected and any(d > at + 1 for d in written), (written, at)
    # Rank 0 says what it runs and where it moved, in its log.
    log0 = (tmp_path / "first" / "work" / "rank-0.log").read_text()
    assert "wan: auto chose none from step 0" in log0
    assert f"step {at + 1}: wan: auto moves from none to outer H=32 int8" in log0
    assert "wan: auto moves" not in (tmp_path / "first" / "work" / "rank-1.log").read_text()
    resume_at = written[-1]
    assert resume_at > at + 1
    _, _, second = _run(tmp_path, "second", 10.0, steps, resume=True, **opts)
    assert sorted({r["step"] for r in second}) == list(range(resume_at, steps))
    moved = sorted((r["step"], r["rank"]) for r in second if "wan_switch" in r)
    assert len(moved) == 2 and moved[0][0] == moved[1][0]


def test_every_planned_phase_runs_from_its_step(tmp_path: Path) -> None:
    # A schedule of three phases (a hand-edited plan: the contract allows any number):
    # each runs from its start on every rank, not only the last (the middle one was
    # skipped, while a run resumed inside it ran it), and the bytes are the cost model's.
    plan, job, _ = _run(tmp_path, "planned", 0.05, steps=4)
    assert plan.wan_auto is not None
    h8, int8 = rung_spec(2, STEPS), rung_spec(3, STEPS)
    phases = [
        WanPhase(start=0, rung=1, compression=LADDER[1]),
        WanPhase(start=5, rung=2, compression=h8),
        WanPhase(start=21, rung=3, compression=int8),  # two outer steps of H=8 later
    ]
    auto = plan.wan_auto.model_copy(update={"phases": phases, "compression": int8})
    three = plan.model_copy(update={"wan_auto": auto, "compression": int8})
    d = tmp_path / "three"
    d.mkdir()
    (d / "job.yaml").write_text(yaml.safe_dump(tiny_job(2, 1, 1, STEPS, wan="auto")))
    (d / "plan.json").write_text(three.model_dump_json())
    records = train_local(d / "plan.json", d / "job.yaml", TrainOptions(), d / "work", 2)
    for rank in (0, 1):
        assert _segments(records, rank) == [
            ("fp16", 5),
            (h8.summary, 16),
            (int8.summary, STEPS - 21),
        ]
    full = job.model_copy(update={"train": job.train.model_copy(update={"steps": STEPS})})
    assert _wan_bytes(records) == run_wan_bytes(
        full, job.fixed_parallel, 2, [(LADDER[1], 5), (h8, 16), (int8, STEPS - 21)]
    )
