"""Start a plan's workers with torch's elastic agent, and watch them.

One launcher module for everything that starts workers: `cpn train` (every worker of a plan
on this machine), a site agent (the workers on its node, through `cpn launch`), the
benchmarks and the tests. It is a thin layer over `torch.distributed.launcher.api.
elastic_launch` with the c10d rendezvous, which does the hard parts — starting the
processes with the torch.distributed environment, the rendezvous among nodes, ending every
local worker as soon as one fails, forwarding SIGTERM/SIGINT to them — and adds what cpn
needs on top:

  - the plan's rank map is kept: the launcher lists the plan ranks it runs, in local-rank
    order (`CPN_PLAN_RANKS`), and each worker joins its process group as that rank, so
    pipeline stages land where the plan put them whatever order nodes joined the
    rendezvous in (torch's own RANK follows join order);
  - files per plan rank in the run directory: `rank-R.log` (the worker's output),
    `rank-R.error.json` (torch's error file) and `rank-R.metrics.jsonl` (per-step
    metrics), read incrementally while the run goes on;
  - a failure as one `WorkerFailed` naming the plan rank, its exit status and the last
    lines of its log;
  - workers die with their launcher (`cpn.train.guard`: `PR_SET_PDEATHSIG`), so not even
    a SIGKILL of the launcher leaves one behind.

`python -m cpn.train.launcher SPEC.json` runs a `Launch` written as JSON (what a
benchmark starts inside a site's network namespace) and writes `result.json` beside the
workers' files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from cpn.errors import CpnError
from cpn.train.launch_env import MERGE_OUTPUT_ENV, PLAN_RANKS_ENV
from cpn.train.run_files import RunFiles
from cpn.train.tail import FileTail

if TYPE_CHECKING:
    from cpn.train.trainer import TrainOptions


MetricsCallback = Callable[[int, dict[str, Any]], None]
#: Modules the fork server of `run_function` imports once for all the workers it forks.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "cpn.train.launcher"]


@dataclass(frozen=True)
class Failure:
    """One worker that exited with an error: its plan rank, status and why."""

    rank: int
    status: int
    reason: str


class WorkerFailed(CpnError):
    """Workers exited with an error; the message names the first (the root cause) and
    carries the last lines of its log. `failures` lists every worker that failed."""

    exit_code = 1

    def __init__(self, failures: list[Failure], tail: list[str]) -> None:
        first = failures[0]
        self.failures, self.tail = failures, tail
        self.rank, self.status, self.reason = first.rank, first.status, first.reason
        super().__init__(f"worker {first.rank} exited with status {first.status}: {first.reason}")


class RendezvousFailed(CpnError):
    """This node could not join its run: the rendezvous store could not be served or
    reached, or the other nodes did not join in time. No worker was started."""

    exit_code = 1


class _PlanRankLogs(LogsSpecs):
    """torch's per-local-rank log files, named by plan rank in one flat directory."""

    def __init__(self, files: RunFiles, plan_ranks: Sequence[int]) -> None:
        super().__init__(str(files.root), Std.ALL, Std.NONE)
        self.files, self.plan_ranks = files, list(plan_ranks)

    @property
    def root_log_dir(self) -> str:
        return str(self.files.root)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        for local in envs:
            rank = self.plan_ranks[local]
            dest.stdouts[local] = str(self.files.stdout(rank))
            dest.stderrs[local] = str(self.files.log(rank))
            dest.error_files[local] = str(self.files.error(rank))
        return dest


@dataclass
class Launch:
    """What one launcher (one node of the run) starts."""

    argv: Sequence[str]  # the worker command's arguments
    plan_ranks: Sequence[int]  # plan ranks of this node's workers, in local-rank order
    run_dir: Path
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    nnodes: int = 1  # launchers taking part, one per node of the plan
    rdzv_endpoint: str = "127.0.0.1:0"  # host:port of the rendezvous; port 0 locally
    is_host: bool = True  # this launcher serves the rendezvous store (the node of rank 0)
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the workers
    rdzv_timeout_s: float = 300.0  # how long to wait for the other nodes to join
    local_addr: str | None = None  # the address other nodes reach this one on
    entrypoint: str = sys.executable  # the program each worker runs (with `argv`)

    @property
    def files(self) -> RunFiles:
        return RunFiles(self.run_dir)


def worker_env(launch: Launch) -> dict[str, str]:
    return {
        PLAN_RANKS_ENV: ",".join(str(r) for r in launch.plan_ranks),
        # One math thread per worker unless told otherwise: workers share the cores.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **launch.env,
    }


@contextlib.contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    """Workers inherit the launcher's environment (torch copies os.environ into each)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _MetricsTail(threading.Thread):
    """Follows each rank's metrics file as it grows, calling back per record."""

    def __init__(self, files: RunFiles, ranks: Sequence[int], callback: MetricsCallback) -> None:
        super().__init__(name="cpn-metrics-tail", daemon=True)
        self.tails = {rank: FileTail(files.metrics(rank)) for rank in ranks}
        self.callback = callback
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.2):
            self.poll()
        self.poll()

    def poll(self) -> None:
        for rank, tail in self.tails.items():
            for record in tail.records():
                self.callback(rank, record)


