"""`cpn worker`, `cpn launch` and `cpn train`: run a plan's workers — one, a node's, or all.

    cpn train  --plan plan.json --job job.yaml          every worker, on this machine
    cpn launch --plan plan.json --job job.yaml --ranks 4,5,6,7 --nnodes 2 \\
               --rdzv-endpoint HOST:PORT [--no-host]    one node's workers (site agents)
    cpn worker --plan plan.json --job job.yaml          one worker (what the two start)

The first two start workers with torch's elastic agent (`cpn.train.launcher`).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cpn.cli import app

if TYPE_CHECKING:
    from cpn.contracts import JobSpec, Plan
    from cpn.train.trainer import TrainOptions

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
StoreOpt = Annotated[
    str | None,
    typer.Option(
        "--checkpoint-store",
        help="Where checkpoints go: a directory, or an fsspec URL (file://, s3://, ...) "
        "that every site reaches.",
    ),
]
EveryOpt = Annotated[
    int,
    typer.Option("--checkpoint-every", min=0, help="Steps between checkpoints (0: at the end)."),
]
ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Continue from the last complete checkpoint; it may come from another layout.",
    ),
]
ResumeFromOpt = Annotated[
    str | None,
    typer.Option(
        "--resume-from",
        help="Continue from this complete checkpoint step (STORE/step-NNNNNNNN), which may "
        "be in another store and come from another layout.",
    ),
]
RequestOpt = Annotated[
    Path | None,
    typer.Option(
        "--checkpoint-request",
        help="A file whose newer mtime asks for a checkpoint soon; SIGUSR2 touches it "
        "(a site's warning before a time limit or a preemption).",
    ),
]
LinksOpt = Annotated[
    Path | None,
    typer.Option(
        "--wan-links",
        help="wan: auto — the file the site agent writes its newest WAN measurements to; "
        "the run moves its WAN sync when the narrowest bandwidth changes.",
    ),
]
StopOpt = Annotated[
    int | None,
    typer.Option("--stop-after", min=1, help="Stop at this step (default: train.steps)."),
]
TimeoutOpt = Annotated[
    float, typer.Option("--timeout", min=1, help="Seconds a collective waits for a peer.")
]
DeviceOpt = Annotated[
    str | None,
    typer.Option(help="cpu, cuda or cuda:N (default: the worker's GPU if it has one, else cpu)."),
]
SyncCkptOpt = Annotated[
    bool,
    typer.Option(
        "--sync-checkpoints",
        help="Write checkpoints in the training loop instead of in the background.",
    ),
]


def _load(plan: Path, job: Path) -> tuple[Plan, JobSpec]:
    from cpn.contracts import Plan, load_job  # noqa: PLC0415
    from cpn.contracts.loading import read_text, validate  # noqa: PLC0415
    from cpn.errors import InputError  # noqa: PLC0415

    text = read_text(plan)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{plan}: not valid JSON at line {exc.lineno}: {exc.msg}") from None
    return validate(Plan, doc, str(plan)), load_job(job)


def _options(
    schedule: str,
    dp_sync: str,
    checkpoint_store: str | None,
    checkpoint_every: int,
    resume: bool,
    stop_after: int | None,
    timeout: float,
    device: str | None,
    sync_checkpoints: bool,
    metrics: Path | None = None,
    resume_from: str | None = None,
    checkpoint_request: Path | None = None,
    wan_links: Path | None = None,
) -> TrainOptions:
    from cpn.errors import InputError  # noqa: PLC0415
    from cpn.train.pipeline import Schedule  # noqa: PLC0415
    from cpn.train.trainer import TrainOptions  # noqa: PLC0415

    try:
        sched = Schedule(schedule)
    except ValueError:
        raise InputError(f"--schedule: {schedule!r} is not one of 1f1b, gpipe") from None
    return TrainOptions(
        schedule=sched,
        dp_sync=dp_sync,  # type: ignore[arg-type]  # checked by check_launch
        checkpoint_store=checkpoint_store,
        checkpoint_every=checkpoint_every,
        async_checkpoint=not sync_checkpoints,
        resume=resume,
        resume_from=resume_from,
        stop_after=stop_after,
        metrics_path=metrics,
        timeout_s=timeout,
        device=device,
        checkpoint_request=checkpoint_request,
        wan_links=wan_links,
    )


def _plan_rank(explicit: int | None) -> int:
    """--rank, else this worker's entry in the launcher's plan ranks, else $RANK."""
    from cpn.errors import InputError  # noqa: PLC0415
    from cpn.train.launch_env import PLAN_RANKS_ENV, world_from_env  # noqa: PLC0415

    _, env_rank = world_from_env()
    if explicit is not None:
        return explicit
    listed = os.environ.get(PLAN_RANKS_ENV)
    if listed:
        try:
            ranks = [int(r) for r in listed.split(",")]
            return ranks[int(os.environ.get("LOCAL_RANK", "0"))]
        except (ValueError, IndexError):
            raise InputError(f"{PLAN_RANKS_ENV}: {listed!r} does not list this worker") from None
    if env_rank is None:
        raise InputError("--rank: not given and RANK is not set")
    return env_rank


@app.command()
def worker(
    plan: PlanOpt,
    job: JobOpt,
    rank: Annotated[
        int | None,
        typer.Option(help="This worker's plan rank (default: from the launcher, or $RANK)."),
    ] = None,
    metrics: Annotated[
        str | None,
        typer.Option(help="Append per-step JSON lines here ('-': stdout; {rank}: the rank)."),
    ] = None,
    schedule: ScheduleOpt = "1f1b",
    dp_sync: SyncOpt = "hierarchical",
    checkpoint_store: StoreOpt = None,
    checkpoint_every: EveryOpt = 0,
    resume: ResumeOpt = False,
    resume_from: ResumeFromOpt = None,
    stop_after: StopOpt = None,
    timeout: TimeoutOpt = 300,
    device: DeviceOpt = None,
    sync_checkpoints: SyncCkptOpt = False,
    checkpoint_request: RequestOpt = None,
    wan_links: LinksOpt = None,
) -> None:
    """Run one worker of a plan (launchers start one per GPU).

    Needs MASTER_ADDR, MASTER_PORT and WORLD_SIZE in the environment. Everything that
    can be wrong with the plan, the job or the checkpoint is reported before any process
    group is created; a collective that fails later is one line naming the step, the
    operation and the ranks (exit status 1).
    """
    from cpn.train.checkpoint_request import touch_on_signal  # noqa: PLC0415
    from cpn.train.launch_env import (  # noqa: PLC0415
        MERGE_OUTPUT_ENV,
        PLAN_RANKS_ENV,
        world_from_env,
    )

    if os.environ.get(MERGE_OUTPUT_ENV) == "1":
        os.dup2(2, 1)  # print() and log lines in one file, in order
    _log_to_stderr()
    if checkpoint_request is not None:  # first: the site's warning must not end us
        touch_on_signal(checkpoint_request)
    # The files and the environment before torch is imported: a wrong path is one line
    # at once, not after the seconds torch takes to import.
    spec_plan, spec_job = _load(plan, job)
    world, _ = world_from_env()
    me = _plan_rank(rank)

    from torch.distributed.elastic.multiprocessing.errors import get_error_handler  # noqa: PLC0415

    from cpn.comm import CommError  # noqa: PLC0415
    from cpn.train.trainer import Trainer, check_launch, nothing_to_train  # noqa: PLC0415

    path = None if metrics is None else Path(metrics.replace("{rank}", str(me)))
    opts = _options(
        schedule, dp_sync, checkpoint_store, checkpoint_every, resume, stop_after, timeout,
        device, sync_checkpoints, path, resume_from, checkpoint_request, wan_links,
    )  # fmt: skip
    # A worker of cpn's launcher: the launcher read the checkpoint against its checksums.
    start = check_launch(
        spec_plan, spec_job, world, me, opts, checksums=PLAN_RANKS_ENV not in os.environ
    )
    done = nothing_to_train(spec_job, opts, start)
    if done:
        typer.echo(done, err=True)
        return
    try:
        Trainer(spec_plan, spec_job, me, opts).run()
    except CommError as exc:
        get_error_handler().record_exception(exc)  # torch's error file, for the launcher
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def _ranks(text: str) -> list[int]:
    from cpn.errors import InputError  # noqa: PLC0415

    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise InputError(f"--ranks: {text!r} is not a comma-separated list of ranks") from None
    if not ranks or len(set(ranks)) != len(ranks) or min(ranks) < 0:
        raise InputError(f"--ranks: {text!r} must list distinct ranks ≥ 0")
    return ranks


@app.command()
def launch(
    plan: PlanOpt,
    job: JobOpt,
    ranks: Annotated[str, typer.Option(help="Plan ranks this node runs, in local-rank order.")],
    rdzv_endpoint: Annotated[
        str, typer.Option(help="host:port of the rendezvous (the node of plan rank 0).")
    ],
    nnodes: Annotated[int, typer.Option(min=1, help="Nodes (launchers) in the run.")] = 1,
    host: Annotated[
        bool, typer.Option("--host/--no-host", help="Serve the rendezvous store here.")
    ] = True,
    run_id: Annotated[str, typer.Option(help="Names the rendezvous; the same on every node.")] = "",
    workdir: Annotated[Path, typer.Option(help="Logs and metrics of the workers.")] = Path(
        "runs/latest"
    ),
    local_addr: Annotated[
        str | None, typer.Option(help="The address other nodes reach this one on.")
    ] = None,
    schedule: ScheduleOpt = "1f1b",
    dp_sync: SyncOpt = "hierarchical",
    checkpoint_store: StoreOpt = None,
    checkpoint_every: EveryOpt = 0,
    resume: ResumeOpt = False,
    resume_from: ResumeFromOpt = None,
    stop_after: StopOpt = None,
    timeout: TimeoutOpt = 300,
    device: DeviceOpt = None,
    sync_checkpoints: SyncCkptOpt = False,
    command: Annotated[
        str | None,
        typer.Option(
            help="Run this worker command instead of `cpn worker` (placeholders {python}, "
            "{plan}, {job}, {metrics}); the plan and job are then passed on unchecked.",
        ),
    ] = None,
    checkpoint_on_usr2: Annotated[
        bool,
        typer.Option(
            "--checkpoint-on-usr2",
            help="SIGUSR2 (a site's warning before a time limit or a preemption) asks the "
            "workers for a checkpoint at the next step they agree on, instead of ending "
            "the launch (needs --checkpoint-store).",
        ),
    ] = False,
) -> None:
    """Run the workers of one node of a plan, with torch's elastic agent (site agents use
    this). Writes WORKDIR/result.json at the end: {"ok": true}, or every failed rank with
    its exit status and why, and the last lines of the first one's log. Exit status 0, 1
    when a worker failed, 128 + N when ended by signal N (every worker is ended too)."""
    import shlex  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from cpn.contracts.job import WanCompression  # noqa: PLC0415
    from cpn.errors import InputError  # noqa: PLC0415
    from cpn.train.launcher import Launch, plan_launch  # noqa: PLC0415
    from cpn.train.run_files import RunFiles  # noqa: PLC0415
    from cpn.train.trainer import check_launch, nothing_to_train  # noqa: PLC0415

    if checkpoint_on_usr2 and checkpoint_store is None:
        # Refused, not ignored: SIGUSR2 would otherwise end the launch (its default action).
        raise InputError("--checkpoint-on-usr2: needs --checkpoint-store")
    mine = _ranks(ranks)
    where: dict[str, Any] = {
        "run_id": run_id or "cpn",
        "nnodes": nnodes,
        "rdzv_endpoint": rdzv_endpoint,
        "is_host": host,
        "local_addr": local_addr,
    }
    if command is not None:
        files = RunFiles(workdir.resolve())
        try:
            argv = shlex.split(
                command.format(
                    python=shlex.quote(sys.executable),
                    plan=shlex.quote(str(plan.resolve())),
                    job=shlex.quote(str(job.resolve())),
                    metrics=shlex.quote(files.metrics_template),
                )
            )
        except (KeyError, IndexError, ValueError) as exc:
            raise InputError(
                f"--command: {command!r}: placeholders are {{python}} {{plan}} {{job}} "
                f"{{metrics}} ({exc})"
            ) from None
        if not argv:
            raise InputError("--command: empty")
        custom = Launch(
            argv=argv[1:], entrypoint=argv[0], plan_ranks=mine, run_dir=files.root, **where
        )
        _run_and_report(custom, files.root / "result.json")
        return
    spec_plan, spec_job = _load(plan, job)
    request = None
    if checkpoint_on_usr2:
        from cpn.train.checkpoint_request import touch_on_signal  # noqa: PLC0415

        workdir.mkdir(parents=True, exist_ok=True)
        request = RunFiles(workdir.resolve()).checkpoint_request
        touch_on_signal(request)
    links = None
    if spec_job.compression.wan is WanCompression.AUTO:
        # The site agent writes its WAN measurements here while the launch runs.
        links = RunFiles(workdir.resolve()).wan_links
    opts = _options(
        schedule, dp_sync, checkpoint_store, checkpoint_every, resume, stop_after, timeout,
        device, sync_checkpoints, None, resume_from, request, links,
    )  # fmt: skip
    world = spec_plan.parallel.world_size
    starts = [
        check_launch(spec_plan, spec_job, world, r, opts, checksums=i == 0)
        for i, r in enumerate(mine)
    ]
    done = nothing_to_train(spec_job, opts, starts[0])
    if done:
        typer.echo(done, err=True)
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "result.json").write_text(json.dumps({"ok": True, "trained": 0}) + "\n")
        return
    spec = plan_launch(plan, job, opts, workdir, mine, **where)
    _run_and_report(spec, spec.run_dir / "result.json")


def _log_to_stderr() -> None:
    """The runtime's INFO lines (the schedule `wan: auto` runs and where it moves, a
    resume) into the rank's log; without a handler Python shows WARNING and above only."""
    import logging  # noqa: PLC0415

    train_log = logging.getLogger("cpn.train")
    if not train_log.handlers:
        handler = logging.StreamHandler()  # stderr: the rank's log
        handler.setFormatter(logging.Formatter("%(message)s"))
        train_log.addHandler(handler)
        train_log.setLevel(logging.INFO)


