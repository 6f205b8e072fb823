"""`cpn worker` with a failure a test asks for, by the job's name: plan rank 1 of a job
named `flaky-*` exits with 3 on its first launch only (a marker beside the agents' run
directories remembers it), of `doomed-*` on every launch, and of `stuck-*` hangs without
finishing a step; everything else, and every other rank, is the real `cpn worker`.

Started by an agent as `--worker-command "{python} flaky_worker.py {plan} {job} {metrics}"`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import yaml

from agents.status import plan_rank


def main() -> int:
    plan, job, metrics = sys.argv[1:4]
    name = str(yaml.safe_load(Path(job).read_text())["name"])
    # One marker per job for every site: a restart may be planned on the other site,
    # whose agent's run directory (work-SITE/JOB/...) is another one.
    run = Path(os.environ["CPN_RUN_DIR"]).parts
    at = next(i for i, part in enumerate(run) if part.startswith("work-"))
    marker = Path(*run[:at]) / f"failed-once-{run[at + 1]}"
    if plan_rank() == 1:
        if name.startswith("doomed") or (name.startswith("flaky") and not marker.exists()):
            marker.write_text("1\n")
            print("loading the data set", flush=True)
            print("error: injected failure in user code", file=sys.stderr, flush=True)
            return 3
        if name.startswith("stuck"):
            print("waiting for something that never comes", flush=True)
            time.sleep(3600)
    argv = [sys.executable, "-m", "cpn", "worker", "--plan", plan, "--job", job]
    os.execv(sys.executable, [*argv, "--metrics", metrics])


if __name__ == "__main__":
    sys.exit(main())