def worker_argv(plan: Path, job: Path, opts: TrainOptions, metrics: str) -> list[str]:
    """The `cpn worker` command line (after the interpreter) that runs `opts`."""
    args = [
        "-m", "cpn", "worker", "--plan", str(plan.resolve()), "--job", str(job.resolve()),
        "--schedule", opts.schedule.value, "--dp-sync", opts.dp_sync,
        "--checkpoint-every", str(opts.checkpoint_every), "--timeout", str(opts.timeout_s),
        "--metrics", metrics,
    ]  # fmt: skip
    if opts.checkpoint_store is not None:
        args += ["--checkpoint-store", opts.checkpoint_store]
    if not opts.async_checkpoint:
        args.append("--sync-checkpoints")
    if opts.resume:
        args.append("--resume")
    if opts.resume_from:
        args += ["--resume-from", opts.resume_from]
    if opts.stop_after is not None:
        args += ["--stop-after", str(opts.stop_after)]
    if opts.device is not None:
        args += ["--device", opts.device]
    if opts.checkpoint_request is not None:
        args += ["--checkpoint-request", str(opts.checkpoint_request)]
    if opts.wan_links is not None:
        args += ["--wan-links", str(opts.wan_links)]
    return args


def plan_launch(
    plan: Path,
    job: Path,
    opts: TrainOptions,
    run_dir: Path,
    plan_ranks: Sequence[int],
    **where: Any,
) -> Launch:
    """A launch of `cpn worker` for `plan_ranks` of a plan (`where`: Launch's node fields)."""
    run_dir = run_dir.resolve()
    return Launch(
        argv=worker_argv(plan, job, opts, RunFiles(run_dir).metrics_template),
        plan_ranks=list(plan_ranks),
        run_dir=run_dir,
        env={MERGE_OUTPUT_ENV: "1"},
        **where,
    )


def train_local(
    plan: Path,
    job: Path,
    opts: TrainOptions,
    run_dir: Path,
    world: int,
    on_metrics: MetricsCallback | None = None,
) -> list[dict[str, Any]]:
    """Every worker of a plan on this machine (`cpn train`, tests, benchmarks): the
    per-step records of every worker, in the order they arrived."""
    records: list[dict[str, Any]] = []

    def keep(rank: int, record: dict[str, Any]) -> None:
        records.append(record)
        if on_metrics is not None:
            on_metrics(rank, record)

    run(plan_launch(plan, job, opts, run_dir, range(world)), keep)
    return records


#: torch < 2.13 has no `shutdown_timeout` (how long the agent waits for workers it ends
#: before killing them; 30 s by default): pass it where it exists, so that the CUDA builds
#: GPU hosts ship (2.11 on the machine the GPU checks ran on) start workers too.
_SHUTDOWN = (
    {"shutdown_timeout": 10}
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}
    else {}
)


def _config(launch: Launch, start_method: str = "spawn") -> LaunchConfig:
    return LaunchConfig(
        min_nodes=launch.nnodes,
        max_nodes=launch.nnodes,
        nproc_per_node=len(launch.plan_ranks),
        run_id=launch.run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=launch.rdzv_endpoint,
        rdzv_configs={"is_host": launch.is_host, "join_timeout": launch.rdzv_timeout_s},
        max_restarts=0,  # cpn owns retries: a failure goes back to the caller at once
        monitor_interval=0.1,
        start_method=start_method,
        logs_specs=_PlanRankLogs(launch.files, launch.plan_ranks),
        local_addr=launch.local_addr,
        **_SHUTDOWN,  # type: ignore[arg-type]
    )


def run(launch: Launch, on_metrics: MetricsCallback | None = None) -> None:
    """Run this node's workers to the end.

    Raises `WorkerFailed` for the first worker that failed (torch's elastic agent has
    already ended the others on this node), `RendezvousFailed` when the node could not
    join the run. SIGTERM/SIGINT end every worker and are re-raised as torch's
    `SignalException`.
    """
    if not launch.plan_ranks:
        raise ValueError("plan_ranks: a launch needs at least one worker")
    launch.run_dir.mkdir(parents=True, exist_ok=True)
    files = launch.files
    for rank in launch.plan_ranks:
        for path in (files.metrics(rank), files.error(rank)):
            path.unlink(missing_ok=True)
    tail = _MetricsTail(files, launch.plan_ranks, on_metrics) if on_metrics else None
    if tail is not None:
        tail.start()
    try:
        with _environment(worker_env(launch)):
            guarded = ("-m", "cpn.train.guard", launch.entrypoint, *launch.argv)
            elastic_launch(_config(launch), sys.executable)(*guarded)
    except ChildFailedError as exc:
        raise _failure(exc, launch) from None
    except RendezvousError as exc:
        raise RendezvousFailed(_rendezvous_reason(exc, launch)) from None
    finally:
        if tail is not None:
            tail.stopping.set()
            tail.join()


