"""Human-readable output of plans (rich tables)."""

from __future__ import annotations

from collections import Counter, defaultdict

from rich.console import Console
from rich.table import Table

from cpn.contracts.plan import Plan, SolverReport
from cpn.contracts.topology import Topology


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    return f"{s * 1e3:.2f} ms"


#: What each objective measures, and how "beating the bound" reads for it.
BOUNDED = {
    "wan_bytes": ("WAN bytes per iteration", "moves fewer"),
    "iteration_time": ("predicted iteration time", "is faster"),
}


def solver_line(s: SolverReport) -> str:
    """The solver's status and its proven gap: what the gap bounds and what proved it.

    e.g. "solver: FEASIBLE in 9.41 s; gap 1.5% on WAN bytes per iteration: this plan
    393.37 GB, no placement moves fewer than 387.53 GB (proved by: pattern bound)".
    """
    fmt = fmt_bytes if s.objective_unit == "bytes" else fmt_seconds
    what, beats = BOUNDED.get(s.objective_name, (s.objective_name, "is lower"))
    scope = "no placement" if s.layouts_considered is None else "no placement of any layout"
    head = f"solver: {s.status} in {s.seconds:.2f} s; gap"
    if s.proved_by is None:
        return (
            f"solver: {s.status} in {s.seconds:.2f} s; gap unknown on {what}: "
            f"this plan {fmt(s.objective)}, no bound proved"
        )
    if s.status == "OPTIMAL" and s.bound < s.objective * (1 - 1e-12):
        # Optimal on the time model, whose coefficients are rounded: say how far that goes.
        return (
            f"{head} 0% on {what} up to the time model's rounding: this plan "
            f"{fmt(s.objective)}, {scope} {beats} than {fmt(s.bound)} "
            f"(proved by: {s.proved_by})"
        )
    if s.status == "OPTIMAL":
        return (
            f"{head} 0% on {what}: this plan's {fmt(s.objective)} is optimal, "
            f"{scope} {beats} (proved by: {s.proved_by})"
        )
    return (
        f"{head} {s.gap:.1%} on {what}: this plan {fmt(s.objective)}, "
        f"{scope} {beats} than {fmt(s.bound)} (proved by: {s.proved_by})"
    )


def render_plan(plan: Plan, topology: Topology, console: Console) -> None:
    par = plan.parallel
    comp = plan.compression.summary
    if plan.wan_auto is not None:
        comp += f" (wan: auto — {plan.wan_auto.reason})"
    console.print(
        f"[bold]{plan.job}[/]: dp={par.dp} × tp={par.tp} × pp={par.pp} = {par.world_size} GPUs, "
        f"{plan.micro_batches} micro-batches per replica, WAN compression {comp}, "
        f"objective {plan.objective}"
    )

    placement = Table(title="Placement", title_justify="left")
    placement.add_column("site")
    placement.add_column("GPUs", justify="right")
    placement.add_column("replicas per stage")
    placement.add_column("nodes", justify="right")
    per_site: dict[str, Counter[int]] = defaultdict(Counter)
    nodes: dict[str, set[str]] = defaultdict(set)
    for shard in plan.shards:
        per_site[shard.site][shard.stage] += 1
        nodes[shard.site].add(shard.node)
    for site in topology.site_names:
        if site not in per_site:
            continue
        stages = per_site[site]
        desc = "  ".join(f"s{p}×{stages[p]}" for p in sorted(stages))
        placement.add_row(site, str(sum(stages.values()) * par.tp), desc, str(len(nodes[site])))
    console.print(placement)

    b = plan.bytes_per_iteration
    traffic = Table(title="Bytes per iteration", title_justify="left")
    traffic.add_column("link")
    traffic.add_column("bytes", justify="right")
    traffic.add_row("intra-node (tensor parallel)", fmt_bytes(b.intra_node))
    traffic.add_row("intra-site", fmt_bytes(b.intra_site))
    traffic.add_row("[bold]WAN[/]", f"[bold]{fmt_bytes(b.wan)}[/]")
    for key, value in b.wan_links.items():
        traffic.add_row(f"  link {key.replace('|', ' – ')}", fmt_bytes(value))
    console.print(traffic)

    t = plan.breakdown
    timing = Table(title="Predicted time per iteration", title_justify="left")
    timing.add_column("part")
    timing.add_column("time", justify="right")
    timing.add_row("compute", fmt_seconds(t.compute))
    timing.add_row("pipeline transfers", fmt_seconds(t.pipeline))
    timing.add_row("pipeline bubble", fmt_seconds(t.bubble))
    timing.add_row("data-parallel sync", fmt_seconds(t.dp_sync))
    timing.add_row(
        "[bold]iteration[/]", f"[bold]{fmt_seconds(plan.predicted_iteration_seconds)}[/]"
    )
    console.print(timing)
    console.print(f"price: {plan.price_per_hour:,.2f} per hour")

    console.print(solver_line(plan.solver))
    s = plan.solver
    if s.layouts_considered is not None:
        console.print(
            f"layouts: {s.layouts_considered} considered, {s.layouts_solved} solved, "
            f"{s.layouts_pruned} pruned by their lower bound"
        )
    if plan.runners_up:
        runners = Table(title="Runners-up", title_justify="left")
        for col in ("dp × tp × pp", "iteration", "WAN bytes", "status"):
            runners.add_column(col)
        for alt in plan.runners_up:
            p = alt.parallel
            runners.add_row(
                f"{p.dp} × {p.tp} × {p.pp}",
                fmt_seconds(alt.predicted_iteration_seconds),
                fmt_bytes(alt.wan_bytes),
                alt.status,
            )
        console.print(runners)