def _run_and_report(spec: Any, result_path: Path | None, on_metrics: Any = None) -> None:
    """Run a launch; write its outcome; turn a signal into the conventional exit status."""
    import logging  # noqa: PLC0415

    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415

    from cpn.train.launcher import RendezvousFailed, WorkerFailed, outcome  # noqa: PLC0415
    from cpn.train.launcher import run as run_launch  # noqa: PLC0415

    # torch's agent narrates every shutdown at WARNING; the outcome is said once, below.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    result: dict[str, Any] = outcome(None)
    try:
        run_launch(spec, on_metrics)
    except (WorkerFailed, RendezvousFailed) as exc:
        result = outcome(exc)
        raise
    except SignalException as exc:
        result = {"ok": False, "signal": int(exc.sigval)}
        typer.echo(f"stopped by {signal.Signals(exc.sigval).name}; every worker ended", err=True)
        raise typer.Exit(128 + int(exc.sigval)) from None
    except Exception as exc:  # a bug of ours or torch's: the result must not say ok
        result = {"ok": False, "error": f"the launcher failed: {type(exc).__name__}: {exc}"}
        raise
    finally:
        if result_path is not None:
            result_path.write_text(json.dumps(result) + "\n")


@app.command()
def train(
    plan: PlanOpt,
    job: JobOpt,
    workdir: Annotated[Path, typer.Option(help="Logs and metrics of the workers.")] = Path(
        "runs/latest"
    ),
    schedule: ScheduleOpt = "1f1b",
    dp_sync: SyncOpt = "hierarchical",
    checkpoint_store: StoreOpt = None,
    checkpoint_every: EveryOpt = 0,
    resume: ResumeOpt = False,
    resume_from: ResumeFromOpt = None,
    stop_after: StopOpt = None,
    timeout: TimeoutOpt = 300,
    device: DeviceOpt = None,
    sync_checkpoints: SyncCkptOpt = False,
) -> None:
    """Run every worker of a plan on this machine and show the loss as it trains.

    For demos and experiments: in production each site's agent starts the workers of its
    node. Workers write their logs and per-step metrics (JSON lines) to WORKDIR. SIGTERM
    or Ctrl-C ends every worker.
    """
    from rich.console import Console  # noqa: PLC0415
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    from cpn.cli.render import fmt_bytes  # noqa: PLC0415
    from cpn.train.launcher import plan_launch  # noqa: PLC0415
    from cpn.train.report import summarise  # noqa: PLC0415
    from cpn.train.trainer import check_launch, nothing_to_train  # noqa: PLC0415

    spec_plan, spec_job = _load(plan, job)
    opts = _options(
        schedule, dp_sync, checkpoint_store, checkpoint_every, resume, stop_after, timeout,
        device, sync_checkpoints, None, resume_from,
    )  # fmt: skip
    world = spec_plan.parallel.world_size
    done = nothing_to_train(spec_job, opts, check_launch(spec_plan, spec_job, world, 0, opts))
    if done:
        typer.echo(done, err=True)
        return
    spec = plan_launch(plan, job, opts, workdir, range(world))
    total = min(spec_job.train.steps, stop_after or spec_job.train.steps)
    reporter = (spec_plan.parallel.pp - 1) * spec_plan.parallel.dp * spec_plan.parallel.tp
    records: list[dict[str, Any]] = []
    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
    ) as bar:
        task = bar.add_task("starting workers", total=total)

        def show(rank: int, record: dict[str, Any]) -> None:
            records.append(record)
            if rank == reporter:
                bar.update(
                    task,
                    completed=int(record["step"]) + 1,
                    description=f"loss {record['loss']:.4f}",
                )

        _run_and_report(spec, None, show)
    steps = summarise(records)
    if not steps:
        return
    last = steps[-1]
    per_step = {k: sum(s.bytes.get(k, 0) for s in steps) / len(steps) for k in last.bytes}
    tokens_per_s = sum(s.tokens for s in steps) / max(sum(s.seconds for s in steps), 1e-9)
    typer.echo(f"final loss {last.loss:.4f} after {len(steps)} steps; {tokens_per_s:,.0f} tokens/s")
    typer.echo("bytes per step: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in per_step.items()))
