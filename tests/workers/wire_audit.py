"""A training worker that also reports what it wrote to its sockets, for the wire test.

    python -m tests.workers.wire_audit PLAN JOB OUT_DIR STEPS

Started by the runtime's launcher like `cpn worker`: it trains STEPS steps of the plan,
then writes OUT_DIR/rank-R.json with the bytes its collectives counted by link class and
the bytes the kernel says each of its TCP connections sent during those steps (counted
from just before the first step), before it leaves the process group.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from cpn.contracts import Plan, load_job
from cpn.train.trainer import Trainer, TrainOptions
from tests.sockets import own_connections


def main() -> None:
    plan_path, job_path, out_dir, steps = sys.argv[1:5]
    plan = Plan.model_validate_json(Path(plan_path).read_text())
    job = load_job(job_path)
    ranks = [int(r) for r in os.environ["CPN_PLAN_RANKS"].split(",")]
    rank = ranks[int(os.environ["LOCAL_RANK"])]
    trainer = Trainer(plan, job, rank, TrainOptions(stop_after=int(steps)))
    trainer.start()
    dist.barrier()
    before = {(c.local, c.peer): c for c in own_connections()}
    trainer.train(0)
    dist.barrier()  # every rank's sends have arrived before anyone reads its counters
    after = own_connections()
    # No rank tears its groups down before every rank has listed its sockets: a peer's
    # close ends the connection here too (gloo closes a pair on EOF), which is how a TP
    # socket went missing from a listing taken after the barrier above, 1 run in 2–8.
    dist.barrier()
    report = {
        "rank": rank,
        "counted": trainer.traffic.snapshot(),
        "connections": [
            {
                "local": c.local,
                "peer": c.peer,
                "sent": c.bytes_sent
                - (b.bytes_sent if (b := before.get((c.local, c.peer))) else 0),
                "received": c.bytes_received
                - (b.bytes_received if (b := before.get((c.local, c.peer))) else 0),
                "seen_before": (c.local, c.peer) in before,
            }
            for c in after
        ],
        "before": [{"local": c.local, "peer": c.peer} for c in before.values()],
    }
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(report))
    trainer.close()


if __name__ == "__main__":
    main()
