"""3D-parallel training in real worker processes: equivalence, schedules, resume, bytes.

Every run here starts one process per rank with the torch.distributed environment, as
`cpn train` does. The model is tiny (4 layers, hidden 64) so that 8 workers train 20
steps in about half a minute on two cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpn.scheduler import Objective
from cpn.train.pipeline import Schedule
from cpn.train.report import StepSummary
from tests.integration.runtime import run, tiny_job, write_run

pytestmark = pytest.mark.slow

STEPS = 20


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[StepSummary]:
    """The single-process loss curve every layout must follow."""
    steps = run(tmp_path_factory.mktemp("ref"), "single", tiny_job(1, 1, 1, STEPS))
    assert len(steps) == STEPS
    return steps


def assert_same_curve(got: list[StepSummary], want: list[StepSummary], rel: float) -> None:
    assert [s.step for s in got] == [s.step for s in want]
    for a, b in zip(got, want, strict=True):
        assert abs(a.loss - b.loss) <= rel * abs(b.loss), (a.step, a.loss, b.loss)


@pytest.mark.parametrize(("dp", "tp", "pp"), [(2, 2, 2), (1, 2, 1), (1, 1, 2), (2, 1, 1)], ids=str)
def test_layout_follows_the_single_process_loss_curve(
    tmp_path: Path, reference: list[StepSummary], dp: int, tp: int, pp: int
) -> None:
    steps = run(tmp_path, "layout", tiny_job(dp, tp, pp, STEPS), dp_sync="flat")
    assert_same_curve(steps, reference, rel=1e-4)
    assert steps[-1].loss < 0.9 * steps[0].loss  # and it learns


def test_gpipe_equals_1f1b_and_bytes_equal_the_plans_prediction(tmp_path: Path) -> None:
    doc = tiny_job(2, 2, 2, steps=6)
    # Dense gradients of a stage outweigh its activations here, so the bytes objective
    # puts each stage's replicas in one site and the stages in different sites.
    _, _, plan = write_run(tmp_path, "probe", doc, Objective.WAN_BYTES)
    one = run(tmp_path, "1f1b", doc, plan, dp_sync="flat", schedule=Schedule.ONE_F_ONE_B)
    gpipe = run(tmp_path, "gpipe", doc, plan, dp_sync="flat", schedule=Schedule.GPIPE)
    # Same backward order, so the same floating-point sums: identical, not just close.
    assert [s.loss for s in one] == [s.loss for s in gpipe]
    # The plan spans both sites; with each stage's replicas inside one site, a flat ring
    # and the hierarchical sync send the same bytes, so the measurement must equal the
    # cost model's prediction exactly, link class by link class.
    assert len(plan.sites_used()) == 2
    for stage in range(2):
        assert len({s.site for s in plan.shards if s.stage == stage}) == 1
    predicted = plan.bytes_per_iteration
    for step in one:
        assert step.bytes == {
            "intra_node": predicted.intra_node,
            "intra_site": predicted.intra_site,
            "wan": predicted.wan,
        }
    assert predicted.wan > 0 and predicted.intra_node > 0
    # Every collective cpn calls is current in the pinned torch: no rank's log carries a
    # deprecation or other warning (all_gather_into_tensor's FutureWarning once did).
    for log in sorted((tmp_path / "1f1b" / "work").glob("rank-*.log")):
        assert "Warning" not in log.read_text(), log.name


def test_resume_continues_the_same_losses(tmp_path: Path) -> None:
    doc = tiny_job(2, 1, 2, steps=12)
    _, _, plan = write_run(tmp_path, "probe", doc)
    straight = run(tmp_path, "straight", doc, plan, dp_sync="flat")
    ckpt = tmp_path / "ckpt"
    first = run(
        tmp_path,
        "first",
        doc,
        plan,
        dp_sync="flat",
        checkpoint_store=str(ckpt),
        checkpoint_every=3,
        stop_after=7,
    )
    assert [s.step for s in first] == list(range(7))
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "step-00000003",
        "step-00000006",
        "step-00000007",
    ]
    second = run(
        tmp_path, "second", doc, plan, dp_sync="flat", checkpoint_store=str(ckpt), resume=True
    )
    assert [s.step for s in second] == list(range(7, 12))
    assert [s.loss for s in first + second] == [s.loss for s in straight]
