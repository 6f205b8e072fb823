"""The 3D runtime with outer-step sync (DiLoCo) across two sites.

Replica r sits wholly at site r (`replica_per_site`), so every outer step crosses the WAN.
The bytes each step sends equal the cost model's: nothing on the WAN between outer steps,
one pseudo-gradient exchange (`dp_wan_bytes_per_sync`, per stage) at each outer step and at
the end of the run; with tp > 1 and int8 values the parameters held whole go dense. A run
stopped at an outer step and resumed from its checkpoint (per-site AdamW moments, outer
momentum, outer error feedback) repeats the uninterrupted losses bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpn.contracts import JobSpec
from cpn.contracts.plan import predicted_bytes
from cpn.costmodel import Workload
from cpn.train.launcher import train_local
from cpn.train.trainer import TrainOptions
from tests.integration.runtime import replica_per_site, run, tiny_job, write_run

pytestmark = pytest.mark.slow


def test_outer_steps_send_exactly_the_predicted_bytes(tmp_path: Path) -> None:
    steps, every = 5, 2
    doc = tiny_job(2, 2, 2, steps, wan="outer", every=every, values="int8")
    plan = replica_per_site(doc)
    w = Workload.of(JobSpec.model_validate(doc))
    exchange = sum(w.dp_wan_bytes_per_sync(p, 2) for p in range(w.pp))
    assert exchange > 0 and w.dense_numel(0) > 0  # int8 payloads + whole-held params dense
    assert plan.bytes_per_iteration.wan == sum(w.dp_wan_bytes(p, 2) for p in range(w.pp))
    got = run(tmp_path, "outer", doc, plan=plan)
    assert [s.step for s in got] == list(range(steps))
    for s in got:
        outer = (s.step + 1) % every == 0 or s.step == steps - 1  # the last step closes
        assert s.bytes == {
            "intra_node": plan.bytes_per_iteration.intra_node,
            "intra_site": plan.bytes_per_iteration.intra_site,  # pipeline hops only here
            "wan": exchange if outer else 0,
        }, s.step
    assert got[-1].loss < got[0].loss
    # The plan's prediction of a run prefix (what the job service shows) is exact too.
    assert plan.bytes_per_iteration.exchange is not None
    for s in got:
        before, after = (
            predicted_bytes(plan.bytes_per_iteration, None, n, steps) for n in (s.step, s.step + 1)
        )
        assert s.bytes == {k: after[k] - before[k] for k in after}, s.step


def test_resume_at_an_outer_step_is_exact(tmp_path: Path) -> None:
    doc = tiny_job(2, 1, 1, 8, wan="outer", every=2, values="int8")
    plan = replica_per_site(doc)
    straight = run(tmp_path, "straight", doc, plan=plan)
    ckpt = str(tmp_path / "ckpt")
    first = run(tmp_path, "first", doc, plan, checkpoint_store=ckpt, stop_after=4)
    second = run(tmp_path, "second", doc, plan, checkpoint_store=ckpt, resume=True)
    assert [s.step for s in first + second] == list(range(8))
    assert [s.loss for s in first + second] == [s.loss for s in straight]


def test_wan_auto_runs_what_the_plan_chose_and_the_metrics_say_so(tmp_path: Path) -> None:
    doc = tiny_job(2, 1, 1, 3, wan="auto")
    job_path, plan_path, plan = write_run(tmp_path, "auto", doc)
    assert plan.wan_auto is not None and plan.compression == plan.wan_auto.compression
    records = train_local(plan_path, job_path, TrainOptions(), tmp_path / "auto" / "work", 2)
    assert len(records) == 2 * 3
    assert {r["wan_sync"] for r in records} == {plan.wan_auto.summary}
