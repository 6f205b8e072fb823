"""Scheduler benchmark: cpn's CP-SAT placement against greedy and round-robin.

    .venv/bin/python bench/scheduler.py            # the full grid (about 5 minutes)
    .venv/bin/python bench/scheduler.py --quick    # the small sizes only
    .venv/bin/python bench/scheduler.py --json     # one JSON object instead of tables

For each generated topology (homogeneous: equal sites, 10 Gb/s links; heterogeneous:
skewed GPU counts, mixed GPU models, 0.3–10 Gb/s links with 5–250 ms latency) and a
13B-parameter GPT sized to 75 % of the GPUs, it places the job three ways in the same run
and prints WAN bytes per iteration and predicted iteration time as ratios
(baseline / cpn: above 1 means cpn is better), with cpn's solve time and proven gap. Then
it checks cpn against exhaustive enumeration on small random instances.
"""

from __future__ import annotations

import argparse
import json
import math
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

from cpn.contracts import JobSpec, Topology
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


@dataclass
class Row:
    sites: int
    gpus: int
    kind: str
    compression: str
    layout: str
    cpn_wan_bytes: int
    greedy_wan_bytes: int
    round_robin_wan_bytes: int
    cpn_iteration_s: float
    greedy_iteration_s: float
    round_robin_iteration_s: float
    solve_s: float
    status: str
    gap: float

    @property
    def wan_vs_greedy(self) -> float:
        return ratio(self.greedy_wan_bytes, self.cpn_wan_bytes)

    @property
    def wan_vs_round_robin(self) -> float:
        return ratio(self.round_robin_wan_bytes, self.cpn_wan_bytes)


def ratio(baseline: float, ours: float) -> float:
    if ours == 0:
        return math.inf if baseline > 0 else 1.0
    return baseline / ours


def run_case(sites: int, gpus: int, heterogeneous: bool, compression: str, limit: float) -> Row:
    topo = generate_topology(sites, gpus, heterogeneous=heterogeneous, seed=sites * 7 + gpus)
    job = benchmark_job(gpus, compression=compression)
    inst = build_instance(topo, Workload.of(job))
    base = {}
    for name, make in (("greedy", baselines.greedy), ("round_robin", baselines.round_robin)):
        shards = make(inst)
        if shards is None:
            raise RuntimeError(f"{name} could not place the benchmark job")
        base[name] = evaluate_shards(inst, shards)
    start = time.perf_counter()
    plan = plan_job(topo, job, settings=SolverSettings(time_limit=limit))
    elapsed = time.perf_counter() - start
    p = plan.parallel
    return Row(
        sites=sites,
        gpus=gpus,
        kind="heterogeneous" if heterogeneous else "homogeneous",
        compression=compression,
        layout=f"{p.dp}×{p.tp}×{p.pp}",
        cpn_wan_bytes=plan.bytes_per_iteration.wan,
        greedy_wan_bytes=base["greedy"].wan,
        round_robin_wan_bytes=base["round_robin"].wan,
        cpn_iteration_s=plan.predicted_iteration_seconds,
        greedy_iteration_s=base["greedy"].iteration_seconds,
        round_robin_iteration_s=base["round_robin"].iteration_seconds,
        solve_s=elapsed,
        status=plan.solver.status,
        gap=plan.solver.gap,
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


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes only")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--markdown", action="store_true", help="print tables as Markdown")
    ap.add_argument("--time-limit", type=float, default=10.0, help="cpn's solver budget (s)")
    ap.add_argument("--brute-force", type=int, default=40, help="tiny instances to enumerate")
    args = ap.parse_args()
    err = Console(stderr=True)
    rows: list[Row] = []
    cases = [
        (s, g, h, c)
        for s, g in (QUICK_SIZES if args.quick else SIZES)
        for h in (False, True)
        for c in ("none", "topk")
    ]
    with err.status("") as status:
        for i, (s, g, h, c) in enumerate(cases):
            status.update(
                f"[{i + 1}/{len(cases)}] {s} sites, {g} GPUs, "
                f"{'heterogeneous' if h else 'homogeneous'}, {c}"
            )
            rows.append(run_case(s, g, h, c, args.time_limit))
        status.update(f"brute force on {args.brute_force} tiny instances")
        brute = brute_force_check(args.brute_force)

    hetero = [r.wan_vs_greedy for r in rows if r.kind == "heterogeneous"]
    target = [r for r in rows if (r.sites, r.gpus) == (64, 4096)]
    summary: dict[str, Any] = {
        "median_wan_vs_greedy_heterogeneous": statistics.median(hetero),
        "median_wan_vs_round_robin_heterogeneous": statistics.median(
            r.wan_vs_round_robin for r in rows if r.kind == "heterogeneous"
        ),
        "worst_solve_s_64_sites_4096_gpus": max((r.solve_s for r in target), default=None),
        "worst_gap_64_sites_4096_gpus": max((r.gap for r in target), default=None),
        "brute_force": brute,
    }
    if args.json:
        print(
            json.dumps(
                {"rows": [asdict(r) for r in rows], "summary": summary},
                indent=2,
                default=lambda x: "inf" if x == math.inf else x,
            )
        )
        return
    out = Console(width=200)
    columns = (
        "sites",
        "GPUs",
        "topology",
        "WAN sync",
        "dp×tp×pp",
        "cpn WAN/iter",
        "WAN: greedy ÷ cpn",
        "WAN: round-robin ÷ cpn",
        "time: greedy ÷ cpn",
        "time: round-robin ÷ cpn",
        "solve",
        "status",
        "gap",
    )
    cells = [
        (
            str(r.sites),
            str(r.gpus),
            r.kind,
            r.compression,
            r.layout,
            f"{r.cpn_wan_bytes / 1e9:.2f} GB",
            fmt_ratio(r.wan_vs_greedy),
            fmt_ratio(r.wan_vs_round_robin),
            fmt_ratio(ratio(r.greedy_iteration_s, r.cpn_iteration_s)),
            fmt_ratio(ratio(r.round_robin_iteration_s, r.cpn_iteration_s)),
            f"{r.solve_s:.1f} s",
            r.status,
            f"{r.gap:.0%}",
        )
        for r in rows
    ]
    if args.markdown:
        print("| " + " | ".join(columns) + " |")
        print("|" + "---:|" * len(columns))
        for row in cells:
            print("| " + " | ".join(row) + " |")
        print()
    else:
        table = Table(
            title="cpn vs baselines (ratios: baseline ÷ cpn, above 1 means cpn is better)"
        )
        for col in columns:
            table.add_column(col, justify="right")
        for row in cells:
            table.add_row(*row)
        out.print(table)
    out.print(
        f"median WAN bytes, greedy ÷ cpn, heterogeneous: "
        f"{fmt_ratio(summary['median_wan_vs_greedy_heterogeneous'])} (target ≥ 2×)"
    )
    if target:
        worst_s = summary["worst_solve_s_64_sites_4096_gpus"]
        worst_gap = summary["worst_gap_64_sites_4096_gpus"]
        out.print(
            f"64 sites × 4096 GPUs: solved in ≤ {worst_s:.1f} s (target ≤ 10 s), "
            f"worst proven gap {worst_gap:.0%}"
        )
    out.print(
        f"brute force: {brute['equal']} of {brute['instances']} tiny instances equal "
        f"({brute['both_infeasible']} infeasible for both, {brute['different']} different)"
    )


if __name__ == "__main__":
    main()
