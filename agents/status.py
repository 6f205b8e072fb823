"""How a worker that is not `cpn worker` tells its agent how it is doing: JSON lines
appended to `$CPN_RUN_DIR/rank-R.status.jsonl`, R its plan rank (from the launcher's
CPN_PLAN_RANKS and LOCAL_RANK). The agent follows the file and forwards each update to
the control plane (`ReportTaskStatus`); workers need no token and no gRPC.

    from agents.status import report_status
    report_status(step=100, loss=2.31, bytes={"intra_node": 0, "intra_site": 1 << 20, "wan": 4096},
                  checkpoint_id="ckpt-100")

Each line is one JSON object with any of: `step` (int), `loss` (float), `bytes`
({"intra_node", "intra_site", "wan"}: bytes sent so far), `checkpoint_id` (str),
`message` (str). Later lines override earlier ones field by field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def status_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank-{rank}.status.jsonl"


def plan_rank() -> int | None:
    """This worker's plan rank under a cpn launcher, or None."""
    ranks = os.environ.get("CPN_PLAN_RANKS")
    local = os.environ.get("LOCAL_RANK")
    if not ranks or local is None:
        return None
    try:
        return [int(r) for r in ranks.split(",")][int(local)]
    except (ValueError, IndexError):
        return None


def report_status(**fields: Any) -> bool:
    """Append one status line; returns False when not running under an agent."""
    run_dir, rank = os.environ.get("CPN_RUN_DIR"), plan_rank()
    if not run_dir or rank is None:
        return False
    with status_file(Path(run_dir), rank).open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(fields, separators=(",", ":")) + "\n")
        fh.flush()
    return True
