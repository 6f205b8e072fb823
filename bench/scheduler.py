"""Scheduler benchmark: today's search beside the pattern formulation, and the baselines.

    .venv/bin/python bench/scheduler.py --markdown   # the full grid (about 20 minutes)
    .venv/bin/python bench/scheduler.py --quick      # up to 16 sites
    .venv/bin/python bench/scheduler.py --json       # one JSON object instead of tables
    .venv/bin/python bench/scheduler.py --objective iteration_time --sites 64 --brute-force 0

For each generated topology (homogeneous: equal sites, 10 Gb/s links; heterogeneous:
skewed GPU counts, mixed GPU models, 0.3–10 Gb/s links with 5–250 ms latency) and a
13B-parameter GPT sized to 75 % of the GPUs, the job is placed in the same run by:

  - *old*: CP-SAT + LNS alone (`SolverSettings(patterns=False)`, the search before the
    pattern formulation);
  - *new*: the pattern formulation first (bound, cuts, plans), then the same search;
  - greedy and round-robin (`cpn/scheduler/baselines.py`).

It prints, per instance, old and new side by side — WAN bytes per iteration, proven bound,
gap, seconds, what proved the bound — and the new plan's ratios to the baselines. A second
table does the same for the `iteration_time` objective. Then it checks the new search
against exhaustive enumeration on small random instances. Budgets: 10 s, and 30 s at 256
sites (both searches get the same budget).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from cpn.contracts import JobSpec, Plan, Topology
from cpn.costmodel import GIB, Workload
from cpn.errors import InfeasibleError
from cpn.scheduler import Objective, SolverSettings, baselines, plan_job
from cpn.scheduler.bruteforce import brute_force
from cpn.scheduler.instance import build_instance
from cpn.scheduler.realize import evaluate_shards
from cpn.scheduler.solve import objective_key
from cpn.synthetic import benchmark_job, generate_topology

SIZES = [(4, 64), (8, 512), (16, 512), (16, 4096), (64, 4096), (256, 16384)]
QUICK_SIZES = [(4, 64), (8, 512), (16, 512)]
TIME_SIZES = [(16, 4096), (64, 4096), (128, 8192)]
#: Budget of one placement, by number of sites.
LIMITS = {256: 30.0}
DEFAULT_LIMIT = 10.0


@dataclass
class Solve:
    value: float  # bytes or seconds, by objective
    bound: float
    gap: float
    seconds: float
    status: str
    proved_by: str | None
    wan_bytes: int
    iteration_s: float

    @classmethod
    def of(cls, plan: Plan, seconds: float) -> Solve:
        s = plan.solver
        return cls(
            value=s.objective,
            bound=s.bound,
            gap=s.gap,
            seconds=seconds,
            status=s.status,
            proved_by=s.proved_by,
            wan_bytes=plan.bytes_per_iteration.wan,
            iteration_s=plan.predicted_iteration_seconds,
        )


@dataclass
class Row:
    objective: str
    sites: int
    gpus: int
    kind: str
    compression: str
    layout: str
    limit: float
    old: Solve
    new: Solve
    greedy_wan_bytes: int
    round_robin_wan_bytes: int
    greedy_iteration_s: float
    round_robin_iteration_s: float

    @property
    def new_vs_old(self) -> float:
        """New ÷ old objective: below 1 means the new plan is better."""
        return ratio(self.new.value, self.old.value)


def ratio(ours: float, other: float) -> float:
    if other == 0:
        return 1.0 if ours == 0 else math.inf
    return ours / other


def run_case(
    sites: int, gpus: int, heterogeneous: bool, compression: str, objective: Objective
) -> Row:
    topo = generate_topology(sites, gpus, heterogeneous=heterogeneous, seed=sites * 7 + gpus)
    job = benchmark_job(gpus, compression=compression)
    inst = build_instance(topo, Workload.of(job))
    base = {}
    for name, make in (("greedy", baselines.greedy), ("round_robin", baselines.round_robin)):
        shards = make(inst)
        if shards is None:
            raise RuntimeError(f"{name} could not place the benchmark job")
        base[name] = evaluate_shards(inst, shards)
    limit = LIMITS.get(sites, DEFAULT_LIMIT)
    solves = {}
    for label, patterns in (("old", False), ("new", True)):
        start = time.perf_counter()
        settings = SolverSettings(time_limit=limit, patterns=patterns)
        plan = plan_job(topo, job, objective=objective, settings=settings)
        solves[label] = Solve.of(plan, time.perf_counter() - start)
    p = job.fixed_parallel
    return Row(
        objective=objective.value,
        sites=sites,
        gpus=gpus,
        kind="heterogeneous" if heterogeneous else "homogeneous",
        compression=compression,
        layout=f"{p.dp}×{p.tp}×{p.pp}",
        limit=limit,
        old=solves["old"],
        new=solves["new"],
        greedy_wan_bytes=base["greedy"].wan,
        round_robin_wan_bytes=base["round_robin"].wan,
        greedy_iteration_s=base["greedy"].iteration_seconds,
        round_robin_iteration_s=base["round_robin"].iteration_seconds,
    )


def tiny_instance(rng: random.Random) -> tuple[Topology, JobSpec]:
    """2–3 sites, up to 4 nodes of 1–2 slots, 3–6 shards: small enough to enumerate."""
    pp = rng.randint(1, 3)
    dp = rng.randint(max(1, -(-3 // pp)), 6 // pp)
    tp = rng.choice([1, 2])
    wan = rng.choice(["none", "fp16", "topk"])
    job = JobSpec.model_validate(
        {
            "name": "tiny",
            "model": {
                "layers": 6,
                "hidden": 64,
                "heads": 4,
                "seq_len": 32,
                "vocab": rng.choice([100, 50_000]),
            },
            "train": {
                "global_batch": dp * rng.randint(1, 3),
                "micro_batch": 1,
                "dtype": "fp32",
                "steps": 1,
            },
            "parallel": {"dp": dp, "tp": tp, "pp": pp},
            "compression": {"wan": wan, **({"density": 0.01} if wan == "topk" else {})},
        }
    )
    w = Workload.of(job)
    mems = [*sorted({w.memory_bytes(p) / GIB + 0.001 for p in range(pp)}), 80.0]
    names = ["a", "b", "c"][: rng.randint(2, 3)]
    owners = names + [rng.choice(names) for _ in range(rng.randint(0, 4 - len(names)))]
    sites: dict[str, dict[str, object]] = {}
    for i, owner in enumerate(owners):
        doc = sites.setdefault(
            owner, {"name": owner, "intra_site_gbps": rng.choice([100, 800]), "nodes": []}
        )
        nodes = doc["nodes"]
        assert isinstance(nodes, list)
        nodes.append(
            {
                "name": f"n{i}",
                "intra_node_gbps": 2000,
                "gpu": {
                    "model": "X",
                    "count": tp * rng.randint(1, 2),
                    "memory_gb": rng.choice(mems),
                    "tflops": rng.choice([100, 300]),
                },
            }
        )
    links = [
        {
            "a": names[i],
            "b": names[i + 1],
            "bandwidth_gbps": rng.choice([0.5, 2, 10]),
            "latency_ms": rng.choice([5, 50, 150]),
            "transport": "tcp",
        }
        for i in range(len(names) - 1)
    ]
    return Topology.model_validate({"sites": list(sites.values()), "links": links}), job


def brute_force_check(count: int) -> dict[str, int]:
    rng = random.Random(2026)
    out = {"instances": 0, "equal": 0, "different": 0, "both_infeasible": 0}
    while out["instances"] < count:
        topo, job = tiny_instance(rng)
        try:
            inst = build_instance(topo, Workload.of(job))
        except InfeasibleError:
            continue
        out["instances"] += 1
        best = brute_force(inst, objective_key(Objective.WAN_BYTES))
        try:
            plan = plan_job(topo, job, settings=SolverSettings(time_limit=5))
        except InfeasibleError:
            plan = None
        if best is None and plan is None:
            out["both_infeasible"] += 1
        elif best is not None and plan is not None and plan.bytes_per_iteration.wan == best[1].wan:
            out["equal"] += 1
        else:
            out["different"] += 1
    return out


def fmt_ratio(x: float) -> str:
    return "∞" if math.isinf(x) else f"{x:.2f}×"


def fmt_value(objective: str, x: float) -> str:
    return f"{x / 1e9:.2f} GB" if objective == "wan_bytes" else f"{x:.2f} s"


def fmt_gap(s: Solve) -> str:
    return f"{s.gap:.1%}"


def summarize(rows: list[Row], brute: dict[str, int]) -> dict[str, Any]:
    wan = [r for r in rows if r.objective == "wan_bytes"]
    mid = [r for r in wan if 16 <= r.sites <= 64]
    big = [r for r in wan if r.sites == 256]
    het64 = [r for r in wan if r.sites == 64 and r.kind == "heterogeneous"]
    time64 = [r for r in rows if r.objective == "iteration_time" and r.sites == 64]
    hetero = [r for r in wan if r.kind == "heterogeneous"]
    return {
        "worst_new_gap_16_to_64_sites": max((r.new.gap for r in mid), default=None),
        "worst_old_gap_16_to_64_sites": max((r.old.gap for r in mid), default=None),
        "worst_new_gap_256_sites": max((r.new.gap for r in big), default=None),
        "worst_new_seconds_256_sites": max((r.new.seconds for r in big), default=None),
        "worst_new_seconds_up_to_64_sites": max(
            (r.new.seconds for r in wan if r.sites <= 64), default=None
        ),
        "heterogeneous_64_new_vs_old_wan": [r.new_vs_old for r in het64],
        "rows_where_new_is_worse": sum(1 for r in rows if r.new.value > r.old.value * (1 + 1e-9)),
        "worst_new_time_gap_64_sites": max((r.new.gap for r in time64), default=None),
        "median_wan_greedy_over_new_heterogeneous": statistics.median(
            ratio(r.greedy_wan_bytes, r.new.wan_bytes) for r in hetero
        )
        if hetero
        else None,
        "brute_force": brute,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="up to 16 sites, no time table")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--markdown", action="store_true", help="print tables as Markdown")
    ap.add_argument("--brute-force", type=int, default=40, help="tiny instances to enumerate")
    ap.add_argument(
        "--objective",
        choices=["both", "wan_bytes", "iteration_time"],
        default="both",
        help="run only this objective's table",
    )
    ap.add_argument(
        "--sites", type=int, nargs="*", help="run only instances with these numbers of sites"
    )
    args = ap.parse_args()
    err = Console(stderr=True)
    cases = []
    if args.objective in ("both", "wan_bytes"):
        cases += [
            (s, g, h, c, Objective.WAN_BYTES)
            for s, g in (QUICK_SIZES if args.quick else SIZES)
            for h in (False, True)
            for c in ("none", "topk")
        ]
    if not args.quick and args.objective in ("both", "iteration_time"):
        cases += [
            (s, g, h, c, Objective.ITERATION_TIME)
            for s, g in TIME_SIZES
            for h in (False, True)
            for c in ("none", "topk")
        ]
    if args.sites:
        cases = [case for case in cases if case[0] in args.sites]
    rows: list[Row] = []
    started = time.strftime("%Y-%m-%d %H:%M")
    load_before = os.getloadavg()[0]
    with err.status("") as status:
        for i, (s, g, h, c, obj) in enumerate(cases):
            status.update(
                f"[{i + 1}/{len(cases)}] {obj.value}: {s} sites, {g} GPUs, "
                f"{'heterogeneous' if h else 'homogeneous'}, {c}"
            )
            rows.append(run_case(s, g, h, c, obj))
        status.update(f"brute force on {args.brute_force} tiny instances")
        brute = brute_force_check(args.brute_force)
    summary = summarize(rows, brute)
    summary["started"] = started
    summary["load_average_before_and_after"] = [load_before, os.getloadavg()[0]]
    if args.json:
        print(
            json.dumps(
                {"rows": [asdict(r) for r in rows], "summary": summary},
                indent=2,
                default=lambda x: "inf" if x == math.inf else x,
            )
        )
        return
    out = Console(width=240)
    for objective in ("wan_bytes", "iteration_time"):
        mine = [r for r in rows if r.objective == objective]
        if mine:
            print_table(out, objective, mine, markdown=args.markdown)
    print_summary(out, summary)


def print_table(out: Console, objective: str, rows: list[Row], *, markdown: bool) -> None:
    unit = "WAN/iter" if objective == "wan_bytes" else "iteration"
    columns = (
        "sites",
        "GPUs",
        "topology",
        "WAN sync",
        "dp×tp×pp",
        f"old {unit}",
        "old bound",
        "old gap",
        "old s",
        f"new {unit}",
        "new bound",
        "new gap",
        "new s",
        "proved by",
        "new ÷ old",
        "greedy ÷ new",
        "round-robin ÷ new",
    )
    greedy = "greedy_wan_bytes" if objective == "wan_bytes" else "greedy_iteration_s"
    rr = "round_robin_wan_bytes" if objective == "wan_bytes" else "round_robin_iteration_s"
    cells = [
        (
            str(r.sites),
            str(r.gpus),
            r.kind,
            r.compression,
            r.layout,
            fmt_value(objective, r.old.value),
            fmt_value(objective, r.old.bound),
            fmt_gap(r.old),
            f"{r.old.seconds:.1f}",
            fmt_value(objective, r.new.value),
            fmt_value(objective, r.new.bound),
            fmt_gap(r.new),
            f"{r.new.seconds:.1f}",
            r.new.proved_by or "—",
            fmt_ratio(r.new_vs_old),
            fmt_ratio(ratio(getattr(r, greedy), r.new.value)),
            fmt_ratio(ratio(getattr(r, rr), r.new.value)),
        )
        for r in rows
    ]
    title = f"objective {objective} (budget 10 s; 30 s at 256 sites)"
    if markdown:
        print(f"\n{title}\n")
        print("| " + " | ".join(columns) + " |")
        print("|" + "---:|" * len(columns))
        for row in cells:
            print("| " + " | ".join(row) + " |")
        print()
        return
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in cells:
        table.add_row(*row)
    out.print(table)


def print_summary(out: Console, s: dict[str, Any]) -> None:
    def pct(x: float | None) -> str:
        return "—" if x is None else f"{x:.1%}"

    out.print(
        f"worst proven WAN-bytes gap, 16–64 sites: new {pct(s['worst_new_gap_16_to_64_sites'])}"
        f" (target ≤ 5 %), old {pct(s['worst_old_gap_16_to_64_sites'])}"
    )
    if s["worst_new_gap_256_sites"] is not None:
        out.print(
            f"256 sites: worst gap {pct(s['worst_new_gap_256_sites'])} in ≤ "
            f"{s['worst_new_seconds_256_sites']:.1f} s (target ≤ 5 % within 30 s)"
        )
    het = ", ".join(f"{1 - x:.1%}" for x in s["heterogeneous_64_new_vs_old_wan"])
    if het:
        out.print(f"64 heterogeneous sites: new plans move {het} fewer WAN bytes (target ≥ 5 %)")
    out.print(f"instances where the new plan is worse than the old: {s['rows_where_new_is_worse']}")
    if s["worst_new_time_gap_64_sites"] is not None:
        out.print(
            f"iteration-time gap at 64 sites: worst {pct(s['worst_new_time_gap_64_sites'])}"
            " (target ≤ 10 %)"
        )
    if s["median_wan_greedy_over_new_heterogeneous"] is not None:
        out.print(
            "median WAN bytes, greedy ÷ new, heterogeneous: "
            f"{fmt_ratio(s['median_wan_greedy_over_new_heterogeneous'])} (target ≥ 2×)"
        )
    b = s["brute_force"]
    out.print(
        f"brute force: {b['equal']} of {b['instances']} tiny instances equal "
        f"({b['both_infeasible']} infeasible for both, {b['different']} different)"
    )
    load = s["load_average_before_and_after"]
    out.print(f"started {s['started']}, load average {load[0]:.1f} before, {load[1]:.1f} after")


if __name__ == "__main__":
    main()