def _call_in_group(fn: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str]) -> Any:
    """A function worker: join the gloo group torch's agent set up, call, leave.

    `env`: the launcher's own variables for its workers (`worker_env`). A worker forked
    from the fork server starts from the server's environment, not the caller's, so they
    are set here. An exception is written to the worker's log as an `error:` line, which
    `WorkerFailed` reports: torch's agent writes no error file for a function worker, and
    the traceback multiprocessing prints goes to the launcher's stderr, not the log."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        return fn(dist.get_rank(), dist.get_world_size(), *args)
    except BaseException as exc:
        if not (isinstance(exc, SystemExit) and exc.code in (0, None)):  # a clean exit
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_function(fn: Callable[..., Any], world: int, *args: Any, run_dir: Path) -> list[Any]:
    """`fn(rank, world, *args)` on `world` gloo workers on this machine; results by rank.

    For tests and experiments on the comm library. `fn` must be importable (a module-level
    function). torch starts the workers from multiprocessing's fork server, which has
    imported torch once (`FORKSERVER_PRELOAD`): with spawn every worker imported it again,
    9–12 s of start-up for 8 workers on 2 cores against 0.4–1.6 s (measured). The server
    holds no threads or process group when it forks, so each worker starts clean, as under
    spawn — but with the environment of the server (started by the first call in this
    process) and torch's per-worker variables, not the caller's: anything else `fn`
    needs is passed in `args`. A worker that raises fails the call with its message
    (`WorkerFailed`), after the others were ended.
    """
    launch = Launch(argv=(), plan_ranks=list(range(world)), run_dir=run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Read when the fork server starts (the first call in this process); later calls reuse it.
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    env = worker_env(launch)
    try:
        with _environment(env):  # torch's agent reads OMP_NUM_THREADS from it
            config = _config(launch, start_method="forkserver")
            results = elastic_launch(config, _call_in_group)(fn, args, env)
    except ChildFailedError as exc:
        raise _failure(exc, launch) from None
    return [results[r] for r in range(world)]


#: How torch's agent ends the other workers once one has failed.
_SHUTDOWN_STATUS = -int(signal.SIGTERM)


def _failure(exc: ChildFailedError, launch: Launch) -> WorkerFailed:
    """Every worker that failed by itself, the root cause first.

    Once one worker fails, torch's agent ends the others with SIGTERM and lists them as
    failures too: those are not failures of their own and are left out (unless every
    failure is one, when the earliest stands). torch's timestamps have a resolution of a
    second, so among the rest the root cause is the earliest, then the lowest rank."""
    every = list(exc.failures.values())
    own = [f for f in every if f.exitcode != _SHUTDOWN_STATUS] or every
    own.sort(key=lambda f: (f.timestamp, f.local_rank))
    failures = []
    for f in own:
        rank = launch.plan_ranks[f.local_rank]
        failures.append(Failure(rank, f.exitcode, _reason(f.message, launch.files.tail(rank))))
    return WorkerFailed(failures, launch.files.tail(failures[0].rank))


def _rendezvous_reason(exc: RendezvousError, launch: Launch) -> str:
    """One line: where, and the innermost cause torch chained (its outer message only says
    to look at the inner one — "address already in use", "connection refused", ...)."""
    cause: BaseException = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    what = (str(cause) or type(cause).__name__).strip().splitlines()[0]
    role = "serving" if launch.is_host else "joining"
    return f"rendezvous failed ({role} {launch.rdzv_endpoint}), no worker started: {what}"


def _reason(message: str, tail: list[str]) -> str:
    """One line: the worker's own error line if it printed one, else torch's message."""
    for line in reversed(tail):
        if line.startswith("error: "):
            return line.removeprefix("error: ")
    if message and not message.startswith("To enable traceback"):
        return message.splitlines()[0]
    return tail[-1] if tail else "(no output)"


def outcome(error: WorkerFailed | RendezvousFailed | None) -> dict[str, Any]:
    """What `result.json` says: ok, or every failed rank and the first one's last lines,
    or why the node could not join the run (`error`: no worker started)."""
    if error is None:
        return {"ok": True}
    if isinstance(error, RendezvousFailed):
        return {"ok": False, "error": str(error)}
    return {
        "ok": False,
        "failures": [
            {"rank": f.rank, "status": f.status, "reason": f.reason} for f in error.failures
        ],
        "tail": error.tail,
    }


def main(argv: list[str]) -> int:
    """Run the `Launch` in the JSON file argv[1]; 0, or 1 when a worker failed."""
    import json  # noqa: PLC0415

    doc = json.loads(Path(argv[1]).read_text())
    launch = Launch(**{**doc, "run_dir": Path(doc["run_dir"])})
    error: WorkerFailed | RendezvousFailed | None = None
    try:
        run(launch)
    except (WorkerFailed, RendezvousFailed) as exc:
        error = exc
        print(f"error: {exc}", file=sys.stderr)
    finally:
        (launch.run_dir / "result.json").write_text(json.dumps(outcome(error)) + "\n")
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
