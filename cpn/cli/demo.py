"""`cpn demo`: control plane, three sites and a job across them on this machine (cpn.demo)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer

from cpn.cli import app

if TYPE_CHECKING:
    from api.job_schemas import JobPublic


@app.command()
def demo(
    steps: Annotated[
        int, typer.Option(min=2, max=100_000, help="Training steps of the demo job.")
    ] = 60,
    keep: Annotated[
        bool,
        typer.Option(
            "--keep",
            help="Keep the working directory (database, logs) and print where it is "
            "(a failed run always keeps it).",
        ),
    ] = False,
    report: Annotated[
        Path, typer.Option("--report", help="Directory for report.html and report.json.")
    ] = Path("demo-report"),
    emulate: Annotated[
        bool | None,
        typer.Option(
            "--emulate/--no-emulate",
            help="Sites in network namespaces with rate-limited uplinks (root on Linux), "
            "or on loopback. Default: namespaces when possible.",
            show_default=False,
        ),
    ] = None,
    ddp_steps: Annotated[
        int, typer.Option("--ddp-steps", min=1, max=1000, help="Steps of the DDP baseline run.")
    ] = 3,
    workdir: Annotated[
        Path | None,
        typer.Option(
            "--workdir",
            help="Working directory: a new or empty one, always kept (default: a new "
            "temporary one).",
        ),
    ] = None,
) -> None:
    """Run cpn across three emulated datacenters and report what it measured.

    Starts the control plane (SQLite) and three site agents with virtual GPUs — each site
    in its own network namespace with its uplink rate-limited when run as root on Linux,
    else on loopback — submits a small GPT job over REST, shows its progress, measures the
    same job's WAN bytes under plain DDP, and writes an HTML report. Everything it starts
    is stopped and removed at the end, on failure and on Ctrl-C.
    """
    from rich.console import Console  # noqa: PLC0415
    from rich.progress import (  # noqa: PLC0415
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from cpn.cli.render import fmt_bytes  # noqa: PLC0415
    from cpn.demo import DemoSettings, run_demo, write_html  # noqa: PLC0415
    from cpn.demo.report import print_report  # noqa: PLC0415
    from cpn.errors import InputError  # noqa: PLC0415

    problem = _unwritable(report)
    if problem:  # before anything starts, not after the demo has run
        raise InputError(f"--report: {report}: {problem}")
    console = Console()

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds every `with`: everything is cleaned up

    signal.signal(signal.SIGTERM, stop)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    )
    task: list[TaskID] = []

    began = time.monotonic()

    class UI:
        def status(self, message: str) -> None:
            console.print(f"[dim]{time.monotonic() - began:5.1f} s[/]  {message}")

        def job(self, job: JobPublic, elapsed_s: float) -> None:
            p = job.progress
            if not task:
                progress.start()
                task.append(progress.add_task("", total=p.steps, detail=""))
            wan = p.bytes.get("wan")
            detail = f"WAN {fmt_bytes(wan.measured)}" if wan is not None else ""
            if p.loss is not None:
                detail = f"loss {p.loss:.4f}  {detail}"
            progress.update(
                task[0],
                completed=p.step,
                description=f"job {job.state.value}",
                detail=detail,
            )
            if job.state.value in ("succeeded", "failed", "cancelled"):
                progress.stop()

    try:
        result = run_demo(
            DemoSettings(
                steps=steps, ddp_steps=ddp_steps, keep=keep, emulate=emulate, workdir=workdir
            ),
            UI(),
        )
    except KeyboardInterrupt:
        progress.stop()
        console.print("interrupted: every process, namespace and link it started is gone")
        raise typer.Exit(130) from None
    finally:
        progress.stop()
    print_report(result, console)
    path = write_html(result, report)
    console.print(f"report: {path.resolve()}")
    if not result.ok:
        raise typer.Exit(1)


def _unwritable(directory: Path) -> str | None:
    """Why `directory` could not be made or written, or None; it is not made here (an
    interrupted demo leaves nothing behind)."""
    import os  # noqa: PLC0415

    if directory.exists():
        if not directory.is_dir():
            return "exists and is not a directory"
        return None if os.access(directory, os.W_OK) else "not writable"
    parent = directory.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    return None if os.access(parent, os.W_OK) else f"{parent} is not writable"
