"""`cpn worker` and `cpn train`: run a plan's workers, one or all of them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cpn.cli import app

PlanOpt = Annotated[Path, typer.Option("--plan", "-p", help="Plan JSON (cpn plan --json).")]
JobOpt = Annotated[Path, typer.Option("--job", "-j", help="Job YAML.")]
ScheduleOpt = Annotated[
    str, typer.Option(help="Pipeline schedule: 1f1b (less activation memory) or gpipe.")
]
SyncOpt = Annotated[
    str,
    typer.Option(
        "--dp-sync",
        help="hierarchical: reduce in each site, compress across sites (the job's WAN "
        "compression); flat: one ring over all replicas, as PyTorch DDP does.",
    ),
]
CkptOpt = Annotated[Path | None, typer.Option("--checkpoint-dir", help="Where checkpoints go.")]
EveryOpt = Annotated[int, typer.Option("--checkpoint-every", min=0, help="Steps between them.")]
ResumeOpt = Annotated[
    bool, typer.Option("--resume", help="Continue from the last complete checkpoint.")
]
StopOpt = Annotated[
    int | None,
    typer.Option("--stop-after", min=1, help="Stop at this step (default: train.steps)."),
]


def _load(plan: Path, job: Path):  # type: ignore[no-untyped-def]
    from cpn.contracts import Plan, load_job  # noqa: PLC0415
    from cpn.contracts.loading import validate  # noqa: PLC0415
    from cpn.errors import InputError  # noqa: PLC0415

    try:
        text = plan.read_text()
    except OSError as exc:
        raise InputError(f"{plan}: cannot read ({exc.strerror})") from None
    import json  # noqa: PLC0415

    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{plan}: not valid JSON at line {exc.lineno}: {exc.msg}") from None
    return validate(Plan, doc, str(plan)), load_job(job)


@app.command()
def worker(
    plan: PlanOpt,
    job: JobOpt,
    rank: Annotated[int | None, typer.Option(help="This worker's rank (default: $RANK).")] = None,
    metrics: Annotated[Path | None, typer.Option(help="Append per-step JSON lines here.")] = None,
    schedule: ScheduleOpt = "1f1b",
    dp_sync: SyncOpt = "hierarchical",
    checkpoint_dir: CkptOpt = None,
    checkpoint_every: EveryOpt = 0,
    resume: ResumeOpt = False,
    stop_after: StopOpt = None,
    timeout: Annotated[float, typer.Option(help="Seconds a collective may wait.", min=1)] = 300,
) -> None:
    """Run one worker of a plan (what an agent launches for each of its GPUs).

    Needs MASTER_ADDR, MASTER_PORT and WORLD_SIZE in the environment. Everything that
    can be wrong with the plan, the job or the checkpoint is reported before any process
    group is created.
    """
    from cpn.errors import InputError  # noqa: PLC0415
    from cpn.train.pipeline import Schedule  # noqa: PLC0415
    from cpn.train.trainer import Trainer, TrainOptions, check_launch, world_from_env  # noqa: PLC0415

    spec_plan, spec_job = _load(plan, job)
    world, env_rank = world_from_env()
    me = rank if rank is not None else env_rank
    if me is None:
        raise InputError("--rank: not given and RANK is not set")
    try:
        sched = Schedule(schedule)
    except ValueError:
        raise InputError(f"--schedule: {schedule!r} is not one of 1f1b, gpipe") from None
    opts = TrainOptions(
        schedule=sched,
        dp_sync=dp_sync,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        resume=resume,
        stop_after=stop_after,
        metrics_path=metrics,
        timeout_s=timeout,
    )
    check_launch(spec_plan, spec_job, world, me, opts)
    Trainer(spec_plan, spec_job, me, opts).run()


@app.command()
def train(
    plan: PlanOpt,
    job: JobOpt,
    workdir: Annotated[Path, typer.Option(help="Logs and metrics of the workers.")] = Path(
        "runs/latest"
    ),
    schedule: ScheduleOpt = "1f1b",
    dp_sync: SyncOpt = "hierarchical",
    checkpoint_dir: CkptOpt = None,
    checkpoint_every: EveryOpt = 0,
    resume: ResumeOpt = False,
    stop_after: StopOpt = None,
) -> None:
    """Run every worker of a plan on this machine and show the loss as it trains.

    For demos and experiments: in production each site's agent starts its own workers
    with `cpn worker`.
    """
    from rich.console import Console  # noqa: PLC0415
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    from cpn.cli.render import fmt_bytes  # noqa: PLC0415
    from cpn.errors import InputError  # noqa: PLC0415
    from cpn.train.launch import launch_local  # noqa: PLC0415
    from cpn.train.trainer import TrainOptions, check_launch  # noqa: PLC0415

    spec_plan, spec_job = _load(plan, job)
    opts = TrainOptions(
        dp_sync=dp_sync, checkpoint_dir=checkpoint_dir, resume=resume, stop_after=stop_after
    )
    check_launch(spec_plan, spec_job, spec_plan.parallel.world_size, 0, opts)
    if schedule not in {"1f1b", "gpipe"}:
        raise InputError(f"--schedule: {schedule!r} is not one of 1f1b, gpipe")
    args = [
        "--schedule",
        schedule,
        "--dp-sync",
        dp_sync,
        "--checkpoint-every",
        str(checkpoint_every),
    ]
    if checkpoint_dir is not None:
        args += ["--checkpoint-dir", str(checkpoint_dir)]
    if resume:
        args.append("--resume")
    if stop_after is not None:
        args += ["--stop-after", str(stop_after)]
    total = min(spec_job.train.steps, stop_after or spec_job.train.steps)
    console = Console()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
    ) as bar:
        task = bar.add_task("starting workers", total=total)

        def show(record: dict[str, object]) -> None:
            bar.update(
                task,
                completed=int(record["step"]) + 1,  # type: ignore[call-overload]
                description=f"loss {record['loss']:.4f}",
            )

        steps = launch_local(plan.resolve(), job.resolve(), workdir, args, show)
    if not steps:
        return
    last = steps[-1]
    per_step = {k: sum(s.bytes.get(k, 0) for s in steps) / len(steps) for k in last.bytes}
    tokens_per_s = sum(s.tokens for s in steps) / sum(s.seconds for s in steps)
    console.print(
        f"final loss {last.loss:.4f} after {len(steps)} steps; {tokens_per_s:,.0f} tokens/s"
    )
    console.print(
        "bytes per step: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in per_step.items())
    )
