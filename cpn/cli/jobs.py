"""`cpn submit`, `cpn jobs …`, `cpn quote`: the job service from the command line, over
its REST API (cpn.client). The server and the API key come from `--server`/`--api-key`,
$CPN_SERVER/$CPN_API_KEY, or the config file (~/.config/cpn/config.yaml)."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cpn.cli import app

if TYPE_CHECKING:
    from api.job_schemas import JobPublic
    from cpn.client import CpnClient

ServerOpt = Annotated[
    str | None,
    typer.Option("--server", help="REST API, e.g. http://host:8080 (or $CPN_SERVER).",
                 show_default=False),
]  # fmt: skip
KeyOpt = Annotated[
    str | None,
    typer.Option("--api-key", help="API key (or $CPN_API_KEY).", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
TERMINAL = {"succeeded", "failed", "cancelled"}

jobs_app = typer.Typer(
    help="List, inspect, cancel, watch jobs and read their logs.",
    no_args_is_help=False,
    invoke_without_command=True,
)
app.add_typer(jobs_app, name="jobs")


def _client(server: str | None, api_key: str | None) -> CpnClient:
    from cpn.client import CpnClient, load_config  # noqa: PLC0415

    config = load_config(server, api_key)
    return CpnClient(config.server, config.api_key)


def _spec(path: Path) -> object:
    from cpn.contracts import load_job  # noqa: PLC0415

    return load_job(path)


def _fmt_bytes(n: float) -> str:
    from cpn.cli.render import fmt_bytes  # noqa: PLC0415

    return fmt_bytes(n)


def _show(job: JobPublic) -> None:
    p = job.progress
    typer.echo(f"{job.id}  {job.name}  {job.state.value}  ({job.reason})")
    typer.echo(
        f"  step {p.step}/{p.steps}" + (f"  loss {p.loss:.4f}" if p.loss is not None else "")
    )
    for link, b in p.bytes.items():
        typer.echo(f"  {link:<10} measured {_fmt_bytes(b.measured):>10}   predicted "
                   f"{_fmt_bytes(b.predicted or 0):>10}")  # fmt: skip
    if job.failure is not None:
        typer.echo(f"  failed rank {job.failure.rank} (exit {job.failure.exit_code}):")
        for line in job.failure.last_lines[-10:]:
            typer.echo(f"    {line}")


@app.command()
def submit(
    job: Annotated[Path, typer.Argument(help="Job YAML (docs/contracts.md).")],
    server: ServerOpt = None,
    api_key: KeyOpt = None,
    watch: Annotated[bool, typer.Option("--watch", help="Follow its progress.")] = False,
    quote: Annotated[
        str | None,
        typer.Option("--quote", help="QUOTE_ID[:CANDIDATE] from cpn quote.", show_default=False),
    ] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option("--idempotency-key", help="Submitting again with it returns the same job."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Submit a job; prints its id (and follows it with --watch)."""
    spec = _spec(job)
    quote_id, candidate = None, 0
    if quote:
        quote_id, _, which = quote.partition(":")
        if which and not which.isdigit():
            from cpn.errors import InputError  # noqa: PLC0415

            raise InputError(f"--quote: {quote!r}: expected QUOTE_ID[:CANDIDATE]")
        candidate = int(which or 0)
    with _client(server, api_key) as client:
        submitted = client.submit(
            spec,  # type: ignore[arg-type]
            idempotency_key=idempotency_key or uuid.uuid4().hex,
            quote_id=quote_id,
            candidate=candidate,
        )
        if as_json:
            typer.echo(submitted.model_dump_json(indent=2))
        else:
            typer.echo(f"{submitted.id}  {submitted.state.value}  ({submitted.reason})")
        if watch:
            _watch(client, submitted.id)


@jobs_app.callback()
def jobs(
    ctx: typer.Context,
    server: ServerOpt = None,
    api_key: KeyOpt = None,
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500)] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List jobs, newest first (with no sub-command)."""
    ctx.obj = (server, api_key)
    if ctx.invoked_subcommand is not None:
        return
    with _client(server, api_key) as client:
        page = client.jobs(state=state, limit=limit)
    if as_json:
        typer.echo(page.model_dump_json(indent=2))
        return
    typer.echo(f"{'ID':<17} {'NAME':<20} {'STATE':<10} {'STEP':>11} {'GPUS':>5}  REASON")
    for j in page.data:
        step = f"{j.progress.step}/{j.progress.steps}"
        typer.echo(f"{j.id:<17} {j.name[:20]:<20} {j.state.value:<10} {step:>11} {j.gpus:>5}  "
                   f"{j.reason[:60]}")  # fmt: skip
    typer.echo(f"{page.count} jobs")


def _ctx_client(ctx: typer.Context, server: str | None, api_key: str | None) -> CpnClient:
    """Options given after the sub-command win over those given before it."""
    before = ctx.obj or (None, None)
    return _client(server or before[0], api_key or before[1])


@jobs_app.command("get")
def jobs_get(
    ctx: typer.Context,
    job_id: str,
    as_json: JsonOpt = False,
    server: ServerOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """A job's state and reason, plan, progress and bytes measured beside predicted."""
    with _ctx_client(ctx, server, api_key) as client:
        job = client.job(job_id)
    if as_json:
        typer.echo(job.model_dump_json(indent=2))
    else:
        _show(job)


