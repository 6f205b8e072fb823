"""A small real worker for agent tests: records the environment the agent gave it, reports
three steps through agents.status, then ends as $WORKER_MODE says (ok, fail, sleep).

    report_worker.py PLAN RANK
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from agents.status import report_status

KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "CPN_JOB_ID",
        "CPN_SITE", "CPN_NODE", "CPN_GPU", "WORKER_MODE")  # fmt: skip


def main() -> int:
    plan, rank = sys.argv[1], int(sys.argv[2])
    env = {k: os.environ.get(k) for k in KEYS}
    env["plan_exists"] = str(Path(plan).is_file())
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
    return 3 if mode == "fail" else 0


if __name__ == "__main__":
    sys.exit(main())
