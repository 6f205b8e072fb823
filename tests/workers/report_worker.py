"""A small real worker for agent tests: records the environment the launcher gave it,
reports three steps through agents.status, then ends as $WORKER_MODE says (ok, fail,
sleep). Started by `cpn launch --command "{python} report_worker.py {plan}"`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from agents.status import plan_rank, report_status

KEYS = ("WORLD_SIZE", "LOCAL_RANK", "CPN_PLAN_RANKS", "CPN_JOB_ID", "CPN_SITE", "CPN_NODE",
        "CPN_RUN_DIR", "WORKER_MODE")  # fmt: skip


def main() -> int:
    plan = sys.argv[1]
    rank = plan_rank()
    env = {k: os.environ.get(k) for k in KEYS}
    env["plan_exists"] = str(Path(plan).is_file())
    env["has_store"] = str(bool(os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")))
    Path(f"env-rank-{rank}.json").write_text(json.dumps(env))
    for step in (1, 2, 3):
        report_status(
            step=step,
            loss=1.0 / step,
            bytes={"intra_node": step, "intra_site": 10 * step, "wan": 100 * step},
            checkpoint_id=f"ckpt-{step}",
        )
        time.sleep(0.05)
    mode = os.environ.get("WORKER_MODE", "ok")
    if mode == "sleep":
        time.sleep(600)
    if mode == "fail":
        print("error: the worker was told to fail", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
