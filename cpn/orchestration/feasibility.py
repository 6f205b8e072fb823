"""Could a job ever fit? Asked at submission, against the live network with every GPU
free: a job that cannot is refused at once with the shortfall, instead of waiting forever.

This runs the scheduler's own capacity check (the one `plan_job` runs before any solver:
GPUs with enough memory, tensor-parallel groups inside one node, allowed sites and GPU
model) without solving, so it costs microseconds, not a solve; the verdict is cached per
(job shape, topology), as many submissions share both.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict

from cpn.contracts import JobSpec, Topology
from cpn.costmodel import Workload
from cpn.errors import InfeasibleError, InputError
from cpn.scheduler.auto import candidates
from cpn.scheduler.instance import build_instance

_CACHE_SIZE = 4096


def topology_fingerprint(topology: Topology) -> str:
    return hashlib.sha256(topology.model_dump_json().encode()).hexdigest()


def _shape(job: JobSpec) -> str:
    """Everything about the job that decides whether it fits (not its name or priority)."""
    return json.dumps(job.model_dump(mode="json", exclude={"name", "priority"}), sort_keys=True)


def shortfall(topology: Topology, job: JobSpec) -> str | None:
    """Why `job` cannot fit on `topology` even with every GPU free; None if it can."""
    try:
        if job.parallel != "auto":
            build_instance(topology, Workload(job, job.fixed_parallel))
            return None
        layouts = candidates(job, topology)
        if not layouts:
            return (
                f"no dp×tp×pp layout of {job.gpus} GPUs fits: tp must divide heads "
                f"({job.model.heads}) and fit in one node, pp divide layers "
                f"({job.model.layers}), dp divide global_batch/micro_batch, and every stage "
                "fit in GPU memory"
            )
        reasons = []
        for _, parallel in layouts:
            try:
                build_instance(topology, Workload(job, parallel))
                return None
            except InfeasibleError as exc:
                reasons.append(f"dp={parallel.dp} tp={parallel.tp} pp={parallel.pp}: {exc}")
        return f"none of {len(layouts)} layouts of {job.gpus} GPUs fits (first: {reasons[0]})"
    except (InfeasibleError, InputError) as exc:
        return str(exc)


class FeasibilityCache:
    def __init__(self) -> None:
        self._verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()
        self._lock = threading.Lock()  # the API answers from a pool of threads

    def shortfall(self, topology: Topology, fingerprint: str, job: JobSpec) -> str | None:
        key = (fingerprint, _shape(job))
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        verdict = shortfall(topology, job)
        with self._lock:
            self._verdicts[key] = verdict
            if len(self._verdicts) > _CACHE_SIZE:
                self._verdicts.popitem(last=False)
        return verdict
