"""How a worker tells its agent how it is doing: JSON lines appended to the file named by
`$CPN_STATUS_FILE`. The agent tails the file and forwards each update to the control plane
(`ReportTaskStatus`); workers need no token and no gRPC.

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
from typing import Any

ENV_VAR = "CPN_STATUS_FILE"


def report_status(**fields: Any) -> bool:
    """Append one status line; returns False when not running under an agent."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return False
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(fields, separators=(",", ":")) + "\n")
        fh.flush()
    return True