@jobs_app.command("cancel")
def jobs_cancel(
    ctx: typer.Context, job_id: str, server: ServerOpt = None, api_key: KeyOpt = None
) -> None:
    """Cancel a job: its workers are stopped and its GPUs freed."""
    with _ctx_client(ctx, server, api_key) as client:
        job = client.cancel(job_id)
    typer.echo(f"{job.id}  {job.state.value}  ({job.reason})")


@jobs_app.command("events")
def jobs_events(
    ctx: typer.Context, job_id: str, server: ServerOpt = None, api_key: KeyOpt = None
) -> None:
    """Every transition with its reason, allocations, orders, rank states."""
    with _ctx_client(ctx, server, api_key) as client:
        for e in client.events(job_id):
            typer.echo(f"{e.at:%H:%M:%S}  {e.kind:<14} {e.message}")


@jobs_app.command("logs")
def jobs_logs(
    ctx: typer.Context,
    job_id: str,
    rank: Annotated[int | None, typer.Option(min=0, help="Only this rank.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Until the job ends.")] = False,
    server: ServerOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """What the workers printed (the newest lines of each rank)."""
    with _ctx_client(ctx, server, api_key) as client:
        if follow:
            for line in client.follow_logs(job_id, rank=rank):
                typer.echo(f"[{line.rank}] {line.line}")
            return
        after = 0
        while True:
            page = client.logs(job_id, rank=rank, after=after)
            for line in page.lines:
                typer.echo(f"[{line.rank}] {line.line}")
            if not page.lines:
                return
            after = page.lines[-1].id


@jobs_app.command("watch")
def jobs_watch(
    ctx: typer.Context, job_id: str, server: ServerOpt = None, api_key: KeyOpt = None
) -> None:
    """A live progress bar: step of steps, loss, WAN bytes, ETA; ends with the job."""
    with _ctx_client(ctx, server, api_key) as client:
        _watch(client, job_id)


def _watch(client: CpnClient, job_id: str) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: PLC0415

    job = client.job(job_id)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
        transient=not sys.stdout.isatty(),
    ) as bar:
        task = bar.add_task(job.state.value, total=job.progress.steps)
        while True:
            p = job.progress
            wan = p.bytes.get("wan")
            desc = f"{job.state.value}"
            if p.loss is not None:
                desc += f"  loss {p.loss:.4f}"
            if wan is not None:
                desc += f"  WAN {_fmt_bytes(wan.measured)}"
            bar.update(task, completed=p.step, description=desc)
            if job.state.value in TERMINAL:
                break
            time.sleep(0.5)
            job = client.job(job_id)
    _show(job)
    if job.state.value != "succeeded":
        raise typer.Exit(1)


@app.command()
def quote(
    job: Annotated[Path, typer.Argument(help="Job YAML (docs/contracts.md).")],
    server: ServerOpt = None,
    api_key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Ranked candidate plans for a job: predicted time, WAN bytes, price. Reserves
    nothing; `cpn submit JOB --quote ID[:N]` runs one."""
    spec = _spec(job)
    with _client(server, api_key) as client:
        q = client.quote(spec)  # type: ignore[arg-type]
    if as_json:
        typer.echo(q.model_dump_json(indent=2))
        return
    typer.echo(f"quote {q.id} (until {q.expires_at:%H:%M:%S}Z)")
    typer.echo(f"{'#':>2} {'dp×tp×pp':<10} {'sites':<16} {'time':>10} {'WAN bytes':>10} "
               f"{'GPU-h':>8} {'price':>9}  objective")  # fmt: skip
    for c in q.candidates:
        layout = f"{c.parallel['dp']}×{c.parallel['tp']}×{c.parallel['pp']}"
        typer.echo(
            f"{c.rank:>2} {layout:<10} {','.join(c.sites)[:16]:<16} "
            f"{c.predicted_total_seconds:>9.1f}s {_fmt_bytes(c.wan_bytes_total):>10} "
            f"{c.price.gpu_hours:>8.2f} {c.price.total:>9.2f}  {c.objective}"
            + ("" if c.fits_now else "  (waits for GPUs)")
        )
