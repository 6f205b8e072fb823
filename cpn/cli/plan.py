"""`cpn plan`: place a job on a topology and show (or print as JSON) the plan."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cpn.cli import app
from cpn.errors import InputError

TopologyOpt = Annotated[
    Path, typer.Option("--topology", "-t", help="Topology YAML (docs/contracts.md).")
]
JobOpt = Annotated[Path, typer.Option("--job", "-j", help="Job YAML (docs/contracts.md).")]


@app.command()
def plan(
    topology: TopologyOpt,
    job: JobOpt,
    objective: Annotated[
        str,
        typer.Option(
            help="wan_bytes: fewest bytes across the WAN, then fastest; "
            "iteration_time: fastest iteration, then fewest WAN bytes.",
        ),
    ] = "wan_bytes",
    time_limit: Annotated[
        float,
        typer.Option(
            "--time-limit",
            help="Solver budget in seconds (per layout tried "
            "with parallel: auto, shared among them).",
            min=0.1,
        ),
    ] = 10.0,
    held: Annotated[
        Path | None,
        typer.Option(help="YAML of GPUs and WAN bandwidth other jobs already hold."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    parallel_search: Annotated[
        bool,
        typer.Option(
            "--parallel-search",
            help="Search with several workers against the wall clock: often better plans "
            "on large instances, but not reproducible run to run.",
        ),
    ] = False,
    seed: Annotated[int, typer.Option(help="Solver random seed.")] = 0,
) -> None:
    """Place a job's shards on sites so that as few bytes as possible cross the WAN.

    Prints the placement per site, predicted bytes per link class, the time breakdown of
    one iteration, the price and the solver's status and proven gap. Exit status 2 with
    one line naming the field or the shortfall when the input is wrong or the job does
    not fit.
    """
    from cpn.cli.render import render_plan  # noqa: PLC0415
    from cpn.contracts import load_job, load_reservations, load_topology  # noqa: PLC0415
    from cpn.scheduler import Objective, SolverSettings, plan_job  # noqa: PLC0415

    try:
        obj = Objective(objective)
    except ValueError:
        choices = ", ".join(o.value for o in Objective)
        raise InputError(f"--objective: {objective!r} is not one of {choices}") from None
    topo = load_topology(topology)
    spec = load_job(job)
    res = load_reservations(held, topo) if held is not None else None
    settings = SolverSettings(time_limit=time_limit, seed=seed, deterministic=not parallel_search)
    if as_json:
        result = plan_job(topo, spec, res, obj, settings)
        typer.echo(result.model_dump_json(indent=2))
        return
    from rich.console import Console  # noqa: PLC0415

    err = Console(stderr=True)
    with err.status("planning…") as status:
        result = plan_job(topo, spec, res, obj, settings, progress=status.update)
    render_plan(result, topo, Console())
