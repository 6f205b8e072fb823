"""Counted bytes are the wire's: what each worker's collectives count, by link class, is
what the kernel says its TCP sockets carried (within 3 %: gloo frames every message with a
few dozen bytes), and what the plan predicted, exactly.

Eight real workers train a dp2×tp2×pp2 model big enough that every payload is at least
1 MiB (activations 8×128×256 fp32), on two plans that span two sites: the scheduler's
(each stage at one site: the pipeline crosses the WAN, data parallelism is reduced and
broadcast inside a site — where gloo's own reduce would send a third more than counted)
and one that puts each replica at a site (data parallelism crosses the WAN).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from cpn.contracts import Plan
from cpn.scheduler import Objective
from cpn.train.launcher import Launch, run
from tests.integration.runtime import replica_per_site, write_run

# serial: a measurement, run alone (under pytest-xdist, after the rest with -m serial).
pytestmark = [pytest.mark.slow, pytest.mark.serial]

STEPS = 3


def big_job() -> dict[str, Any]:
    return {
        "name": "wire",
        "model": {"layers": 4, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 256},
        "train": {"global_batch": 32, "micro_batch": 8, "dtype": "fp32", "steps": STEPS},
        "parallel": {"dp": 2, "tp": 2, "pp": 2},
        "compression": {"wan": "none"},
    }


def audit(tmp: Path, name: str, plan: Plan | None) -> tuple[Plan, list[dict[str, Any]]]:
    job_path, plan_path, planned = write_run(tmp, name, big_job(), Objective.WAN_BYTES)
    if plan is not None:
        plan_path.write_text(plan.model_dump_json())
    out = tmp / name / "audit"
    out.mkdir()
    argv = ["-m", "tests.workers.wire_audit", str(plan_path), str(job_path), str(out), str(STEPS)]
    run(Launch(argv=argv, plan_ranks=list(range(8)), run_dir=tmp / name / "run"))
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(8)]
    return plan or planned, reports


def wire_bytes(plan: Plan, reports: list[dict[str, Any]]) -> dict[int, dict[str, int]]:
    """Bytes each rank's sockets sent, by the link class of the peer they went to.

    A socket's bytes are read at its receiving end where both ends were listed before and
    after the steps: what the peer's kernel received on it (in order and once — a segment
    sent twice counts once); otherwise the sender's own count. Now and then a worker's
    tensor-parallel socket is gone from its descriptors when it lists them after training
    (it was there before training and carried the traffic; it goes during the final
    barrier, closed by something other than cpn): such a socket is counted from the other
    end too.
    """
    owner = {}
    for rep in reports:
        for c in [*rep["before"], *rep["connections"]]:
            owner[c["local"]] = rep["rank"]
    ends = {(c["local"], c["peer"]): c for rep in reports for c in rep["connections"]}

    def delivered(local: str, peer: str) -> int | None:
        back = ends.get((peer, local))
        return back["received"] if back is not None and back["seen_before"] else None

    workers = plan.ranks()
    out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for rep in reports:
        me = workers[rep["rank"]]
        still = {(c["local"], c["peer"]) for c in rep["connections"]}
        closed = [
            {**c, "sent": got}
            for c in rep["before"]
            if (c["local"], c["peer"]) not in still
            and (got := delivered(c["local"], c["peer"])) is not None
        ]
        listed = [
            {**c, "sent": got}
            if c["seen_before"] and (got := delivered(c["local"], c["peer"])) is not None
            else c
            for c in rep["connections"]
        ]
        for c in [*listed, *closed]:
            peer = owner.get(c["peer"])
            if peer is None:
                continue  # the rendezvous store, not another worker
            other = workers[peer]
            # Each shard has a node of its own here, so "same node" is exactly the
            # tensor-parallel group (the cost model's intra_node).
            link = (
                "wan"
                if other.site != me.site
                else "intra_node"
                if other.node == me.node
                else "intra_site"
            )
            out[rep["rank"]][link] += c["sent"]
    return out


@pytest.mark.parametrize("layout", ["stage-per-site", "replica-per-site"])
def test_counted_bytes_are_the_sockets_bytes_and_the_prediction(
    tmp_path: Path, layout: str
) -> None:
    plan = replica_per_site(big_job()) if layout == "replica-per-site" else None
    plan, reports = audit(tmp_path, layout, plan)
    assert len(plan.sites_used()) == 2
    nodes = {(s.site, s.node) for s in plan.shards}
    assert len(nodes) == len(plan.shards)  # a node per shard (see wire_bytes)
    sent = wire_bytes(plan, reports)
    checked = 0
    for rep in reports:
        for link, counted in rep["counted"].items():
            measured = sent[rep["rank"]][link]
            if counted >= 1 << 20:
                assert abs(measured - counted) <= 0.03 * counted, (
                    rep["rank"],
                    link,
                    measured,
                    counted,
                )
                checked += 1
            else:  # nothing counted: nothing of note on the wire either
                assert measured < 64 * 1024, (rep["rank"], link, measured, counted)
    assert checked >= 8
    # ... and the counts are the plan's prediction, link class by link class.
    predicted = plan.bytes_per_iteration
    totals = {k: sum(r["counted"][k] for r in reports) for k in ("intra_node", "intra_site", "wan")}
    assert totals == {
        "intra_node": STEPS * predicted.intra_node,
        "intra_site": STEPS * predicted.intra_site,
        "wan": STEPS * predicted.wan,
    }
    assert predicted.wan > 0 and predicted.intra_site > 0
