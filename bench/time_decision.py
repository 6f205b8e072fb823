"""Can any placement of a bench instance reach an iteration time below B? A CP-SAT check.

    .venv/bin/python bench/time_decision.py --sites 64 --bound 12 14 --stages 0 1
    .venv/bin/python bench/time_decision.py --sites 64 --sync 6.0 --bound 10.7 --seconds 20

An experiment for the iteration-time bound (docs/scheduler.md §7, "Known limit"), not part
of the scheduler: for a sync level d (default: today's shared sync floor) and targets B it
builds `cpn.scheduler.time_decision.decision_model` — the placement problem's decision
version, relaxed so that INFEASIBLE proves that no placement whose sync lies in [d, next
change point) is faster than B — and prints what CP-SAT answers, and how fast. A bound
from it needs such a proof for every sync interval below B; bench/README.md has the
figures.
"""

from __future__ import annotations

import argparse
import time

from ortools.sat.python import cp_model

from cpn.costmodel import Workload
from cpn.scheduler.instance import build_instance
from cpn.scheduler.time_bound import iteration_time_bound
from cpn.scheduler.time_decision import decision_model
from cpn.synthetic import benchmark_job, generate_topology


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sites", type=int, default=64)
    ap.add_argument("--gpus", type=int, default=4096)
    ap.add_argument("--heterogeneous", action="store_true")
    ap.add_argument("--compression", choices=["none", "topk"], default="none")
    ap.add_argument("--sync", type=float, help="sync level d (default: the shared floor)")
    ap.add_argument("--bound", type=float, nargs="+", required=True, help="targets B")
    ap.add_argument("--stages", type=int, nargs=2, help="first and last stage (default: all)")
    ap.add_argument("--seconds", type=float, default=10.0, help="CP-SAT time per check")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    topo = generate_topology(
        args.sites, args.gpus, heterogeneous=args.heterogeneous, seed=args.sites * 7 + args.gpus
    )
    inst = build_instance(topo, Workload.of(benchmark_job(args.gpus, compression=args.compression)))
    today = iteration_time_bound(inst)
    # The floor is the least sync level: a level just below it admits nothing.
    sync = args.sync if args.sync is not None else today.shared_sync * (1 + 1e-9)
    stages = range(args.stages[0], args.stages[1] + 1) if args.stages else range(inst.pp)
    print(f"today's bound {today.seconds:.3f} s, sync floor {today.shared_sync:.4f} s")
    for bound in args.bound:
        started = time.perf_counter()
        model = decision_model(inst, sync, bound, stages)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = args.workers
        solver.parameters.max_time_in_seconds = args.seconds
        status = solver.solve(model.model)
        print(
            f"d={sync:.4f} B={bound:.3f} stages {stages.start}–{stages.stop - 1}: "
            f"{solver.status_name(status)} in {time.perf_counter() - started:.1f} s"
        )


if __name__ == "__main__":
    main()
